"""Print the README's "Two commands" as CI runs them: each fenced bash block of that section,
exactly as written, one per line (argument: which block, 1 or 2)."""

import pathlib
import re
import sys

text = (pathlib.Path(__file__).resolve().parent.parent / "README.md").read_text()
section = re.search(r"^## Two commands\n(.*?)(?=^## )", text, re.S | re.M)
if section is None:
  sys.exit("README.md has no '## Two commands' section")
blocks = re.findall(r"^```bash\n(.*?)^```", section.group(1), re.S | re.M)
if len(blocks) != 2:
  sys.exit(f"README.md's '## Two commands' has {len(blocks)} bash blocks, not 2")
print(blocks[int(sys.argv[1]) - 1].strip())
