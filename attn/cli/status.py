"""`attn status DIR [--lease-timeout S]`: each trial done, failed, running, stale or pending; totals; an ETA.

The work (reading the store, the states, the ETA): attn.experiments.running.status.
"""

from __future__ import annotations

import argparse
import os
import sys

from attn.experiments.running import leases


def add_arguments(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("dir", metavar="DIR", help="a sweep directory written by `attn sweep`")
  parser.add_argument("--lease-timeout", metavar="SECONDS", type=float, default=leases.DEFAULT_TIMEOUT,
                      help="a lease whose heartbeat is older is shown as stale (default "
                           f"{leases.DEFAULT_TIMEOUT:g}, as `attn sweep`)")


def run(args: argparse.Namespace) -> int:
  from attn.experiments.running import run_record, status
  from attn.experiments.running import sweep  # the one check of --lease-timeout
  timeout = sweep.check_lease_timeout(args.lease_timeout)
  trials = status.collect(args.dir, timeout)
  print("\n".join(status.table(trials, timeout)))
  for line in status.warning_lines(trials):
    print(line, file=sys.stderr)
  for sub in ("local", "slurm", "ray"):
    if os.path.isdir(os.path.join(args.dir, sub)):
      print(f"logs: {os.path.join(args.dir, sub)}/")
  for line in run_record.summary(args.dir):  # on stderr: stdout stays one line per trial and the totals
    print(line, file=sys.stderr)
  return 0
