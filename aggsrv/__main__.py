"""``python -m aggsrv``: the ``aggsrv`` command where its script is not on PATH."""

from aggsrv.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
