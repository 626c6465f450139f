"""`python -m attn`: the attn command, its process set up as the console script's (attn.cli.main)."""

from attn.cli import main

raise SystemExit(main())
