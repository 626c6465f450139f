"""The sweep's progress line: trials counted among those it runs; an ETA without compilation.

The clock is a list of made-up instants (time.perf_counter patched): no test here times anything.
"""

import io

from attn.experiments.running import sweep


def _lines(monkeypatch, instants, updates, total_steps, n_trials):
  clock = iter(instants)
  monkeypatch.setattr(sweep.time, "perf_counter", lambda: next(clock))
  out = io.StringIO()
  progress = sweep.Progress(total_steps, n_trials, out)
  for args in updates:
    progress.last = -1e9  # print every update (the line is rate-limited to one per 10 s off a tty)
    progress.update(*args)
  return out.getvalue().splitlines()


def test_the_eta_leaves_out_compilation_and_estimates_until_two_timed_steps(monkeypatch):
  # Trial 1 of 2, 4 steps: step 0 ends at 30 s (compiling), then one step each 0.5 s.
  lines = _lines(monkeypatch, [30.0, 30.5, 31.0, 31.5], [(1, 1, "h=1", s, 4, 1.0) for s in range(4)], 8, 2)
  assert [line.split(" ETA ")[1] for line in lines] == ["estimating", "estimating", "0m02s", "0m02s"]
  # After step 2: 2 timed steps in 1.0 s, 8 - 3 = 5 steps left -> 2.5 s; after step 3: 4 left at 0.5 s -> 2 s.
  assert lines[0].startswith("trial 1/2 [h=1] step 1/4")


def test_a_new_groups_first_step_is_not_timed(monkeypatch):
  updates = [(1, 1, "h=1", s, 3, 1.0) for s in range(3)] + [(2, 1, "h=2", s, 3, 1.0) for s in range(3)]
  # Trial 1: compile (ends 20 s), two steps of 1 s; trial 2: compile (ends 60 s), two steps of 1 s.
  lines = _lines(monkeypatch, [20.0, 21.0, 22.0, 60.0, 61.0, 62.0], updates, 6, 2)
  assert [line.split(" ETA ")[1] for line in lines] == [
      "estimating", "estimating", "0m03s", "0m02s", "0m01s", "0m00s"]  # 1 s a step: the 38 s compile left out
  assert lines[3].startswith("trial 2/2 [h=2] step 1/3")
