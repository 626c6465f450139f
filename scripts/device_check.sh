#!/usr/bin/env bash
# Command:  scripts/device_check.sh OUTDIR        (from the checkout's root, on a machine with a GPU)
# Runtime:  at most 8 minutes on one H200 (each step has its own time limit; the whole has DEADLINE_S)
# Measures: the gpu-marked tests; `attn bench` at the reference shape (B 8, T 256, D 512, H 8) and at
#           wide-4096-causal (B 1, T 4096 causal, 16 heads of 128), bfloat16, forward and
#           forward+backward, attn's cores (auto, cudnn, tokamax, blocked, einsum, xla) side by side
#           with torch SDPA's flash and cuDNN backends in the same process, and the bf16 matmul rate of
#           the same chip; the default sweep (configs/quick.toml) and the same sweep packed (sweep.pack=3:
#           each shape's 3 seeds as one vmapped program), each run record's trials per hour and device busy
#           time in OUTDIR/sweeps.json.
# Writes:   OUTDIR/env.json (GPU, driver, jax, jaxlib, cuDNN, torch, commit), OUTDIR/steps.json (each
#           step: status, seconds, log), OUTDIR/*.log, OUTDIR/bench.json, OUTDIR/bench.md,
#           OUTDIR/quick/ and OUTDIR/quick_packed/ (the sweeps' stores and reports), OUTDIR/sweeps.json.
#
# Install: attn goes in over the machine's own jax, never replacing it:
#   pip install --no-deps -e .
# plus the wheels attn imports that such a machine may lack, named in NEED below (without their
# dependencies, so jax stays as it is). A machine without the network takes them from
# ATTN_WHEELS=DIR, filled beforehand on one with it:
#   pip download --no-deps -d DIR flax optax orbax-checkpoint einops submitit tokamax qwix jaxtyping \
#       einshape immutabledict typeguard wadler_lindig treescope pytest pytest-xdist
# Where attn already imports from this checkout (PYTHONPATH, or installed before), nothing is installed.
#
# Without a GPU (jax's backend is not "gpu") the script says so, runs what means something there
# (the environment, the gpu-marked tests, which skip saying why; a smoke run of the bench at a tiny
# shape; both sweeps cut to per_head and 5 steps, the packing and its run record exercised) and
# skips the GPU measurements, naming each one. ATTN_COMMIT names the commit where the
# checkout has no .git. Exit status: 0 when every step that ran passed.
set -uo pipefail

OUT=${1:?usage: scripts/device_check.sh OUTDIR}
cd "$(dirname "$0")/.."
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
DEADLINE_S=${DEADLINE_S:-470}
PY=${PYTHON:-python}
STEPS="$OUT/steps.tsv"
: > "$STEPS"
FAILED=0

say() { echo "device_check: $*" >&2; }

left() { echo $(( DEADLINE_S - SECONDS )); }

# step NAME LIMIT_S CMD...: runs CMD with a time limit (the smaller of LIMIT_S and what is left),
# its output in OUTDIR/NAME.log; one line of steps.tsv per step.
step() {
  local name=$1 limit=$2
  shift 2
  local budget
  budget=$(left)
  (( budget < limit )) && limit=$budget
  if (( limit < 10 )); then
    say "$name: skipped, the ${DEADLINE_S} s budget is spent"
    printf '%s\tskipped\t0\tbudget spent\n' "$name" >> "$STEPS"
    return
  fi
  say "$name: running (at most ${limit} s; log $OUT/$name.log)"
  local t0=$SECONDS rc
  timeout --signal=INT --kill-after=15 "$limit" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  local status=ok
  if (( rc == 124 || rc == 137 )); then status="timed out after ${limit} s"; FAILED=1
  elif (( rc != 0 )); then status="failed (exit $rc)"; FAILED=1; fi
  say "$name: $status in $(( SECONDS - t0 )) s"
  printf '%s\t%s\t%s\t%s\n' "$name" "$status" "$(( SECONDS - t0 ))" "$name.log" >> "$STEPS"
  tail -n 5 "$OUT/$name.log" | sed 's/^/    /' >&2
}

skip() {  # skip NAME WHY
  say "$1: skipped, $2"
  printf '%s\tskipped\t0\t%s\n' "$1" "$2" >> "$STEPS"
}

# 1. Install over the machine's jax (or not at all, when this checkout already imports).
HERE=$(cd / && "$PY" -c 'import attn, os; print(os.path.dirname(os.path.dirname(attn.__file__)))' 2>/dev/null)
if [[ "$HERE" == "$PWD" ]]; then
  say "install: skipped, attn already imports from this checkout ($PWD)"
  printf 'install\tskipped\t0\tattn already imports from this checkout\n' >> "$STEPS"
else
  install() {
    local NEED=(flax optax orbax-checkpoint einops submitit tokamax qwix jaxtyping einshape immutabledict
                typeguard wadler_lindig treescope pytest pytest-xdist)
    local missing=()
    for pkg in "${NEED[@]}"; do
      mod=${pkg//-/_}; [[ $mod == orbax_checkpoint ]] && mod=orbax.checkpoint
      [[ $mod == pytest_xdist ]] && mod=xdist
      "$PY" -c "import $mod" 2>/dev/null || missing+=("$pkg")
    done
    echo "wheels this machine lacks: ${missing[*]:-none}"
    if (( ${#missing[@]} )); then
      if [[ -n "${ATTN_WHEELS:-}" ]]; then
        "$PY" -m pip install --no-deps --no-index --find-links "$ATTN_WHEELS" "${missing[@]}" || return 1
      else
        "$PY" -m pip install --no-deps "${missing[@]}" || return 1
      fi
    fi
    "$PY" -m pip install --no-deps -e . || return 1
    "$PY" -c 'import jax, attn; print("jax", jax.__version__, "attn from", attn.__file__)'
  }
  export -f install
  export PY ATTN_WHEELS="${ATTN_WHEELS:-}"
  step install 120 bash -c install
fi

# 2. The machine: GPU, driver, versions, backend.
"$PY" - "$OUT/env.json" <<'EOF' 2> "$OUT/env.log"
import json, os, subprocess, sys
env = {"commit": os.environ.get("ATTN_COMMIT")}
try:
  env["commit"] = env["commit"] or subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True,
                                                  text=True, check=True).stdout.strip()
except Exception:
  pass
try:
  env["nvidia_smi"] = subprocess.run(
      ["nvidia-smi", "--query-gpu=name,memory.total,driver_version,clocks.max.sm", "--format=csv,noheader"],
      capture_output=True, text=True, timeout=30).stdout.strip()
except Exception as e:
  env["nvidia_smi"] = f"unavailable ({e})"
import jax, jaxlib
env.update(jax=jax.__version__, jaxlib=jaxlib.__version__, backend=jax.default_backend(),
           devices=[f"{d.platform}: {d.device_kind}" for d in jax.devices()])
try:
  from jax._src.lib import cuda_versions
  env["cudnn"] = cuda_versions.cudnn_get_version() if cuda_versions else None
except Exception as e:
  env["cudnn"] = f"unknown ({e})"
for name in ("torch", "tokamax", "flax"):
  try:
    m = __import__(name)
    env[name] = getattr(m, "__version__", "installed")
    if name == "torch":
      env["torch_cuda"] = m.cuda.is_available()
  except ImportError:
    env[name] = None
from attn import kernel
env["available_impls"] = kernel.available_impls()
json.dump(env, open(sys.argv[1], "w"), indent=1)
print(json.dumps(env, indent=1), file=sys.stderr)
EOF
[[ -s "$OUT/env.json" ]] && { cat "$OUT/env.json"; echo; } >&2 || { say "env: could not import jax/attn (see $OUT/env.log)"; FAILED=1; }
BACKEND=$("$PY" -c 'import jax; print(jax.default_backend())' 2>/dev/null)
if [[ "$BACKEND" != "gpu" ]]; then
  say "NO GPU: jax's default backend is \"${BACKEND:-unknown}\". The GPU measurements below are skipped,"
  say "each named; what runs is the environment, the gpu-marked tests (they skip, saying why), a smoke bench and"
  say "both sweeps cut to 5 steps."
fi

# 3. The gpu-marked tests (-m gpu overrides pyproject's default marker filter).
step gpu_tests 150 "$PY" -m pytest -m gpu -n 0 -q -rs -p no:cacheprovider tests/test_kernel_accelerators.py \
  tests/test_trials_per_device.py

# 4. attn bench: attn's cores side by side with torch SDPA's flash and cuDNN backends, and the matmul rate.
IMPLS=auto,cudnn,tokamax,blocked,einsum,xla
if [[ "$BACKEND" == "gpu" ]]; then
  step bench 200 bash -c "$PY -m attn bench --shapes reference,wide-4096-causal --dtype bfloat16 --variants fused \
    --impls $IMPLS --repeats 10 --out '$OUT/bench.json' > '$OUT/bench.md'"
else
  skip bench "needs a GPU (bf16 at T = 4096 on this backend would measure nothing of interest)"
  step bench_smoke 120 bash -c "$PY -m attn bench --shapes small --variants fused --impls $IMPLS --no-peers \
    --repeats 2 --out '$OUT/bench_smoke.json' > '$OUT/bench_smoke.md'"
fi

# 5. The default sweep, then the same trials packed (each shape's 3 seeds one program), each in its own store;
#    each run record's end line (trials per hour, device busy time) gathered in sweeps.json.
if [[ "$BACKEND" == "gpu" ]]; then
  step sweep 100 "$PY" -m attn sweep configs/quick.toml --out "$OUT/quick"
  step sweep_packed 80 "$PY" -m attn sweep configs/quick.toml --set sweep.pack=3 --out "$OUT/quick_packed"
else
  say "sweeps: no GPU, so both cut to per_head and 5 steps (a smoke run of the runner and the packing, no timing)"
  SMOKE=(--set 'sweep.grid.model.variant=["per_head"]' --set train.steps=5 --no-report)
  step sweep_smoke 120 "$PY" -m attn sweep configs/quick.toml "${SMOKE[@]}" --out "$OUT/quick"
  step sweep_packed_smoke 120 "$PY" -m attn sweep configs/quick.toml "${SMOKE[@]}" --set sweep.pack=3 \
    --out "$OUT/quick_packed"
fi
"$PY" - "$OUT/sweeps.json" "$OUT/quick" "$OUT/quick_packed" <<'EOF2'
import json, os, sys
out = {}
for d in sys.argv[2:]:
  try:
    lines = [json.loads(l) for l in open(os.path.join(d, "run.jsonl")) if l.strip()]
  except (OSError, ValueError) as e:
    out[os.path.basename(d)] = f"no run record ({e})"
    continue
  end = [l for l in lines if l.get("event") == "end"]
  out[os.path.basename(d)] = end[-1] if end else "no end line (the sweep did not finish)"
json.dump(out, open(sys.argv[1], "w"), indent=1)
print(json.dumps(out, indent=1), file=sys.stderr)
EOF2

"$PY" - "$STEPS" "$OUT/steps.json" "$SECONDS" <<'EOF'
import json, sys
rows = [line.rstrip("\n").split("\t") for line in open(sys.argv[1]) if line.strip()]
steps = [{"step": r[0], "status": r[1], "seconds": int(r[2]), "log_or_reason": r[3]} for r in rows]
json.dump({"steps": steps, "total_s": int(sys.argv[3])}, open(sys.argv[2], "w"), indent=1)
EOF
say "done in ${SECONDS} s: $OUT/steps.json"
exit $FAILED
