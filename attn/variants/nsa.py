"""Moved to attn.variants.mechanisms.nsa; this old path re-exports it (every name, private ones too)."""

from attn.variants.mechanisms import nsa as _moved
from attn.variants.mechanisms.nsa import *  # noqa: F401,F403


def __getattr__(name: str):
  return getattr(_moved, name)
