"""docs/config.md is what aggsrv.config_reference generates from the configuration classes now,
and the generator writes types, defaults and every key as a user reads them."""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field

from aggsrv.config_check import Count
from aggsrv.config_reference import COMMAND, reference, type_text
from aggsrv.server.config import ServerConfig
from aggsrv.sim.config import SimConfig
from aggsrv.strategies import STRATEGIES

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "config.md"


def test_docs_config_md_is_generated_from_the_code() -> None:
    want = reference()
    have = PAGE.read_text() if PAGE.exists() else ""
    if have != want:
        diff = "".join(
            list(
                difflib.unified_diff(
                    have.splitlines(keepends=True),
                    want.splitlines(keepends=True),
                    "docs/config.md",
                    "generated",
                )
            )[:60]
        )
        raise AssertionError(
            f"docs/config.md is out of date with the config classes; regenerate it with\n"
            f"    {COMMAND}\nand commit it. The first differences:\n{diff}"
        )


def test_the_page_says_it_is_generated_and_how() -> None:
    first = reference().split("\n\n")[1]
    assert "generated" in first and COMMAND in first


def _section(text: str, heading: str) -> str:
    body = text.split(f"\n{heading}\n", 1)[1]
    return body.split("\n## ", 1)[0].split("\n### ", 1)[0]


def test_every_key_of_every_section_has_a_row() -> None:
    text = reference()
    sections = [
        ("## `aggsrv serve`", ServerConfig),
        ("## `aggsrv simulate`", SimConfig),
        *[(f"### `{name}`", cls.config_class) for name, cls in STRATEGIES.items()],
    ]
    for heading, cls in sections:
        rows = [line for line in _section(text, heading).splitlines() if line.startswith("| `")]
        keys = [row.split("`")[1] for row in rows]
        # Every key the section's class offers (a strategy without DP leaves out the dp_ keys).
        offered = cls.offered_keys() if hasattr(cls, "offered_keys") else cls.keys()
        assert sorted(keys) == sorted(offered), heading
        described = cls.field_help()
        for row, key in zip(rows, keys, strict=True):
            cell = described[key].replace("|", "\\|")  # a table cell's | escaped
            assert row.endswith(f" | {cell} |"), row


def test_types_and_defaults_read_as_a_user_reads_them() -> None:
    cases = [
        (int, "int"),
        (float, "float"),
        (bool, "bool"),
        (str, "str"),
        (Count, "int >= 1"),
        (Count | None, "optional int >= 1"),
        (Annotated[float, Field(gt=0, le=1)], "float > 0 <= 1"),
        (list[str], "list of str"),
        (dict[str, Any], "table"),
        (dict[str, Count], "table of int >= 1"),
        (dict[str, Any] | None, "optional table"),
        (str | dict[str, Any], "str or table"),
        (float | int, "float or int"),
        (str | None, "optional str"),
    ]
    for hint, text in cases:
        assert type_text(hint) == text, hint
    serve = _section(reference(), "## `aggsrv serve`")
    assert '| `host` | str | `"127.0.0.1"` | ' in serve
    assert '| `update_quantizations` | list of str | `["int8", "int4"]` | ' in serve
    assert "| `metrics_port` | optional int | unset | " in serve
    assert "| `max_clients` | int >= 1 | `1024` | " in serve
    assert "| `resume` | bool | `false` | " in serve
    assert '| `durability` | str | `"auto"` | ' in serve  # the class's, resolved at load
    simulate = _section(reference(), "## `aggsrv simulate`")
    assert '| `profile` | str or table | `"tiers"` | ' in simulate
    assert "| `model_config` | table | `{}` | " in simulate
