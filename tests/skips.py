"""The run's skips grouped by reason with their counts, after the totals line's bare "97 skipped"
(tests/conftest.py imports the hook)."""

import collections


def skip_reasons(reports) -> list[tuple[int, str]]:
  """(count, reason) of the skipped reports, most first (an xfail is not a skip)."""
  counts = collections.Counter()
  for rep in reports:
    if hasattr(rep, "wasxfail"):
      continue
    reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
    counts[reason.removeprefix("Skipped: ")] += 1
  return sorted(((n, r) for r, n in counts.items()), key=lambda x: (-x[0], x[1]))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
  reasons = skip_reasons(terminalreporter.stats.get("skipped", []))
  if reasons:
    terminalreporter.section(f"{sum(n for n, _ in reasons)} skipped, by reason", sep="-")
    for n, reason in reasons:
      terminalreporter.line(f"{n:>5}  {reason}")
