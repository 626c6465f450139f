"""Prints docs/config.md, every key of a sweep config from the schema: python scripts/config_reference.py > docs/config.md"""

import sys

from attn.experiments.running import keys

if __name__ == "__main__":
  sys.stdout.write(keys.reference())
