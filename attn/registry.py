"""Registries of attn's extension points: built-in records, plugins found by entry point, and
records registered at run time.

Each extension point (variants, head mechanisms, checkpoint families) has one Registry. It is a
read-only Mapping from name to record, filled the first time it is read:

1. the built-ins, from a function the extension point's package passes in (so this module imports
   none of them);
2. the entry points of the registry's group (`attn.variants`, `attn.mechanisms`,
   `attn.hf_families`) of every installed distribution, each naming one record. Worker processes
   and cluster jobs read the same installed metadata, so they see the same plugins;
3. `register(record)`, for the current process only (a notebook): worker processes started by
   `attn sweep --workers`, `--processes-per-trial` or Slurm do not see it.

A plugin that fails to import is skipped with a one-line warning naming its entry point and the
error; asking for it by name raises ConfigError saying why it is missing. An entry point that does
not name a record of the registry's type, a record without a name that is an identifier, and two
records with one name are refused with ConfigError naming the distribution(s) and the entry point.
"""

from __future__ import annotations

import collections.abc
import importlib.metadata
import threading
import warnings
from typing import Any, Callable, Generic, Iterable, Iterator, TypeVar

from attn.config import ConfigError, did_you_mean

R = TypeVar("R")

BUILTIN = "attn"        # the source of a built-in record
RUNTIME = "register()"  # the source of a record added by Registry.register


# Every Registry made, so that register() finds the one a record belongs to by its type.
REGISTRIES: list[Registry] = []


def register(record: Any) -> Any:
  """Add a record (a Variant, a Mechanism, ...) to its registry, for this process only.

  A notebook's records reach attn.apply, init, count and the NNX modules in this
  process; worker processes started by `attn sweep --workers`, `--processes-per-trial`
  or Slurm do not see them: put the record behind an entry point for those.
  """
  for registry in REGISTRIES:
    if isinstance(record, registry.record_type):
      return registry.register(record)
  kinds = ", ".join(f"{r.record_type.__module__}.{r.record_type.__qualname__}" for r in REGISTRIES)
  raise ConfigError(f"record={type(record).__name__} {record!r:.60} is not allowed: one of {kinds}")


class PluginWarning(UserWarning):
  """An installed plugin that could not be loaded; everything else still works."""


def check_record(record: Any, kind: str, required: Iterable[str], where: str) -> None:
  """Refuse a record without a name that is an identifier, or without a required field."""
  name = getattr(record, "name", None)
  if not isinstance(name, str) or not name.isidentifier():
    raise ConfigError(f"{where}: {kind}.name={name!r} is not allowed: a Python identifier")
  for field in required:
    if getattr(record, field, None) is None:
      raise ConfigError(f"{where}: {kind} {name!r} has no {field!r}: a {kind} must give "
                        f"{', '.join(required)}")


class Registry(collections.abc.Mapping, Generic[R]):
  """Name -> record for one extension point; built-ins, then entry points, then register()."""

  def __init__(self, kind: str, group: str, record_type: type,
               builtins: Callable[[], Iterable[R]], required: tuple[str, ...] = ()):
    self.kind, self.group, self.record_type = kind, group, record_type
    self.required = ("name", *required)
    self._builtins = builtins
    self._records: dict[str, R] | None = None
    self._sources: dict[str, str] = {}
    self._broken: dict[str, str] = {}  # entry-point name -> why it could not be loaded
    self._wheres: dict[str, str] = {}  # name -> where its record came from, in words
    self._lock = threading.RLock()
    REGISTRIES.append(self)

  # -- filling ------------------------------------------------------------------------------
  def _load(self) -> dict[str, R]:
    if self._records is not None:
      return self._records
    with self._lock:
      if self._records is not None:
        return self._records
      records: dict[str, R] = {}
      sources: dict[str, str] = {}
      for record in self._builtins():
        self._add(records, sources, record, BUILTIN, f"built-in {self.kind}")
      for ep in _entry_points(self.group):
        dist = _dist_name(ep)
        where = f"entry point {ep.name!r} ({ep.value}) of distribution {dist!r}, group {self.group!r}"
        try:
          record = ep.load()
        except Exception as e:  # a broken plugin must not stop attn: one line, then go on
          why = f"{type(e).__name__}: {e}"
          self._broken[ep.name] = f"{where} failed to import ({why})"
          warnings.warn(f"attn: skipped {where}: {why}", PluginWarning, stacklevel=2)
          continue
        self._add(records, sources, record, dist, where)
      self._sources = sources
      self._records = records
      return records

  def _add(self, records: dict, sources: dict, record: Any, source: str, where: str) -> None:
    if not isinstance(record, self.record_type):
      raise ConfigError(f"{where} names {type(record).__name__} {record!r:.80}, not a "
                        f"{self.record_type.__module__}.{self.record_type.__qualname__} record")
    check_record(record, self.kind, self.required[1:], where)
    if record.name in records:
      raise ConfigError(f"two {self.kind}s named {record.name!r}: one from {sources[record.name]!r}, "
                        f"one from {source!r} ({where}); rename one of them")
    records[record.name] = record
    sources[record.name] = source
    self._wheres[record.name] = where

  def register(self, record: R) -> R:
    """Add a record for this process only (worker processes and cluster jobs do not see it)."""
    with self._lock:
      records = dict(self._load())
      sources = dict(self._sources)
      self._add(records, sources, record, RUNTIME, f"{self.kind} registered at run time")
      self._records, self._sources = records, sources
    return record

  def unregister(self, name: str) -> None:
    """Remove a record added by register() (tests and notebooks); built-ins and plugins stay."""
    with self._lock:
      if self._sources.get(name) != RUNTIME:
        raise ConfigError(f"{self.kind}={name!r} was not added by register(); only those can be removed")
      records = dict(self._load())
      del records[name]
      self._records = records
      del self._sources[name]

  # -- reading ------------------------------------------------------------------------------
  def __getitem__(self, name: str) -> R:
    return self._load()[name]

  def __iter__(self) -> Iterator[str]:
    return iter(self._load())

  def __len__(self) -> int:
    return len(self._load())

  def __repr__(self) -> str:
    return f"Registry({self.kind}: {', '.join(self._load())})"

  def resolve(self, name: Any, field: str | None = None) -> R:
    """The record called name, or ConfigError naming the field, the value and the names there are."""
    records = self._load()
    if isinstance(name, str) and name in records:
      return records[name]
    field = field or self.kind
    if isinstance(name, str) and name in self._broken:
      raise ConfigError(f"{field}={name!r} is not available: {self._broken[name]}")
    raise ConfigError(f"{field}={name!r} is not allowed: {did_you_mean(name, records)}one of {sorted(records)}")

  def source(self, name: str) -> str:
    """Where a record came from: 'attn', a distribution's name, or 'register()'."""
    self._load()
    return self._sources[name]

  def where(self, name: str) -> str:
    """Where a record came from, in words: built-in, its entry point and distribution, or register()."""
    self._load()
    return self._wheres.get(name, self._sources.get(name, "unknown"))

  def broken(self) -> dict[str, str]:
    """Entry points that failed to import, and why."""
    self._load()
    return dict(self._broken)

  def reload(self) -> None:
    """Forget everything read, so the next read sees newly installed plugins (register()ed
    records are dropped too)."""
    with self._lock:
      self._records, self._sources, self._broken = None, {}, {}


def _entry_points(group: str) -> list[importlib.metadata.EntryPoint]:
  seen, out = set(), []
  for ep in importlib.metadata.entry_points(group=group):
    key = (ep.name, ep.value, _dist_name(ep))
    if key not in seen:  # a distribution on sys.path twice lists its entry points twice
      seen.add(key)
      out.append(ep)
  return out


def _dist_name(ep: importlib.metadata.EntryPoint) -> str:
  dist = getattr(ep, "dist", None)
  return getattr(dist, "name", None) or "an unknown distribution"

