"""Cross-layer sharing of the indexer's choice: ModelConfig.indexer_types, one entry per layer,
"full" (the layer's indexer chooses its keys) or "shared" (it reuses the previous full layer's
top-k: GLM-5's IndexShare, transformers' `indexer_types` in glm_moe_dsa, glm5_next, hy_v4 and
mistral_large4). The indexer is the lightning indexer (extra.indexer) or GLM-5.3-Flash's K-pool
indexer (extra.kpool, attn.variants.mechanisms.pooled: its shared layers alike, SELECTORS).

  indexer_types = ["full", "shared", "shared", "full"]   layers 1 and 2 attend to layer 0's keys

A shared layer's HeadConfig (ModelConfig.layer_head) carries extra.indexer.shared (extra.kpool.shared) = True: it
holds no indexer weights (selection._indexer_init), computes no index queries or keys and caches none (mla's
computes_index), and counts none of the indexer's parameters, FLOPs or cache bytes (attn count reads
the same head); its attention over the chosen keys is counted as any indexer layer's. Its select
hands back what the full layer's select returned in the same model call, in the full pass and in each
decoding step alike (selection.SHARED_CHOICE, set here around each layer by models.run_blocks): the
same keys, on the same kernel row. transformers passes the previous layer's top-k on through every
layer, so a run of shared layers reuses the last full layer's.

Refused by name (check, before any tracing): an entry other than "full" / "shared", a list of
another length, "shared" on a layer without the indexer, on the first indexed layer or after a layer
without one (there is no choice to reuse), a shared layer whose full layer has another top-k or
index form (or, for K-pool, another pool size or tail rule; or the other selector), an encoder-decoder
stack, and extra.indexer.shared (extra.kpool.shared) set on the model (it is per layer).
"""

from __future__ import annotations

import contextlib
from typing import Any

from attn.config import FrozenDict, HeadConfig, invalid
from attn.variants.mechanisms import pooled, selection

KINDS = ("full", "shared")
SELECTORS = ("indexer", "kpool")  # the selections a layer may share: the lightning and K-pool indexers
_SAME = {"indexer": ("top_k", "form"), "kpool": ("top_k", "kpool", "always_select_tail", "form")}


def selector(head: HeadConfig) -> str | None:
  """The layer's shareable selection (extra.indexer or extra.kpool), None without one."""
  return next((n for n in SELECTORS if n in (head.extra or {})), None)


def head_shared(head: HeadConfig) -> bool:
  """Whether the layer's HeadConfig reuses another layer's choice."""
  return selection.is_shared(head) or pooled.is_shared(head)


def normalize(value: Any) -> Any:
  """indexer_types as a tuple (TOML and JSON give lists); None when every layer is "full" is kept as given."""
  return tuple(value) if isinstance(value, list) else value


def is_shared(m: Any, index: int) -> bool:
  """Whether layer `index` reuses an earlier layer's choice."""
  return m.indexer_types is not None and m.indexer_types[index] == "shared"


def mark(m: Any, index: int, head: HeadConfig) -> HeadConfig:
  """head (layer `index`'s) with extra.indexer.shared (extra.kpool.shared) = True where indexer_types says
  "shared"."""
  name = selector(head)
  if not is_shared(m, index) or name is None:
    return head
  extra = dict(head.extra)
  extra[name] = FrozenDict({**dict(extra[name]), "shared": True})
  return head.replace(extra=extra)


def source(m: Any, index: int) -> int:
  """The full layer whose choice layer `index` uses (itself unless shared)."""
  j = index
  while is_shared(m, j):
    j -= 1
  return j


def _indexed(m: Any, index: int) -> bool:
  return m.has_attention(index) and selector(m.layer_head(index)) is not None


def check(m: Any) -> None:
  """Refuses what has no choice to reuse, or another one (module docstring)."""
  if head_shared(m.head):
    raise invalid(f"extra.{selector(m.head)}.shared", True, "unset on the model: a layer reuses another's choice "
                  "where indexer_types says 'shared'")
  kinds = m.indexer_types
  if kinds is None:
    return
  L = m.num_layers
  if not isinstance(kinds, tuple) or len(kinds) != L or not all(isinstance(k, str) for k in kinds):
    raise invalid("indexer_types", kinds, f"None or a list of {L} entries (num_layers), each one of {list(KINDS)}")
  for i, k in enumerate(kinds):
    if k not in KINDS:
      raise invalid(f"indexer_types[{i}]", k, f"one of {list(KINDS)}")
  if "shared" in kinds and m.num_decoder_layers:
    raise invalid("num_decoder_layers", m.num_decoder_layers, "0 with shared indexer layers: a decoder-only "
                  "stack (indexer_types)")
  for i, k in enumerate(kinds):
    if k != "shared":
      continue
    where = f"indexer_types[{i}]"
    if not _indexed(m, i):
      raise invalid(where, k, f"'full': layer {i} has no indexer (extra.indexer or extra.kpool), so it has no "
                    "choice to share")
    if not any(_indexed(m, j) for j in range(i)):
      raise invalid(where, k, f"'full': layer {i} is the first layer with the indexer; a shared layer reuses "
                    "the choice of an earlier one")
    if not _indexed(m, i - 1):
      raise invalid(where, k, f"'full': layer {i - 1} before it has no indexer, so no choice reaches layer {i}")
    check_pair(m.layer_head(i), m.layer_head(source(m, i)), where, source(m, i))


def check_pair(shared: HeadConfig, full: HeadConfig, where: str, j: int) -> None:
  """Refuses a shared layer whose full layer (j) chooses with the other selector, another number of keys or in
  another form (K-pool: another pool size or tail rule)."""
  name = selector(shared)
  if selector(full) != name:
    raise invalid(where, "shared", f"'full': its full layer {j} chooses with extra.{selector(full)}, this layer "
                  f"with extra.{name}; a shared layer reuses a choice of the same kind")
  options = selection.options_of if name == "indexer" else pooled.options
  a, b = options(shared, name), options(full, name)
  for key in _SAME[name]:
    if a[key] != b[key]:
      raise invalid(where, "shared", f"'full': its full layer {j} has extra.{name}.{key}={b[key]!r}, this layer "
                    f"{a[key]!r}; a shared layer reuses a choice of the same size and kind")


# ---- the hook: set around each layer of one model call (attn.nn.models.run_blocks).

@contextlib.contextmanager
def model_call(blocks):
  """Around one call of a stack of blocks: a fresh record of the full layers' choices (a dict the
  layer() contexts fill and read), or nothing where no layer is shared."""
  heads = [getattr(getattr(b, "attn", None), "cfg", None) for b in blocks]
  if not any(h is not None and head_shared(h) for h in heads):
    yield None
    return
  yield {"heads": heads, "last": None}


@contextlib.contextmanager
def layer(record, index: int):
  """Around layer `index`'s call: a full indexer layer records its choice, a shared one reuses the last."""
  head = None if record is None else record["heads"][index]
  if head is None or selector(head) is None:
    yield
    return
  if head_shared(head):
    state = ("reuse", record["last"] if record["last"] is not None else {})
  else:
    record["last"] = {}
    state = ("record", record["last"])
  token = selection.SHARED_CHOICE.set(state)
  try:
    yield
  finally:
    selection.SHARED_CHOICE.reset(token)
