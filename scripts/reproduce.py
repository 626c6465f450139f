"""Re-runs shipped experiments and refreshes their committed results in experiments/NAME/.

  python scripts/reproduce.py                 # every config in configs/
  python scripts/reproduce.py quick kv_heads  # just these
  python scripts/reproduce.py --report-only   # re-draw reports and plots from runs/NAME
  python scripts/reproduce.py --workers 2 text_heads_fixed_width   # attn sweep --workers 2

For each NAME it runs `attn sweep configs/NAME.toml --out runs/NAME` (resuming
a finished run costs nothing), then copies runs/NAME/report.md and its PNGs to
experiments/NAME/ (with an analysed sweep, also one trial's plots as
trial_*.png, named in trial_plots.txt), writes experiments/NAME/trials.json (each trial's final
metrics at full precision: what `attn reproduce experiments/NAME` compares a re-run with) and
experiments/NAME/run.json: the command, the
wall time of this invocation, the date, the machine and its load average
(1 minute) at the start and end, and as run_record the lines of the store's
own run record (runs/NAME/run.jsonl: commit, versions, CPU, XLA_FLAGS of
each `attn sweep` on it; `attn reproduce` names the commit and CPU from its
first line). Shipped run.json files without run_record name no commit. The write-up
experiments/NAME/README.md is prose and is not touched.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import platform
import shutil
import subprocess
import sys
import time

from attn.experiments.reading.reproduce import COMMITTED, committed_trials
from attn.experiments.running import run_record

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cpu() -> str:
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine()


def _example_trial(run_dir: str) -> str | None:
  """The analysed trial (attn analyze) with the largest prunable fraction, first in sweep order on ties."""
  best, best_value = None, -1.0
  for path in sorted(glob.glob(os.path.join(run_dir, "trials", "*", "analysis.json"))):
    with open(path, encoding="utf-8") as f:
      value = json.load(f).get("summary", {}).get("prunable_fraction") or 0.0
    if value > best_value:
      best, best_value = os.path.dirname(path), value
  return best


def reproduce(name: str, runs: str, report_only: bool, workers: int | None = None) -> None:
  config = os.path.join("configs", f"{name}.toml")
  out = os.path.join(runs, name)
  dest = os.path.join(ROOT, "experiments", name)
  cmd = ["attn", "report", out] if report_only else ["attn", "sweep", config, "--out", out]
  if workers and not report_only:
    cmd += ["--workers", str(workers)]
  load_start = os.getloadavg()[0]
  t0 = time.perf_counter()
  subprocess.run(cmd, cwd=ROOT, check=True)
  wall = time.perf_counter() - t0
  os.makedirs(dest, exist_ok=True)
  for old in glob.glob(os.path.join(dest, "*.png")) + glob.glob(os.path.join(dest, "trial_plots.txt")):
    os.remove(old)
  for path in [os.path.join(ROOT, out, "report.md"), *glob.glob(os.path.join(ROOT, out, "*.png"))]:
    shutil.copy(path, dest)
  if os.path.normpath(out) != os.path.join("runs", name):  # a store elsewhere (--runs): the write-up names the default
    with open(os.path.join(dest, "report.md"), encoding="utf-8") as f:
      text = f.read().replace(f"--out {out}", f"--out runs/{name}")
    with open(os.path.join(dest, "report.md"), "w", encoding="utf-8") as f:
      f.write(text)
  example = _example_trial(os.path.join(ROOT, out))
  if example:  # one analysed trial's own plots, as trial_*.png
    for path in glob.glob(os.path.join(example, "*.png")):
      shutil.copy(path, os.path.join(dest, "trial_" + os.path.basename(path)))
    with open(os.path.join(dest, "trial_plots.txt"), "w", encoding="utf-8") as f:
      f.write(f"trial_*.png are the plots of trial {os.path.basename(example)} "
              f"({os.path.relpath(example, ROOT)}): the analysed trial with the largest prunable fraction.\n")
  with open(os.path.join(dest, COMMITTED), "w", encoding="utf-8") as f:
    json.dump(committed_trials(os.path.join(ROOT, out)), f, indent=1)
    f.write("\n")
  if report_only:
    return
  info = {"command": " ".join(cmd), "wall_s": round(wall, 1),
          "date": datetime.date.today().isoformat(), "cpu": _cpu(), "cores": os.cpu_count(),
          "python": platform.python_version(), "load_start": round(load_start, 2),
          "load_end": round(os.getloadavg()[0], 2), "run_record": run_record.read(os.path.join(ROOT, out))[0]}
  with open(os.path.join(dest, "run.json"), "w", encoding="utf-8") as f:
    json.dump(info, f, indent=1)
    f.write("\n")
  print(f"{name}: {wall:.0f} s -> {os.path.relpath(dest, ROOT)}", flush=True)


def main() -> int:
  names = sorted(os.path.splitext(os.path.basename(p))[0] for p in glob.glob(os.path.join(ROOT, "configs", "*.toml")))
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("names", nargs="*", help=f"configs to run (default all: {', '.join(names)})")
  parser.add_argument("--runs", default="runs", help="where the stores go (default runs/)")
  parser.add_argument("--report-only", action="store_true", help="only re-draw reports from existing stores")
  parser.add_argument("--workers", type=int, default=None,
                      help="passed to attn sweep --workers (parallel local worker processes)")
  args = parser.parse_args()
  for name in args.names or names:
    if name not in names:
      print(f"reproduce: error: NAME={name!r}: one of {names}", file=sys.stderr)
      return 2
    reproduce(name, args.runs, args.report_only, args.workers)
  return 0


if __name__ == "__main__":
  sys.exit(main())
