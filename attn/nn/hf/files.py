"""Reading a checkpoint: a local directory (config.json, safetensors through numpy) or a live transformers
model; and HF's attention_mask as attn's lengths.

A directory is read with safetensors' numpy API: no torch, no transformers,
never pickle (pytorch_model.bin is refused).
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterable

import numpy as np

from attn.config import invalid
from attn.nn.hf.base import require


def read_config(path: str) -> dict[str, Any]:
  """config.json of a local Hugging Face checkpoint directory, refusing anything else."""
  where = os.path.join(path, "config.json") if isinstance(path, (str, os.PathLike)) else None
  if where is None or not os.path.isdir(path) or not os.path.isfile(where):
    raise invalid("source", str(path), "a Hugging Face checkpoint directory holding config.json and "
                  "model.safetensors (as save_pretrained writes it), or a transformers model such as "
                  "GPT2LMHeadModel or BertModel")
  try:
    with open(where, encoding="utf-8") as f:
      return json.load(f)
  except (OSError, ValueError) as e:
    raise invalid("source", where, f"a readable JSON config.json ({e})") from None


def _weight_files(path: str) -> list[str]:
  """model.safetensors, or the shards its index names; a directory without them refused."""
  index = os.path.join(path, "model.safetensors.index.json")
  if os.path.isfile(index):
    with open(index, encoding="utf-8") as f:
      files = sorted(set(json.load(f)["weight_map"].values()))
  elif os.path.isfile(os.path.join(path, "model.safetensors")):
    files = ["model.safetensors"]
  else:
    found = sorted(n for n in os.listdir(path) if n.endswith((".bin", ".safetensors", ".h5", ".msgpack")))
    raise invalid("source", str(path), "a directory with model.safetensors (or its index); found "
                  f"{found or 'no weights'}: attn reads safetensors only, never pickle "
                  "(re-save with save_pretrained)")
  return files


def read_shapes(path: str) -> dict[str, tuple[int, ...]]:
  """Every tensor's name and shape, from the safetensors headers alone: no weight is read."""
  safe_open = require("safetensors").safe_open
  out = {}
  for name in _weight_files(path):
    try:
      with safe_open(os.path.join(path, name), framework="numpy") as f:
        out |= {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except Exception as e:  # a truncated or foreign file
      raise invalid("source", os.path.join(path, name), f"a safetensors file ({e})") from None
  return out


def read_weights(path: str) -> dict[str, np.ndarray]:
  """Every tensor of model.safetensors (or its shards) as numpy, through safetensors' numpy API."""
  load_file = require("safetensors.numpy").load_file
  out = {}
  for name in _weight_files(path):
    try:
      out.update(load_file(os.path.join(path, name)))
    except Exception as e:  # a truncated file, or a dtype numpy lacks (bfloat16)
      raise invalid("source", os.path.join(path, name), f"a safetensors file numpy can read ({e})") from None
  return out


def read_object(obj: Any, architectures: Iterable[str]) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
  """(config dict, float32 numpy tensors) of a live transformers model of one of `architectures`."""
  name, known = type(obj).__name__, sorted(architectures)
  if name not in known or not hasattr(obj, "state_dict"):
    raise invalid("source", name, f"one of {known}, or a local checkpoint directory")
  weights = {k: t.detach().cpu().float().numpy() for k, t in obj.state_dict().items()}
  return obj.config.to_dict(), weights


def lengths_from_attention_mask(attention_mask: Any) -> np.ndarray:
  """(B,) lengths of a right-padded HF attention_mask (B,T) of ones then zeros; others refused."""
  m = np.asarray(attention_mask)
  if m.ndim != 2:
    raise invalid("attention_mask.shape", m.shape, "(B, T)")
  lengths = m.astype(bool).sum(-1)
  if not (m.astype(bool) == (np.arange(m.shape[1]) < lengths[:, None])).all():
    raise invalid("attention_mask", "not right-padded",
                  "ones then zeros in every row (right padding); attn cannot express left padding")
  return lengths.astype(np.int32)
