"""XLA:CPU flag sets that decide which library runs a dot, by name, and the check of XLA_FLAGS text.

Read from jaxlib 0.10.2's flag table (`strings libjax_common.so | grep xla_cpu_`)
and checked against the compiled HLO and a perf profile on a 2-core AMD EPYC
(experiments/performance.md, "Dot by dot"): a dot inside a `__ynn_fusion`
runs in YNNPACK (ynn::dot_fp32 kernels); a plain `dot` runs in XLA's DotThunk,
Eigen's tensor contraction with oneDNN's sgemm as its kernel. The oneDNN
rewrite flags are accepted by this jaxlib but change nothing in the HLO (no
`__onednn$matmul` custom call, no oneDNN fusion): the wheel is built without it.
"""

from __future__ import annotations

import os
import re

from attn.config import invalid

FLAG_SETS = {
    "default": "",
    "eigen": "--xla_cpu_experimental_ynn_fusion_type=",
    "eigen+xnnpack": "--xla_cpu_experimental_ynn_fusion_type= --xla_cpu_use_xnnpack=true",
    "xnn-dot": "--xla_cpu_experimental_ynn_fusion_type= --xla_cpu_experimental_xnn_fusion_type=dot",
    "onednn": "--xla_cpu_use_onednn=true --xla_cpu_experimental_onednn_custom_call=true",
}
_FLAG = re.compile(r"--xla_[a-z0-9_]+(=\S*)?$")


def flag_set(name: str) -> str:
  """The XLA_FLAGS text of a named flag set; an unknown name is a ConfigError naming it."""
  if name not in FLAG_SETS:
    raise invalid("flag set", name, f"one of {sorted(FLAG_SETS)}")
  return FLAG_SETS[name]


def check_xla_flags(text: str, field: str = "XLA_FLAGS") -> list[str]:
  """The tokens of an XLA_FLAGS value, each `--xla_name[=value]`; anything else is a ConfigError naming it.

  XLA itself aborts the process on an unknown flag name (parse_flags_from_env),
  after JAX has started; this catches the malformed ones before.
  """
  tokens = text.split()
  for token in tokens:
    if not _FLAG.match(token):
      raise invalid(field, token, "space-separated --xla_<name>[=<value>] flags")
  return tokens


def with_flag_set(name: str, env: dict[str, str] | None = None) -> dict[str, str]:
  """A copy of env (default os.environ) whose XLA_FLAGS adds the named set to what is there, checked."""
  env = dict(os.environ if env is None else env)
  text = " ".join(t for t in (env.get("XLA_FLAGS", ""), flag_set(name)) if t)
  check_xla_flags(text)
  env["XLA_FLAGS"] = text
  return env
