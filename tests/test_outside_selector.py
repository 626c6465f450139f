"""docs/extending.md's key-selecting mechanism written outside attn (norm_topk), built from the page's code.

The module and its pyproject.toml are the page's code blocks, so the page and this test cannot drift.
Fast: the kit on it, and its attention against a reference written here (per query, the k visible
keys of largest norm, then a softmax over them) at awkward shapes. Slow: installed as a distribution
(its entry point, as tests/test_plugins.py installs the README's plugin) and trained by `attn sweep
--workers 2`.
"""

import contextlib
import importlib
import json
import os
import re
import subprocess
import sys

import jax
import numpy as np
import pytest

from attn import HeadConfig, testing
from attn.variants import base
from attn.variants.mechanisms import MECHANISMS
from conftest import TINY_MQAR, randn

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECTION = "### A key-selecting mechanism"


def _block(lang: str) -> str:
  """The first ```lang block of docs/extending.md's section on a key-selecting mechanism."""
  text = open(os.path.join(REPO, "docs", "extending.md"), encoding="utf-8").read()
  return re.search(rf"```{lang}\n(.*?)```", text[text.index(SECTION):], re.S).group(1)


def _entry_point() -> tuple[str, str]:
  """(name, "module:OBJECT") of the page's [project.entry-points."attn.mechanisms"] table."""
  toml = _block("toml")
  table = toml[toml.index('[project.entry-points."attn.mechanisms"]'):]
  name, target = re.search(r'^(\w+) = "([\w.:]+)"', table.split("\n", 1)[1], re.M).groups()
  return name, target


@pytest.fixture(scope="module")
def norm_topk(tmp_path_factory):
  """The page's package under a temporary root with its dist-info (no pip), as pip would leave it."""
  root = tmp_path_factory.mktemp("norm_topk")
  name, target = _entry_point()
  module = target.split(":")[0]
  (root / f"{module}.py").write_text(_block("python"))
  info = root / "norm_topk-0.1.dist-info"
  info.mkdir()
  (info / "METADATA").write_text("Metadata-Version: 2.1\nName: norm-topk\nVersion: 0.1\n")
  (info / "entry_points.txt").write_text(f"[attn.mechanisms]\n{name} = {target}\n")
  return str(root), name, module


@contextlib.contextmanager
def _installed(root: str, module: str):
  sys.path.insert(0, root)
  importlib.invalidate_caches()
  MECHANISMS.reload()
  try:
    yield
  finally:
    sys.path.remove(root)
    sys.modules.pop(module, None)
    importlib.invalidate_caches()
    MECHANISMS.reload()


def _reference(q, k, v, lengths, top: int):
  """Per (b, h, t): the top keys by norm among s <= t (causal, T = S) and s < lengths[b], softmax."""
  B, T, H, K = q.shape
  G = k.shape[2]
  out = np.zeros((B, T, H, v.shape[3]))
  for b in range(B):
    for h in range(H):
      g = h // (H // G)
      for t in range(T):
        seen = [s for s in range(T) if s <= t and s < lengths[b]]
        keep = sorted(seen, key=lambda s: -np.linalg.norm(k[b, s, g]))[:top]
        if not keep:
          continue  # a row that sees nothing: zeros
        logits = np.array([q[b, t, h] @ k[b, s, g] for s in keep]) / np.sqrt(K)
        p = np.exp(logits - logits.max())
        out[b, t, h] = (p / p.sum()) @ v[b, keep, g]
  return out


def test_the_pages_selector_passes_the_kit_and_attends_to_its_keys(norm_topk):
  root, name, module = norm_topk
  with _installed(root, module):
    assert MECHANISMS.source(name) == "norm-topk"
    m = MECHANISMS[name]
    testing.check_mechanism(m)
    # H = 6 over G = 2 kv heads, d_v != d_k, T not a block multiple, one sequence fully padded.
    cfg = HeadConfig(d_model=12, num_heads=6, num_kv_heads=2, d_k=5, d_v=3, extra={name: {"k": 3}})
    q, k, v = randn(1, (3, 7, 6, 5)), randn(2, (3, 7, 2, 5)), randn(3, (3, 7, 2, 3))
    lengths = np.array([7, 4, 0])
    opts = base.Options(is_causal=True, kv_lengths=jax.numpy.asarray(lengths))
    got, _ = jax.jit(lambda q, k, v: base.core({}, q, k, v, cfg=cfg, opts=opts))(q, k, v)
    want = _reference(*(np.asarray(a, np.float64) for a in (q, k, v)), lengths, 3)
    np.testing.assert_allclose(got, want, atol=2e-5)
    plain, _ = jax.jit(lambda q, k, v: base.core({}, q, k, v, cfg=cfg.replace(extra=None), opts=opts))(q, k, v)
    assert not np.allclose(got, plain, atol=1e-3)  # the choice restricts: not every visible key


@pytest.mark.slow  # a two-trial sweep on two worker processes: about a minute of CPU
def test_the_pages_selector_trains_in_a_sweep_with_two_workers(norm_topk, tmp_path):
  root, name, _ = norm_topk
  cfg = tmp_path / "c.toml"
  cfg.write_text(TINY_MQAR + f"[model.extra.{name}]\nk = 2\n[train]\nsteps = 3\nbatch_size = 2\n"
                 "eval_every = 3\neval_batches = 1\n[sweep]\nseeds = [0]\n"
                 f'[sweep.grid]\n"model.extra.{name}.k" = [2, 12]\n')
  env = {**os.environ, "PYTHONPATH": root + os.pathsep + REPO}
  run = subprocess.run([sys.executable, "-m", "attn", "sweep", str(cfg), "--out", str(tmp_path / "out"),
                        "--workers", "2", "--no-report"], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=600)
  assert run.returncode == 0, run.stdout + run.stderr
  assert "workers done: 2 trials: 2 ok" in run.stdout + run.stderr
  header = json.load(open(tmp_path / "out" / "sweep.json"))
  losses = {}
  for t in header["trials"]:
    trial = tmp_path / "out" / "trials" / t["id"]
    k = json.load(open(trial / "config.json"))["model"]["extra"][name]["k"]
    rows = [json.loads(line) for line in open(trial / "metrics.jsonl")]
    losses[k] = [r["loss"] for r in rows if "loss" in r]
    assert losses[k] and all(np.isfinite(losses[k]))
  assert sorted(losses) == [2, 12] and losses[2] != losses[12]  # 2 of 12 keys is another model
