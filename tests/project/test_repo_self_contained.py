"""The repository stands on its own: no tracked file points at a file a reader cannot have.

Two rules over every tracked text file (``git ls-files``; files with a NUL byte or that are not
UTF-8 are skipped):

1. **No path outside the repository.** Names of the development machine's own notes that were
   never part of it (its design and platform notes, :data:`OUTSIDE_NOTES`), its folders
   (:data:`OUTSIDE_FOLDERS`, and absolute home or work paths) and relative paths that climb
   above the repository root are refused.
2. **Every Markdown reference resolves.** Each token that ends in ``.md`` (letters, digits,
   ``_``, ``-``, ``.`` and ``/`` before it; URLs are ignored) must name a tracked file when read
   relative to, in this order: the referencing file's folder, the repository root, ``docs/``,
   ``docs/algorithms/``. So ``docs/algorithms/fedogd.md G3`` resolves from anywhere,
   ``fedogd.md`` from a file in ``docs/algorithms/`` or by the last rule, and ``BACKENDS.md``
   only from a file in ``kernels/``.

3. **Cited sections exist.** A citation ``docs/design.md "Heading"`` or ``docs/wire.md "Heading"``
   (the file, then a heading in double quotes) must name a heading of that file, so the
   sections code comments lean on cannot be renamed from under them.

The refused names are assembled from parts below, so rule 1 holds for this file too; rules 2 and
3 skip it (its self-test spells references that resolve nowhere, on purpose).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path, PurePosixPath

ROOT = Path(__file__).resolve().parents[2]
SELF = Path(__file__).resolve().relative_to(ROOT).as_posix()

# The machine's notes and folders, assembled so that no literal outside name stands here.
OUTSIDE_NOTES = ("DESIGN" + ".md", "PLATFORM" + ".md")
OUTSIDE_FOLDERS = ("sha" + "red/", "spe" + "cs/", "see" + "ds/")
MACHINE_ROOTS = ("/" + "work/", "/" + "home/", "/" + "root/")

# (pattern, why) pairs of rule 1; matched case-sensitively unless the pattern says otherwise.
OUTSIDE = [
    (re.compile(re.escape(OUTSIDE_NOTES[0])), "an outside design document (see docs/design.md)"),
    (re.compile("(?i)" + re.escape(OUTSIDE_NOTES[1])), "an outside platform note (state the fact)"),
    (re.compile(r"(?<![\w.])" + OUTSIDE_FOLDERS[0]), "a folder of the development machine"),
    (
        re.compile(r"(?<![\w.])" + OUTSIDE_FOLDERS[1]),
        "the outside algorithm notes (docs/algorithms/)",
    ),
    (re.compile(r"(?<![\w.])" + OUTSIDE_FOLDERS[2]), "the outside paper copies (cite the paper)"),
    (re.compile("|".join(map(re.escape, MACHINE_ROOTS))), "an absolute path of a machine"),
]
MD_REF = re.compile(r"[\w./-]*\w\.md\b")
URL = re.compile(r"[a-z][a-z0-9+.-]*://\S+", re.I)
UP = re.compile(r"(?<![\w.])(?:\.\./)+[\w./-]*")
SEARCH = ("", "docs", "docs/algorithms")


def tracked_text_files(include_self: bool = False) -> dict[str, str]:
    """Tracked UTF-8 text files; this one only on request (its self-test spells references that
    resolve nowhere, on purpose)."""
    names = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True
    ).stdout.split(b"\0")
    texts = {}
    for raw in names:
        name = raw.decode()
        if not name or (name == SELF and not include_self) or not (ROOT / name).is_file():
            continue
        data = (ROOT / name).read_bytes()
        if b"\0" in data:
            continue
        try:
            texts[name] = data.decode("utf-8")
        except UnicodeDecodeError:
            continue
    return texts


def resolves(ref: str, referrer: str, tracked: set[str]) -> bool:
    if ref.startswith("/"):
        return False
    bases = [str(PurePosixPath(referrer).parent), *SEARCH]
    for base in bases:
        parts: list[str] = []
        for part in PurePosixPath(base, ref).parts:
            if part == "..":
                if not parts:
                    break
                parts.pop()
            elif part not in (".", ""):
                parts.append(part)
        else:
            if "/".join(parts) in tracked:
                return True
    return False


def leaves_repo(ref: str, referrer: str) -> bool:
    depth = len(PurePosixPath(referrer).parent.parts)
    for part in PurePosixPath(ref).parts:
        if part == "..":
            depth -= 1
            if depth < 0:
                return True
        elif part != ".":
            depth += 1
    return False


def line_of(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def test_no_path_outside_the_repository() -> None:
    problems = []
    for name, text in tracked_text_files(include_self=True).items():
        for pattern, why in OUTSIDE:
            for m in pattern.finditer(text):
                problems.append(f"{name}:{line_of(text, m.start())}: {m.group(0)!r}: {why}")
        for m in UP.finditer(URL.sub(lambda u: " " * len(u.group(0)), text)):
            if leaves_repo(m.group(0), name):
                problems.append(
                    f"{name}:{line_of(text, m.start())}: {m.group(0)!r} leaves the repo"
                )
    assert not problems, "\n".join(problems)


# Markdown files that a command writes into its output folder: named, not referenced.
GENERATED_MARKDOWN = {"sweep.md", "tune.md"}  # the reports of `aggsrv sweep` and `aggsrv tune`


def test_markdown_references_resolve() -> None:
    texts = tracked_text_files()
    tracked = set(
        subprocess.run(
            ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.split("\n")
    )
    problems = []
    for name, text in texts.items():
        text = URL.sub(lambda u: " " * len(u.group(0)), text)
        for m in MD_REF.finditer(text):
            if PurePosixPath(m.group(0)).name in GENERATED_MARKDOWN:
                continue
            if not resolves(m.group(0), name, tracked):
                problems.append(f"{name}:{line_of(text, m.start())}: {m.group(0)!r} not tracked")
    assert not problems, "\n".join(problems)


CITED = re.compile(r'(docs/(?:design|wire)\.md)(?:\'s)?,? "([^"\n]+)"')


def headings(path: Path) -> set[str]:
    text = path.read_text("utf-8")
    return {m.group(1).replace("`", "").strip() for m in re.finditer(r"^#+ (.+)$", text, re.M)}


def test_cited_sections_exist() -> None:
    known = {doc: headings(ROOT / doc) for doc in ("docs/design.md", "docs/wire.md")}
    problems = []
    for name, text in tracked_text_files().items():
        for m in CITED.finditer(text):
            if m.group(2) not in known[m.group(1)]:
                problems.append(f"{name}:{line_of(text, m.start())}: no heading {m.group(0)!r}")
    assert not problems, "\n".join(problems)


def test_the_rules_catch_what_they_should() -> None:
    """The checker itself, on made-up references (a checker that finds nothing passes too)."""
    tracked = {"docs/design.md", "docs/algorithms/fedogd.md", "kernels/BACKENDS.md", "README.md"}
    assert resolves("docs/algorithms/fedogd.md", "aggsrv/strategies/x.py", tracked)
    assert resolves("fedogd.md", "aggsrv/strategies/x.py", tracked)
    assert resolves("BACKENDS.md", "kernels/cpu.py", tracked)
    assert not resolves("BACKENDS.md", "aggsrv/layout.py", tracked)
    assert resolves("../design.md", "docs/algorithms/feden.md", tracked)
    assert resolves("../README.md", "docs/wire.md", tracked)
    assert not resolves("orthofl.md", "docs/wire.md", tracked)
    assert not resolves(MACHINE_ROOTS[0] + "x/README.md", "README.md", tracked)
    climb = "../" * 2 + "x"  # assembled: rule 1 reads this file too
    assert leaves_repo(climb, "docs/wire.md") and not leaves_repo("../README.md", "docs/a.md")
    outside_note = OUTSIDE_FOLDERS[0] + OUTSIDE_FOLDERS[1] + "fedogd.md"
    flagged = [p for p, _ in OUTSIDE if p.search("see " + outside_note)]
    assert len(flagged) == 2
    assert not any(p.search("docs/design.md and docs/algorithms/") for p, _ in OUTSIDE)
    m = CITED.search('see docs/design.md "Outcome of an update" and')
    assert m is not None and m.group(2) == "Outcome of an update"
    assert m.group(2) in headings(ROOT / "docs" / "design.md")
    assert "Nope" not in headings(ROOT / "docs" / "design.md")
