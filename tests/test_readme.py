"""The README's example and the command line must keep working as documented."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


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


def test_readme_commands_match_ci() -> None:
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", readme, flags=re.S)
    setup, tests = blocks[0], blocks[1]
    commands = [line.split("#")[0].strip() for line in setup.splitlines()]
    # The first command block sets up and runs the main job; CI installs the same way.
    for command in ("pip install torch==2.13.0", 'pip install -e ".[dev,sim,flower]"'):
        assert command in commands
        assert command in ci
    assert commands[-1] == "aggsrv simulate"
    test_commands = [line.split("#")[0].strip() for line in tests.splitlines()]
    assert test_commands[-1] == "pytest" and "python -m pytest" in ci
    assert "dataset-fashion-mnist" in tests and "dataset-fashion-mnist" in ci


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
