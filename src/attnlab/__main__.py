"""`python -m attnlab` runs the same command as `attnlab`."""

from attnlab.cli import main

raise SystemExit(main())
