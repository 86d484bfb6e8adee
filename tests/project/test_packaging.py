"""Every Python package in the tree is declared in pyproject.toml, so a regular (non-editable)
install ships it."""

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _packages_on_disk() -> set[str]:
    found = set()
    for base, prefix in (("aggsrv", "aggsrv"), ("kernels", "aggsrv.kernels")):
        for init in (ROOT / base).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / base).parts
            found.add(".".join((prefix, *rel)))
    return found


def test_every_package_is_declared() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    declared = set(config["tool"]["setuptools"]["packages"])
    assert _packages_on_disk() == declared
