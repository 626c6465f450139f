from attn.cli import main

raise SystemExit(main())
