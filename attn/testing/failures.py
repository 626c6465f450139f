"""How the kit reports: every failure one AssertionError naming the check, the record, the property,
the hook where one applies and the config; a pass, when asked, what was checked.

check_variant, check_mechanism and check_family run each property inside `Checks.property`: an
AssertionError of the property is prefixed with the check and its record (check_variant('mine'):
...), and anything else it raises (an einsum error, a ConfigError of attn.apply, a HookError of the
shared path) becomes an AssertionError saying the same, with the original chained as its cause.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Callable, Iterable, Iterator, TextIO

# The fields of a record that hold user code: a traceback through one of them names it as the hook.
HOOKS = ("init", "apply", "check", "on_qk", "on_logits", "on_output", "kernel", "param_count",
         "effective_param_count", "flops", "score_weights", "kv_tokens", "kv_cache_width", "decode_apply",
         "cache_entries", "attend_cached", "circuits", "config_in", "config_out", "weights_in", "weights_out")


def _first_line(e: BaseException) -> str:
  text = str(e).strip().splitlines()
  return f"{type(e).__name__}: {text[0] if text else ''}"


def hook_of(e: BaseException, records: Iterable[Any]) -> str | None:
  """The record's hook that raised e (a HookError names it; else the innermost traceback frame in one)."""
  if getattr(e, "hook", None) and getattr(e, "mechanism", None):
    return f"mechanism {e.mechanism!r}.{e.hook}"
  codes = {}
  for r in records:
    kind = type(r).__name__.lower()
    for field in HOOKS:
      fn = getattr(r, field, None)
      code = getattr(fn, "__code__", None)
      if code is not None:
        codes[code] = f"{kind} {r.name!r}.{field}"
  found, tb = None, e.__traceback__
  while tb is not None:
    found = codes.get(tb.tb_frame.f_code, found)
    tb = tb.tb_next
  return found


class Checks:
  """What one call of the kit checked, and how it names a failure."""

  def __init__(self, kit: str, record: str, verbose: bool = False, stream: TextIO | None = None):
    self.kit, self.record, self.verbose = kit, record, verbose
    self.stream = stream
    self.properties: dict[str, None] = {}
    self.configs: dict[str, None] = {}

  @property
  def who(self) -> str:
    return f"{self.kit}({self.record!r})"

  @contextlib.contextmanager
  def property(self, names: str | tuple[str, ...], config: str = "", records: Iterable[Any] = (),
               where: str = "", passthrough: tuple[type, ...] = (), tally: bool = True) -> Iterator[None]:
    """One property (or several computed together, named in order) at one config; failures named.

    passthrough: exception types raised as they are (a ConfigError refusing the kit's own arguments);
    tally=False: a guard around other properties, not counted as one when it passes."""
    names = (names,) if isinstance(names, str) else names
    try:
      yield
    except passthrough:
      raise
    except AssertionError as e:
      text = str(e)
      if text.startswith(f"{self.kit}(") or text.startswith("check_"):
        raise
      raise AssertionError(f"{self.who}: {text}") from e.__cause__
    except Exception as e:  # noqa: BLE001  (whatever the record raised: named, then chained)
      hook = hook_of(e, records)
      names = (e.attn_property,) if getattr(e, "attn_property", None) else names
      detail = " ".join(p for p in (where, f"at {config}" if config else "") if p)
      raise AssertionError(f"{self.who}: {'/'.join(names)}: " + (f"{detail}: " if detail else "")
                           + (f"in {hook}, " if hook else "") + f"raised {_first_line(e)}") from e
    if not tally:
      return
    for n in names:
      self.properties.setdefault(n, None)
    if config:
      self.configs.setdefault(config, None)

  def run(self, names, config: str, records: Iterable[Any], fn: Callable[..., Any], *args, where: str = "",
          **kwargs) -> Any:
    with self.property(names, config, records, where):
      return fn(*args, **kwargs)

  def passed(self) -> None:
    """With verbose: one line saying how many properties at how many configs passed."""
    if not self.verbose:
      return
    stream = self.stream or sys.stdout
    configs = f" at {len(self.configs)} config{'s' * (len(self.configs) != 1)}" if self.configs else ""
    stream.write(f"{self.who}: passed {len(self.properties)} properties{configs}: "
                 f"{', '.join(self.properties)}\n")
    for c in self.configs:
      stream.write(f"  {c}\n")
