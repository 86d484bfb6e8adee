"""The GPU measurements must keep working on a CPU machine. `bench/gpu_all.sh --dry-run` runs
every step of a GPU session the CPU allows: it collects the tests that need CUDA, checks every
kernel on tiny shapes (bench/gpu_kernels.py), and runs the end-to-end server benchmark
(bench/gpu_server.py), which starts `aggsrv serve` for each strategy and durability mode on a
tiny model, pushes from two client processes and checks its own figures."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINE = re.compile(
    r"^(?P<case>[\d.]+ MB (?P<strategy>\w+) durability (?P<durability>on|off) cpu): "
    r"(?P<ups>\S+) updates/s, (?P<mbps>\S+) MB/s, push p50 (?P<p50>\S+) ms p99 (?P<p99>\S+) ms"
)


def test_every_gpu_step_runs_on_the_cpu_in_the_dry_run(tmp_path: Path) -> None:
    """Every step of `bench/gpu_all.sh --dry-run` ends ok (each one's log is kept), the CUDA
    tests it would run are found, and the server benchmark prints finite, positive figures for
    every strategy and durability mode."""
    out = tmp_path / "gpu"
    proc = subprocess.run(
        ["bash", str(ROOT / "bench" / "gpu_all.sh"), "--dry-run", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHON": sys.executable},
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    summary = (out / "summary.txt").read_text().splitlines()
    assert [line.split(":")[0] for line in summary] == ["tests", "kernels", "server"]
    assert all(": ok, " in line for line in summary), summary
    collected = re.search(r"^(\d+)(?:/\d+)? tests collected", (out / "tests.log").read_text(), re.M)
    assert collected and int(collected[1]) > 100, (out / "tests.log").read_text()[-2000:]
    assert "dry run: all ok" in (out / "kernels.log").read_text()
    server = (out / "server.log").read_text()
    assert "dry run: all ok" in server
    runs = [m for m in map(LINE.match, server.splitlines()) if m]
    cases = {(m["strategy"], m["durability"]) for m in runs}
    assert cases == {(s, d) for s in ("fedbuff", "orthofl") for d in ("off", "on")}, server
    for m in runs:
        figures = {k: float(m[k]) for k in ("ups", "mbps", "p50", "p99")}
        assert all(math.isfinite(v) and v > 0 for v in figures.values()), (m["case"], figures)
        assert figures["p99"] >= figures["p50"], (m["case"], figures)
