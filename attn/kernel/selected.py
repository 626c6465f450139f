"""The key-selection rows of the kernel's table: attention over the keys a choice names only.

A key choice (call.KeyChoice, made by a mechanism's select: attn.variants.mechanisms) names its row:
"gathered" (attn.kernel.gathered: the chosen blocks of each (query, head) or kv group, each (query,
block) pair computed once; MoBA's, the block indexer's, nsa's selected branch) or "sparse"
(attn.kernel.sparse: the blocked kernel over the key blocks holding a chosen token, masked inside,
or attn.kernel.tokens; the indexer's, K-pool's, QSA's). key_choice is the rule that picks the row
from the form of a choice. Both compute the softmax attention restricted to the chosen keys under
is_causal and kv_lengths, with a softcap; neither builds a T×S array. What they cannot run is
refused here as every row's is (a Refusal): the choice then becomes a dense mask on the dense path
(impls.selects says when, the one rule).
"""

from __future__ import annotations

import jax

import jax.numpy as jnp

from attn.kernel import gathered, select, sparse, tokens
from attn.kernel.call import Call, KeyChoice, Refusal

Array = jax.Array

ROWS = ("gathered", "sparse")

# Where each form of a choice runs (key_choice, the one rule). "blocks": whole aligned key blocks;
# "units": ids of pools (contiguous unit-long slices of keys); "tokens": token indices.
BLOCKS_ROW = "gathered"  # "sparse": the token kernel over the blocks' tokens (before issue 51's blocks51)
# True: pools gathered whole on the token kernel (tokens.attention's unit), else their tokens one by one.
# Measured not faster (T 8192 and 16384, 2-core EPYC, experiments/performance.md "Whole blocks and whole
# pools"): the same bytes move either way. Exact both ways; kept for an accelerator to measure.
POOLS_WHOLE = False


def key_choice(H: int, G: int, S: int, *, blocks_BGTk: Array | None = None, block: int | None = None,
               units_BGTk: Array | None = None, unit: int = 1, token_block: int = 128) -> KeyChoice:
  """The row a choice runs on, by its form (the one rule; docs/key_selection.md, "Which kernel"):

  blocks_BGTk (B, H|G, T, k): ids of whole key blocks [block·j, block·j + block), per query head or
    per kv group, -1 for none: the "gathered" row (each chosen (query, head, block) pair once, the
    key block sliced, never gathered token by token; MoBA's row);
  units_BGTk (B, 1|G, T, k): distinct ids of unit-long slices of keys (unit 1: token indices), -1 for
    none: the "sparse" row, which runs them on attn.kernel.tokens when a choice is shared by at least
    sparse.TOKENS_MIN_SHARE query heads a kv head (or is per kv group; slices gathered whole with
    POOLS_WHOLE, else token by token), else on the blocked kernel over the token_block-key blocks holding a chosen
    key, masked by their bits.
  """
  if blocks_BGTk is not None:
    blocks_BGTk = jax.lax.stop_gradient(blocks_BGTk).astype(jnp.int32)
    if BLOCKS_ROW == "gathered":
      return KeyChoice("gathered", {"idx_BHTk": jnp.maximum(blocks_BGTk, 0), "valid_BHTk": blocks_BGTk >= 0,
                                    "block": block})
    units_BGTk, unit = blocks_BGTk, block
  units_BGTk = jax.lax.stop_gradient(units_BGTk).astype(jnp.int32)
  if unit > 1 and not POOLS_WHOLE:
    units_BGTk, unit = tokens.unit_tokens(units_BGTk, unit), 1
  if units_BGTk.shape[1] > 1 or H // G >= sparse.TOKENS_MIN_SHARE:
    return KeyChoice("sparse", {"blocks_BHTN": None, "block_k": token_block, "idx_BGTk": units_BGTk,
                                "unit": unit})
  bits = select.indices_to_bits(tokens.unit_tokens(units_BGTk, unit)[:, 0], S)
  return KeyChoice("sparse", {"blocks_BHTN": select.token_blocks(bits, token_block, S), "block_k": token_block,
                              "bits_BTW": bits})



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
