"""Every repository path the README, docs/, the examples' and the benchmarks' READMEs name exists:
a code span that starts with a top-level folder of the repository (`aggsrv/strategies/mifa.py`,
`bench/experiments/`) and every relative Markdown link. A file that moved leaves no stale pointer.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [
    ROOT / "README.md",
    ROOT / "CHANGELOG.md",
    ROOT / "kernels/BACKENDS.md",
    *sorted((ROOT / "docs").rglob("*.md")),
    *sorted((ROOT / "examples").rglob("*.md")),
    *sorted((ROOT / "bench").rglob("README.md")),
]
TOP = tuple(f"{p.name}/" for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith("."))
TOP += (".ci/",)


def _named_paths(path: Path) -> list[tuple[int, str, Path]]:
    """(line, as written, where it points) of each repository path a Markdown file names."""
    text = path.read_text()
    found = []
    for m in re.finditer(r"`([^`\s]+)`|\]\(([^)\s]+)\)", text):
        written = m.group(1) or m.group(2)
        plain = re.sub(r"(::.*|#.*|:\d+(-\d+)?)$", "", written).rstrip(".,;")
        if m.group(2):
            if plain.startswith(("http:", "https:", "mailto:")) or not plain:
                continue
            target = path.parent / plain
        elif plain.startswith(TOP):
            target = ROOT / plain
        else:
            continue
        if any(ch in plain for ch in "*{}<>$"):
            continue  # a pattern, not a path
        found.append((text[: m.start()].count("\n") + 1, written, target))
    return found


def _all_paths() -> list[tuple[str, int, str, Path]]:
    return [
        (str(doc.relative_to(ROOT)), line, written, target)
        for doc in DOCS
        for line, written, target in _named_paths(doc)
    ]


def test_the_docs_name_paths_at_all() -> None:
    assert len(_all_paths()) > 100


def test_every_path_the_docs_name_exists() -> None:
    missing = [f"{doc}:{line}: {written}" for doc, line, written, target in _all_paths()
               if not target.exists()]  # fmt: skip
    assert not missing, "paths named in the docs that do not exist:\n" + "\n".join(missing)


@pytest.mark.parametrize("written", ["aggsrv/sim/profiles.py", "docs/no_such_folder/"])
def test_a_stale_path_is_caught(tmp_path: Path, written: str) -> None:
    page = tmp_path / "page.txt"
    page.write_text(f"See `{written}`, `README.md` and [this](gone.txt).\n")
    named = _named_paths(page)
    assert [w for _, w, t in named if not t.exists()] == [written, "gone.txt"]
