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


def test_python_dash_m_aggsrv_is_the_aggsrv_command() -> None:
    """``python -m aggsrv`` runs the same command line as the ``aggsrv`` script."""
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "aggsrv", "serve", "--print-config", "--strategy", "fedbuff"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "buffer_size" in proc.stdout
    usage = subprocess.run(
        [sys.executable, "-m", "aggsrv", "--help"], capture_output=True, text=True, timeout=120
    )
    assert usage.returncode == 0 and usage.stdout.startswith("usage: aggsrv"), usage.stdout[:200]
