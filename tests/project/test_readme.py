"""The README's example and the command line must keep working as documented."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_readme_kernel_example_runs() -> None:
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, "README has no python example"
    namespace: dict = {}
    exec(compile(blocks[0], "README.md", "exec"), namespace)  # noqa: S102
    K = namespace["K"]
    assert tuple(namespace["Z"].shape) == (K - 1, 4)
    # The example's FedAvg line must equal an independent mean.
    assert namespace["global_update"].shape == (namespace["D"],)


def _commands(block: str) -> list[str]:
    """The commands of a shell block: comments and blank lines dropped."""
    return [c for c in (line.split("#")[0].strip() for line in block.splitlines()) if c]


def _make_dry_run(target: str, cwd: Path = ROOT, *flags: str) -> list[str]:
    """The commands ``make TARGET`` would run (``make -n``), one per logical line."""
    import os

    # Not the settings of a make that runs these tests (`make test PYTEST_ARGS=...`): its flags,
    # and the knobs it exports, which the defaults given here override.
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    knobs = ["PYTHON=python3", "TORCH_INDEX=", "PYTEST_ARGS="]
    proc = subprocess.run(
        ["make", "--no-print-directory", "-n", *flags, *knobs, target],
        capture_output=True, text=True, check=True, cwd=cwd, env=env,
    )  # fmt: skip
    return [" ".join(c.split()) for c in proc.stdout.replace("\\\n", " ").splitlines()]


def test_readme_commands_match_ci() -> None:
    """README's two commands are `make demo` and `make test`; .ci/run runs exactly the second;
    the Makefile runs the steps README's "Set up by hand" lists."""
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", readme, flags=re.S)
    demo, test, by_hand = blocks[0], blocks[1], blocks[2]
    assert _commands(demo) == ["make demo"]
    assert _commands(test) == ["make test"]
    ci = _commands((ROOT / ".ci" / "run").read_text())
    assert ci[0] == "set -euo pipefail" and ci[1].startswith("cd ")
    assert ci[2:] == _commands(test)
    # -B: every step, as in a fresh clone.
    for target, last in (
        ("demo", ".venv/bin/aggsrv simulate"),
        ("test", ".venv/bin/python -m pytest"),
    ):
        steps = _make_dry_run(target, ROOT, "-B")
        assert steps[-1] == last
        text = "\n".join(steps)
        assert "python3 -m venv .venv" in text
        assert ".venv/bin/python -m pip install --upgrade pip" in text
        assert "command -v nvidia-smi" in text
        assert re.search(r'pip install +"torch==2\.13\.0"', text)
        assert '.venv/bin/python -m pip install -e ".[dev,sim,flower,dp,nvflare]"' in text
        assert ("apt-get install -y -q dataset-fashion-mnist" in text) == (target == "test")
    manual = _commands(by_hand)
    for command in (
        "python3 -m venv .venv && . .venv/bin/activate",
        "python -m pip install --upgrade pip",
        "pip install torch==2.13.0",
        'pip install -e ".[dev,sim,flower,dp,nvflare]"',
        "apt-get install dataset-fashion-mnist",
        "python -m pytest",
    ):
        assert command in manual, command


def test_make_sets_up_once(tmp_path) -> None:
    """A second `make test` runs the tests alone; a changed pyproject.toml installs again."""
    import os
    import shutil

    shutil.copy(ROOT / "Makefile", tmp_path)
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    (tmp_path / ".venv" / "bin" / "python").touch()
    stamp = tmp_path / ".venv" / ".aggsrv-installed"
    stamp.touch()
    os.utime(tmp_path / "pyproject.toml", (1_000_000, 1_000_000))
    steps = _make_dry_run("test", tmp_path)
    assert not any("pip install" in s or "-m venv" in s for s in steps), steps
    assert steps[-1] == ".venv/bin/python -m pytest"
    os.utime(stamp, (999_999, 999_999))  # pyproject.toml is newer than the install
    steps = _make_dry_run("test", tmp_path)
    assert any('pip install -e ".[dev,sim,flower,dp,nvflare]"' in s for s in steps), steps
    assert not any("-m venv" in s for s in steps)


def test_readme_main_command(tmp_path) -> None:
    """`aggsrv simulate` with its defaults (a real server and clients over gRPC on digits):
    done in under 90 s at 0.8 test accuracy or better, with its files, as the README says."""
    import json
    import time

    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "aggsrv.cli", "simulate", "--no-progress"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    elapsed = time.monotonic() - t0
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = tmp_path / "runs" / "fedasync-digits-grpc-s0"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["transport"] == "grpc" and summary["dataset"] == "digits"
    assert summary["final_accuracy"] >= 0.8, summary["final_accuracy"]
    assert elapsed < 90, elapsed
    for name in ("config.toml", "metrics.jsonl", "accuracy.png"):
        assert (run_dir / name).is_file()
    assert "final accuracy" in proc.stdout and "time to 0.8" in proc.stdout


def test_cli_info_reports_backend() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "aggsrv.cli", "info"], capture_output=True, text=True, check=True
    )
    assert "kernel backends: auto, triton, cpu, reference" in proc.stdout


def test_kernel_doc_example_runs() -> None:
    text = (ROOT / "docs" / "kernels.md").read_text()
    block = re.findall(r"```python\n(.*?)```", text, flags=re.S)[0]
    namespace: dict = {}
    exec(compile(block, "docs/kernels.md", "exec"), namespace)  # noqa: S102
    updates = namespace["updates"]
    assert tuple(namespace["per_layer"].shape) == (4, 16, 16)
    torch_mean = updates.double().mean(0).float()
    assert (namespace["mean_update"] - torch_mean).abs().max() < 1e-5


def test_design_and_algorithm_doc_examples_run() -> None:
    """Every python block of docs/design.md and docs/algorithms/*.md runs as printed (the
    blocks assert their own results); design.md's encoding example must be among them."""
    docs = [ROOT / "docs" / "design.md", *sorted((ROOT / "docs" / "algorithms").glob("*.md"))]
    ran = []
    for doc in docs:
        for i, block in enumerate(re.findall(r"```python\n(.*?)```", doc.read_text(), flags=re.S)):
            name = f"{doc.relative_to(ROOT)} block {i + 1}"
            exec(compile(block, name, "exec"), {})  # noqa: S102
            ran.append(name)
    assert "docs/design.md block 1" in ran


def test_readme_client_example_against_a_real_server() -> None:
    """The README's client snippet runs unchanged against a server on a free port."""
    import asyncio
    import threading

    from aggsrv.server.app import Server
    from aggsrv.server.config import ServerConfig

    text = (ROOT / "README.md").read_text()
    block = re.findall(r"```python\n(.*?)```", text, flags=re.S)[1]
    assert "Client(" in block
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    server = Server(
        ServerConfig(port=0, strategy="fedasync", auth="none", durability="off", state_dir="")
    )
    port = asyncio.run_coroutine_threadsafe(server.start(), loop).result(60)
    try:
        namespace: dict = {}
        code = block.replace("localhost:50051", f"127.0.0.1:{port}")
        exec(compile(code, "README.md", "exec"), namespace)  # noqa: S102
        assert namespace["result"].version == 1
        assert server.federation.strategy.version == 1
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(grace=1), loop).result(60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
