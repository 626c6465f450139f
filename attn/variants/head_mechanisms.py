"""Moved to attn.variants.mechanisms.head_mechanisms; this old path re-exports it (every name, private ones too)."""

from attn.variants.mechanisms import head_mechanisms as _moved
from attn.variants.mechanisms.head_mechanisms import *  # noqa: F401,F403


def __getattr__(name: str):
  return getattr(_moved, name)
