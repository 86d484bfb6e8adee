"""``python -m aggsrv``: the ``aggsrv`` command where its script is not on PATH."""

from aggsrv.cli import main

raise SystemExit(main())
