"""The API reference, built from the docstrings with pdoc (a dev dependency).

`python -m aggsrv.api_reference OUT` (or `make api`) writes HTML pages under OUT for the modules
a program uses: the kernels, the client, the simulator, the `Strategy` plug-in protocol and the
Flower integration. A warning pdoc gives while rendering (a reference it cannot resolve, a
docstring it cannot read) is an error: the build fails, and so does its test. A ResourceWarning
is not counted: it comes from garbage the process left before the build (an event loop never
closed) that the collector happens to find during it.

Why pdoc: it documents a package from its docstrings and annotations with no configuration and
no pages to keep beside the code; MkDocs with mkdocstrings would bring a site of Markdown pages
and a theme to maintain for the same reference.
"""

from __future__ import annotations

import importlib
import sys
import warnings
from pathlib import Path

__all__ = ["MODULES", "build"]

# What a program imports, in the order of the index.
MODULES = (
    "aggsrv.kernels",
    "aggsrv.client",
    "aggsrv.sim",
    "aggsrv.strategies.base",
    "aggsrv.values",
    "aggsrv.integrations.flower",
    "aggsrv.integrations.nvflare",
)


def build(out: Path) -> list[str]:
    """Render :data:`MODULES` into ``out``; the warnings pdoc gave while rendering (none: ok)."""
    import pdoc  # a dev dependency: only the reference's build needs it

    for name in MODULES:  # their own import-time warnings (third-party deprecations) are not ours
        importlib.import_module(name)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        # What the process left behind (an unclosed event loop) warns when the collector finds
        # it, which may be during the build: a leak elsewhere, not a problem of the reference.
        warnings.simplefilter("ignore", ResourceWarning)
        pdoc.render.configure(docformat="restructuredtext", search=True)
        pdoc.pdoc(*MODULES, output_directory=Path(out))
    return [f"{w.category.__name__}: {w.message}" for w in seen]


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m aggsrv.api_reference OUT")
    problems = build(Path(sys.argv[1]))
    for problem in problems:
        sys.stderr.write(problem + "\n")
    sys.exit(1 if problems else 0)
