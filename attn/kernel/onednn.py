"""impl="onednn": the attention core's matmuls on oneDNN's sgemm, through jax.ffi (CPU, float32).

XLA:CPU runs the core's small batched products (at the reference shape 64 of
256×64 · 64×256) at about half the rate of torch's GEMMs (experiments/
performance.md, Dot by dot). kernel.attention(impl="onednn") keeps everything
else of the einsum kernel (masks, float32 softmax, sinks, softcap, sigmoid/relu,
weights out), or of the blocked kernel where "auto" would pick it, and computes
the products with four FFI handlers (attn/kernel/onednn_gemm.cc) that call oneDNN's
row-major ``dnnl_sgemm`` once per matrix, read in place from attn's layouts, the
matrices handed out over XLA's own intra-op threads:

  nt(a (B,T,H,D), b (B,S,G,D)) -> (B,H,T,S)   scores q·kᵀ, and dP = dO·vᵀ
  nn(a (B,H,T,S), b (B,S,G,D)) -> (B,T,H,D)   the weighted sum P·v, and dQ = dL·k
  tn(a (B,H,T,S), b (B,T,H,D)) -> (B,S,G,D)   dK = dLᵀ·q and dV = Pᵀ·dO, summed per kv group
  bmm(a (N,M,K), b (N,K,P) or (N,P,K))        the blocked core's block products

nt, nn and tn are one another's VJPs, so gradients of any order work.

What it needs, checked before tracing by attn.kernel.check_impl (the error
names ``impl``): the CPU backend on x86-64 Linux; the ``onednn-cpu-gomp`` wheel
(the ``onednn`` extra: ``pip install -e ".[onednn]"``; its libdnnl.so.3 needs
only the system's libgomp); a C++17 compiler (``$CXX`` or ``c++``); float32
inputs (oneDNN's sgemm). The handler library is built on first use, once per
source, jaxlib and libdnnl, into ``$ATTN_CACHE_DIR`` or ``~/.cache/attn``
(``attn bench`` says in its header whether it runs here, or why not).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.metadata
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

DIST = "onednn-cpu-gomp"
SOURCE = Path(__file__).with_name("onednn_gemm.cc")
TARGETS = ("attn_onednn_nt", "attn_onednn_nn", "attn_onednn_tn", "attn_onednn_bmm")


class Unavailable(RuntimeError):
  """Why impl="onednn" cannot run on this machine."""


def _libdnnl() -> Path:
  try:
    files = importlib.metadata.files(DIST) or []
  except importlib.metadata.PackageNotFoundError:
    raise Unavailable(f'the {DIST} wheel is not installed (pip install -e ".[onednn]")') from None
  for f in files:
    if f.name == "libdnnl.so.3":
      path = Path(f.locate()).resolve()
      if path.is_file():
        return path
  raise Unavailable(f"the {DIST} wheel has no lib/libdnnl.so.3 (reinstall it)")


def cache_dir() -> Path:
  """Where built handler libraries live: $ATTN_CACHE_DIR, else $XDG_CACHE_HOME/attn or ~/.cache/attn."""
  if os.environ.get("ATTN_CACHE_DIR"):
    return Path(os.environ["ATTN_CACHE_DIR"])
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return Path(base) / "attn"


def _build(libdnnl: Path) -> Path:
  """The handler library for this source, jaxlib and libdnnl: built once (atomically), then reused."""
  cxx = shutil.which(os.environ.get("CXX", "c++"))
  if cxx is None:
    raise Unavailable(f"no C++ compiler ({os.environ.get('CXX', 'c++')!r} is not on PATH; "
                      "install g++ or set CXX) to build the oneDNN handlers")
  include = jax.ffi.include_dir()
  key = hashlib.sha256(b"\0".join([SOURCE.read_bytes(), importlib.metadata.version("jaxlib").encode(),
                                   str(libdnnl).encode(), cxx.encode()])).hexdigest()[:16]
  out = cache_dir() / f"onednn-{key}" / "libattn_onednn.so"
  if out.is_file():
    return out
  try:
    out.parent.mkdir(parents=True, exist_ok=True)
  except OSError as e:
    raise Unavailable(f"cannot create the build directory {out.parent} ({e}); set ATTN_CACHE_DIR") from None
  fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
  os.close(fd)
  cmd = [cxx, "-O3", "-std=c++17", "-w", "-shared", "-fPIC", f"-I{include}", str(SOURCE),
         "-o", tmp, str(libdnnl), "-lgomp", f"-Wl,-rpath,{libdnnl.parent}"]
  try:
    from attn import process  # the compiler is not attn's: it gets no preloaded allocator of attn's
    done = subprocess.run(cmd, capture_output=True, text=True, env=process.clean_env())
    if done.returncode != 0:
      errors = [line for line in done.stderr.splitlines() if "error" in line] or done.stderr.splitlines()
      raise Unavailable(f"building {SOURCE.name} failed ({' '.join(cmd)}):\n" + "\n".join(errors[:10]))
    os.replace(tmp, out)  # concurrent builders each write their own file; the last rename wins
  finally:
    if os.path.exists(tmp):
      os.unlink(tmp)
  return out


@functools.cache
def _load() -> str | None:
  """None once the handlers are registered for the CPU; else why they cannot be (cached)."""
  if platform.system() != "Linux" or platform.machine() != "x86_64":
    return f"the {DIST} wheel is for x86-64 Linux, this is {platform.system()} {platform.machine()}"
  try:
    lib = ctypes.CDLL(str(_build(_libdnnl())))
  except Unavailable as e:
    return str(e)
  except OSError as e:
    return f"loading the oneDNN handlers failed: {e}"
  for name in TARGETS:
    jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, name)), platform="cpu")
  return None


def why_not(*dtypes) -> str | None:
  """None if impl="onednn" can run here on these dtypes (building and registering its handlers on the
  first call), else why not."""
  if jax.default_backend() != "cpu":
    return f'it runs on the CPU backend only (the default backend is "{jax.default_backend()}")'
  bad = sorted({str(jnp.dtype(d)) for d in dtypes} - {"float32"})
  if bad:
    return f"oneDNN's sgemm takes float32 only, got {', '.join(bad)}"
  return _load()


def _call(name: str, shape, a, b, **attrs):
  if (why := why_not()) is not None:
    raise Unavailable(f'impl="onednn" cannot run here: {why}')
  return jax.ffi.ffi_call(name, jax.ShapeDtypeStruct(shape, jnp.float32),
                          vmap_method="sequential")(a, b, **attrs)


@jax.custom_vjp
def nt(a_BTHD, b_BSGD):
  """(B,H,T,S): c[b,h] = a[b,:,h] · b[b,:,h // (H/G)]ᵀ."""
  B, T, H, _ = a_BTHD.shape
  return _call("attn_onednn_nt", (B, H, T, b_BSGD.shape[1]), a_BTHD, b_BSGD)


@jax.custom_vjp
def nn(a_BHTS, b_BSGD):
  """(B,T,H,D): c[b,:,h] = a[b,h] · b[b,:,h // (H/G)]."""
  B, H, T, _ = a_BHTS.shape
  return _call("attn_onednn_nn", (B, T, H, b_BSGD.shape[3]), a_BHTS, b_BSGD)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def tn(a_BHTS, b_BTHD, G: int):
  """(B,S,G,D): c[b,:,g] = Σ over the H/G query heads h of group g of a[b,h]ᵀ · b[b,:,h]."""
  B, _, _, S = a_BHTS.shape
  return _call("attn_onednn_tn", (B, S, G, b_BTHD.shape[3]), a_BHTS, b_BTHD, G=np.int64(G))


def _nt_fwd(a, b):
  return nt(a, b), (a, b)


def _nt_bwd(res, dc_BHTS):
  a_BTHD, b_BSGD = res
  return nn(dc_BHTS, b_BSGD), tn(dc_BHTS, a_BTHD, b_BSGD.shape[2])


def _nn_fwd(a, b):
  return nn(a, b), (a, b)


def _nn_bwd(res, dc_BTHD):
  a_BHTS, b_BSGD = res
  return nt(dc_BTHD, b_BSGD), tn(a_BHTS, dc_BTHD, b_BSGD.shape[2])


def _tn_fwd(a, b, G):
  return tn(a, b, G), (a, b)


def _tn_bwd(G, res, dc_BSGD):
  a_BHTS, b_BTHD = res
  return nt(b_BTHD, dc_BSGD), nn(a_BHTS, dc_BSGD)


nt.defvjp(_nt_fwd, _nt_bwd)
nn.defvjp(_nn_fwd, _nn_bwd)
tn.defvjp(_tn_fwd, _tn_bwd)


def bmm(a_NMK, b, transb: bool):
  """(N,M,P) float32: a[n] · b[n] with b (N,K,P), or a[n] · b[n]ᵀ with b (N,P,K) if transb. No VJP:
  attn.kernel.blocked calls it inside its own."""
  N, M, _ = a_NMK.shape
  P = b.shape[1] if transb else b.shape[2]
  return _call("attn_onednn_bmm", (N, M, P), a_NMK, b, transb=bool(transb))
