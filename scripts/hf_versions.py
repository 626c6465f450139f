"""Every test that uses the hf extra (the `hf` mark), on every transformers minor release the hf extra allows.

  python scripts/hf_versions.py --venv /tmp/hf-venv        # every minor release from the floor
  python scripts/hf_versions.py --venv /tmp/hf-venv --versions 4.51.1 5.24.0 --json out.json
  python scripts/hf_versions.py --venv /tmp/hf-venv --versions 5.25.0 --constraints constraints-hf.txt

Decisions:
- The versions are the last patch release of each minor release from the floor of the hf
  extra in pyproject.toml up to the newest that `pip index versions transformers` lists
  (no pre-releases); `--versions` names them instead.
- One venv, reused: made once (python3 -m venv, the CPU torch on disk, the test and torch extras),
  its packages then recorded (BASE); for each version every package installed since is removed and the hf
  and pretrained extras installed with that transformers, so pip resolves each release as a fresh venv
  would (what a later release pulled in stays out of an earlier one's: transformers 5.25's `kernels`, left
  beside 5.0.0 with the huggingface-hub 1.x it brings, failed 105 of its tests in the first run).
- The tests: those with the `hf` mark (tests/hf_marks.py finds them in their code), both tiers,
  from every tests/test_*.py that names transformers, in one pytest a release over --workers
  xdist workers (default 2, `--dist loadfile` as the suite runs; a worker that dies is restarted and
  its file counted failed, so the release keeps its other rows). One pytest a file on one core, as
  this script first did, spent most of a release starting 40-odd processes (each importing JAX,
  attn and transformers). Counts, per file too, and failing ids come from pytest's JUnit XML; an
  error counts as a failure, and so does a version pip cannot install. `seconds` is the pytest run
  alone, not the install.
- Prints a Markdown table (with the tokenizers, safetensors and huggingface-hub pip resolved
  along: a constraints file's other pins), then the failing test ids per version; exits 1 if
  any failed. constraints-hf.txt pins what CI installs: move it only with this table's evidence.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import tomllib
import xml.etree.ElementTree as ET

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCH = "torch==2.13.0"  # the CPU build on this machine's disk, as in .ci/run


def floor() -> tuple[int, ...]:
  """The lower bound of transformers in the hf extra, e.g. (4, 51, 1)."""
  with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
    hf = tomllib.load(f)["project"]["optional-dependencies"]["hf"]
  spec = next(d for d in hf if d.startswith("transformers"))
  return parse(re.search(r">=\s*([\d.]+)", spec).group(1))


def parse(version: str) -> tuple[int, ...]:
  return tuple(int(p) for p in version.split("."))


def latest_patches(python: str) -> list[str]:
  """The last patch release of each minor release at or above the floor."""
  out = subprocess.run([python, "-m", "pip", "index", "versions", "transformers"],
                       capture_output=True, text=True, check=True).stdout
  listed = re.search(r"Available versions: (.*)", out).group(1).split(", ")
  lo = floor()
  last: dict[tuple[int, ...], tuple[int, ...]] = {}
  for v in map(parse, listed):
    if v >= lo and v > last.get(v[:2], ()):
      last[v[:2]] = v
  return [".".join(map(str, v)) for v in sorted(last.values())]


def pip(python: str, *args: str) -> subprocess.CompletedProcess:
  return subprocess.run([python, "-m", "pip", "install", "-q", *args], capture_output=True, text=True)


BASE = "attn-hf-versions-base.json"  # in the venv: the packages it held before any hf release


def packages(python: str) -> list[str]:
  out = subprocess.run([python, "-m", "pip", "list", "--format=json"], capture_output=True, text=True, check=True)
  return sorted(p["name"].lower() for p in json.loads(out.stdout))


def make_venv(venv: str) -> str:
  """The venv's python, made with torch and the test and torch extras (and its packages recorded) if it is
  not there."""
  python = os.path.join(venv, "bin", "python")
  if not os.path.exists(os.path.join(venv, BASE)):
    if os.path.exists(python):
      sys.exit(f"{venv} was not made by this script (no {BASE}): name a new directory")
    subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    for args in ([TORCH], ["-e", f"{REPO}[test,torch]"]):
      r = pip(python, *args)
      if r.returncode:
        sys.exit(f"making {venv}: pip install {' '.join(args)} failed:\n{r.stderr}")
    with open(os.path.join(venv, BASE), "w") as f:
      json.dump(packages(python), f)
  return python


def back_to_base(python: str) -> None:
  """Removes every package installed since the venv was made (the last release and what it pulled in)."""
  with open(os.path.join(os.path.dirname(os.path.dirname(python)), BASE)) as f:
    base = set(json.load(f))
  extra = [p for p in packages(python) if p not in base]
  if extra:
    subprocess.run([python, "-m", "pip", "uninstall", "-q", "-y", *extra], capture_output=True, text=True, check=True)


def test_files() -> list[str]:
  """Every tests/test_*.py that names transformers: the files that can hold `hf`-marked tests."""
  files = []
  for path in sorted(glob.glob(os.path.join(REPO, "tests", "test_*.py"))):
    with open(path) as f:
      if "transformers" in f.read():
        files.append(os.path.relpath(path, REPO))
  return files


def installed(python: str, names: list[str]) -> dict[str, str]:
  code = ("import importlib.metadata as m, sys\n"
          "for n in sys.argv[1:]:\n"
          "  try: print(n, m.version(n))\n"
          "  except m.PackageNotFoundError: print(n, '-')")
  out = subprocess.run([python, "-c", code, *names], capture_output=True, text=True).stdout
  return dict(line.split(" ", 1) for line in out.splitlines())


def run_tests(python: str, files: list[str], row: dict, workers: int) -> None:
  """Run the files' `hf` tests, both tiers, in one pytest; add the counts, per-file counts, failing ids and
  seconds to `row`."""
  row["files"] = {path: {"passed": 0, "failed": 0, "skipped": 0} for path in files}
  with tempfile.TemporaryDirectory() as tmp:
    xml = os.path.join(tmp, "junit.xml")
    t0 = time.time()
    p = subprocess.run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", str(workers),
                        "--dist", "loadfile", "-m", "hf", f"--junitxml={xml}", *files],
                       cwd=REPO, capture_output=True, text=True)
    row["seconds"] = round(time.time() - t0, 1)
    if not os.path.exists(xml):  # pytest died before writing its report (a negative code: killed by that signal)
      row["failed"] += 1
      row["failures"].append(f"pytest exited {p.returncode}: {p.stdout[-300:]}{p.stderr[-300:]}")
      return
    for case in ET.parse(xml).getroot().iter("testcase"):
      path = case.get("classname", "").replace(".", "/") + ".py"  # tests.test_x -> tests/test_x.py
      counts = row["files"].setdefault(path, {"passed": 0, "failed": 0, "skipped": 0})
      bad = [e for e in case if e.tag in ("failure", "error")]
      if bad:
        kind = "failed"
        message = (bad[0].get("message") or "").strip().splitlines() or [""]
        row["failures"].append(f"{case.get('classname')}::{case.get('name')}: {message[0][:200]}")
      else:
        kind = "skipped" if case.find("skipped") is not None else "passed"
      counts[kind] += 1
      row[kind] += 1
    if p.returncode not in (0, 5) and not row["failed"]:  # 5: no tests collected (all deselected)
      row["failed"] += 1
      row["failures"].append(f"pytest exited {p.returncode}: {p.stdout[-300:]}")


def run_version(python: str, version: str, files: list[str], constraints: str | None = None,
                workers: int = 2) -> dict:
  """Install one transformers (within `constraints`, a pip constraints file) and run the tests; counts,
  failing ids and timings."""
  row = {"version": version, "passed": 0, "failed": 0, "skipped": 0, "seconds": 0.0,
         "failures": []}
  t0 = time.time()
  back_to_base(python)
  r = pip(python, "-e", f"{REPO}[hf,pretrained]", f"transformers=={version}",
          *(["-c", os.path.abspath(constraints)] if constraints else []))
  row["install_seconds"] = round(time.time() - t0, 1)
  if r.returncode:
    row.update(failed=1, failures=[f"pip install transformers=={version}: {r.stderr.strip()[-500:]}"])
    return row
  row["installed"] = installed(python, ["transformers", "tokenizers", "huggingface-hub",
                                       "safetensors", "sentence-transformers"])
  run_tests(python, files, row, workers)
  return row


def table(rows: list[dict]) -> str:
  lines = ["| transformers | passed | failed | skipped | seconds | tokenizers | safetensors | huggingface-hub |",
           "|---|---:|---:|---:|---:|---|---|---|"]
  for r in rows:  # what pip resolved along with it: the rest of a constraints file's pins
    got = r.get("installed", {})
    lines.append(f"| {r['version']} | {r['passed']} | {r['failed']} | {r['skipped']} | {r['seconds']:.0f} | "
                 + " | ".join(got.get(n, "-") for n in ("tokenizers", "safetensors", "huggingface-hub")) + " |")
  for r in rows:
    if r["failures"]:
      lines += ["", f"Failures on {r['version']}:"] + [f"- {f}" for f in r["failures"]]
  return "\n".join(lines)


def main(argv: list[str]) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--venv", required=True, help="the one venv to reuse; made if absent")
  parser.add_argument("--versions", nargs="+", help="these transformers versions instead of every minor")
  parser.add_argument("--json", help="also write the rows (with installed versions) here")
  parser.add_argument("--workers", type=int, default=2, help="pytest-xdist workers (default 2)")
  parser.add_argument("--constraints", help="install within this pip constraints file (constraints-hf.txt, "
                      "constraints-hf-floor.txt: CI's pins, to check them)")
  args = parser.parse_args(argv)
  python = make_venv(args.venv)
  versions = args.versions or latest_patches(python)
  files = test_files()
  print(f"{len(versions)} versions: {' '.join(versions)}\ntests: {' '.join(files)}", file=sys.stderr)
  rows, t0 = [], time.time()
  for version in versions:
    rows.append(run_version(python, version, files, args.constraints, args.workers))
    if args.json:  # written after every release, so a long run can be read while it goes
      with open(args.json, "w") as f:
        json.dump(rows, f, indent=1)
    r = rows[-1]
    print(f"{version}: {r['passed']} passed, {r['failed']} failed, {r['skipped']} skipped, "
          f"{r['seconds']:.0f} s (+{r['install_seconds']:.0f} s install)", file=sys.stderr, flush=True)
  print(table(rows))
  print(f"\n{len(versions)} versions in {time.time() - t0:.0f} s", file=sys.stderr)
  return 1 if any(r["failed"] for r in rows) else 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
