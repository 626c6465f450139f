"""The key-selection rows of the kernel's table: attention over the keys a choice names only.

A key choice (call.KeyChoice, made by a mechanism's select: attn.variants.mechanisms) names its row:
"gathered" (attn.kernel.gathered: the chosen blocks of each (query, head), each (query, block) pair
computed once; MoBA's, nsa's selected branch) or "sparse" (attn.kernel.sparse: the blocked kernel
over the key blocks holding a chosen token, masked inside; the indexer's). Both compute the softmax
attention restricted to the chosen keys under is_causal and kv_lengths, with a softcap; neither
builds a T×S array. What they cannot run is refused here as every row's is (a Refusal): the
choice then becomes a dense mask on the dense path (impls.selects says when, the one rule).
"""

from __future__ import annotations

import jax

from attn.kernel import gathered, sparse
from attn.kernel.call import Call, Refusal

Array = jax.Array

ROWS = ("gathered", "sparse")


def why_not(call: Call, row: str | None = None) -> Refusal | None:
  """What of a call a key-selection row cannot run (row None: whether any could, before choosing)."""
  if row is not None and call.choice is None:
    return Refusal("choice", None, "a kernel.KeyChoice", f"the {row} kernel attends to chosen keys only "
                   "(a key-selecting mechanism's choice)")
  if row is not None and call.choice.impl != row:
    return Refusal("choice", call.choice.impl, f'a choice for "{row}"', "each choice names the row that "
                   "runs it")
  if call.mask is not None:
    return Refusal("mask", "an array", "None", "a dense mask joins the choice on the dense path")
  if call.window is not None:
    return Refusal("window", call.window, "None", "the selection kernels visit chosen blocks, not a band")
  if call.sinks is not None:
    return Refusal("sinks", "an array", "None", "the selection kernels have no sink in the denominator")
  if call.probability != "softmax":
    return Refusal("probability", call.probability, '"softmax"', "a selection restricts a softmax")
  if call.return_weights:
    return Refusal("return_weights", True, "False", "the weights are the (B,H,T,S) array a selection avoids")
  if call.logits_bias is not None:
    return Refusal("logits_bias", "an array", "None", "the selection kernels take structured masks only")
  return None


def run_gathered(call: Call) -> Array:
  return gathered.attention(call.q_BTHK, call.k_BSGK, call.v_BSGV, **call.choice.args, scale=call.scale,
                            is_causal=call.is_causal, kv_lengths=call.kv_lengths, softcap=call.softcap)


def run_sparse(call: Call) -> Array:
  return sparse.attention(call.q_BTHK, call.k_BSGK, call.v_BSGV, **call.choice.args, scale=call.scale,
                          is_causal=call.is_causal, kv_lengths=call.kv_lengths, softcap=call.softcap)
