"""Every `aggsrv ...` command the README, docs/, the examples' and the benchmarks' READMEs show
parses with the CLI's own parser: a subcommand or an option the CLI does not have, a value it
refuses, or a command missing an argument the CLI requires fails here, naming the file and line.

What counts as a command: a line of a shell code block (bash, sh, console, or no language) that
starts with ``aggsrv ``, and an inline code span that does. An inline span of options alone
(`aggsrv status`, `aggsrv token --ttl-hours`) is a mention: its subcommand and option names must
exist, but it need not be complete. Upper-case words (FILE, DIR, N) are placeholders for a value.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from aggsrv.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
DOCS = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").rglob("*.md")),
    *sorted((ROOT / "examples").rglob("*.md")),
    *sorted((ROOT / "bench").rglob("README.md")),
]
SHELL_BLOCKS = {"", "bash", "sh", "shell", "console"}
SHELL_OPERATORS = {">", ">>", "|", "||", "&&", ";", "&", "2>", "2>&1"}
PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]*$")


def _commands(path: Path) -> list[tuple[int, str, bool]]:
    """(line, command, is it a mention) of every `aggsrv` command in a Markdown file."""
    text = path.read_text()
    found = []
    for block in re.finditer(r"^```([\w-]*)\n(.*?)^```", text, re.S | re.M):
        if block.group(1) not in SHELL_BLOCKS:
            continue
        line = start = text[: block.start()].count("\n") + 2
        command = ""
        for raw in block.group(2).split("\n"):  # a line ending in \ goes on on the next one
            start = line if not command else start
            command += raw.strip().removesuffix("\\") + " " if raw.endswith("\\") else raw
            line += 1
            if raw.endswith("\\"):
                continue
            command = command.strip().removeprefix("$ ")
            if command.startswith("aggsrv "):
                found.append((start, " ".join(command.split()), False))
            command = ""
    prose = re.sub(r"^```.*?^```", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S | re.M)
    for span in re.finditer(r"`(aggsrv [^`]+)`", prose):
        command = " ".join(span.group(1).split())
        words = command.split()[2:]
        mention = all(w.startswith("-") for w in words)
        found.append((prose[: span.start()].count("\n") + 1, command, mention))
    return found


def _argv(command: str) -> list[str]:
    """The arguments after ``aggsrv``, up to the first shell operator. A shell variable after an
    option stands for its value (a placeholder); elsewhere for options of its own (dropped)."""
    argv: list[str] = []
    for token in shlex.split(command, comments=True)[1:]:
        if token in SHELL_OPERATORS or token.startswith((">", "2>")):
            break
        if not token.startswith("$"):
            argv.append(token)
        elif not re.fullmatch(r"\$\{?\w+\}?", token):
            argv.append("VALUE")  # "$HOST:50051": a value made with a variable
        elif argv and argv[-1].startswith("--") and "=" not in argv[-1]:
            argv.append("VALUE")
    return argv


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _refusal(parser: argparse.ArgumentParser, argv: list[str]) -> str | None:
    """What the parser says against ``argv`` (None: it parses), placeholders taken as values."""
    argv = list(argv)
    for _ in range(len(argv) + 1):
        said = io.StringIO()
        try:
            with contextlib.redirect_stderr(said), contextlib.redirect_stdout(io.StringIO()):
                parser.parse_args(argv)
            return None
        except SystemExit as exc:
            if not exc.code:
                return None  # --help and the like
        message = said.getvalue().strip().splitlines()[-1]
        bad = re.search(r"invalid (?:int|float|\w+) value: '([^']*)'|invalid choice: '([^']*)'",
                        message)  # fmt: skip
        value = bad and (bad.group(1) or bad.group(2))
        if not value or not PLACEHOLDER.match(value) or value not in argv:
            return message
        if "invalid choice" in message:
            return None  # a placeholder for one of the choices
        argv[argv.index(value)] = "1"
    return "unparseable"


def _mention_refusal(parser: argparse.ArgumentParser, argv: list[str]) -> str | None:
    """A mention: its subcommand exists and has every option it names."""
    commands = _subparsers(parser)
    if not argv or argv[0] not in commands:
        return f"no subcommand {argv[0] if argv else ''!r}; there are {sorted(commands)}"
    options = commands[argv[0]]._option_string_actions
    unknown = [w.split("=")[0] for w in argv[1:] if w.split("=")[0] not in options]
    return f"aggsrv {argv[0]} has no option {unknown[0]}" if unknown else None


def _all_commands() -> list[tuple[str, int, str, bool]]:
    return [
        (str(path.relative_to(ROOT)), line, command, mention)
        for path in DOCS
        for line, command, mention in _commands(path)
    ]


def test_the_docs_show_commands_at_all() -> None:
    found = _all_commands()
    assert len(found) > 50, found  # the extraction itself works
    assert any(mention for *_, mention in found) and not all(m for *_, m in found)


@pytest.mark.parametrize(
    ("where", "line", "command", "mention"),
    _all_commands(),
    ids=lambda v: v if isinstance(v, str) and v.endswith(".md") else None,
)
def test_a_command_in_the_docs_parses(where: str, line: int, command: str, mention: bool) -> None:
    parser = build_parser()
    argv = _argv(command)
    said = _mention_refusal(parser, argv) if mention else _refusal(parser, argv)
    assert said is None, f"{where}:{line}: `{command}`: {said}"


def test_the_check_catches_what_it_should() -> None:
    parser = build_parser()
    assert _refusal(parser, _argv("aggsrv tune --trace FILE --strategy fedbuff --grid a=1,2"))
    assert _refusal(parser, _argv("aggsrv serve --no-such-option 3"))
    assert _refusal(parser, _argv("aggsrv simulate --seed x")) is not None
    assert _refusal(parser, _argv("aggsrv simulate --seed N --out DIR > log.txt")) is None
    assert _mention_refusal(parser, ["status"]) is None
    assert _mention_refusal(parser, ["status", "--no-such"]) is not None
    assert _mention_refusal(parser, ["frobnicate"]) is not None


def _helps(parser: argparse.ArgumentParser, where: str = "aggsrv"):
    """(where, option, help text) of every option of every subcommand, help filled in."""
    parser.format_help()  # fills the help texts that come from the config classes
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _helps(sub, f"{where} {name}")
        elif action.help and action.help != argparse.SUPPRESS:
            yield where, "/".join(action.option_strings) or action.dest, action.help


def test_the_cli_describes_itself_in_whole_lines() -> None:
    parser = build_parser()
    description = parser.description or ""
    assert description.endswith(".") and "\n" not in description
    missing = [name for name in _subparsers(parser) if f"`{name}`" not in description]
    assert not missing, f"`aggsrv --help` does not name {missing}"
    long = [f"{where} {option}: {len(text)}" for where, option, text in _helps(parser)
            if len(text) >= 120]  # fmt: skip
    assert not long, "help texts of 120 characters or more:\n" + "\n".join(long)


def test_a_command_continued_over_lines_is_checked_whole(tmp_path: Path) -> None:
    page = tmp_path / "page.txt"
    page.write_text("text\n\n```bash\naggsrv simulate --seed 1 \\\n    --no-such-option 2\n```\n")
    ((line, command, mention),) = _commands(page)
    assert (line, command, mention) == (4, "aggsrv simulate --seed 1 --no-such-option 2", False)
    assert "--no-such-option" in (_refusal(build_parser(), _argv(command)) or "")
