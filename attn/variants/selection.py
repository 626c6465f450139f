"""Moved to attn.variants.mechanisms.selection; this old path re-exports it (every name, private ones too)."""

from attn.variants.mechanisms import selection as _moved
from attn.variants.mechanisms.selection import *  # noqa: F401,F403


def __getattr__(name: str):
  return getattr(_moved, name)
