"""The end-to-end GPU server benchmark must keep working on a CPU machine: its dry run starts
`aggsrv serve` for each strategy and durability mode on a tiny model, pushes from two client
processes and checks its own figures (bench/gpu_server.py)."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINE = re.compile(
    r"^(?P<case>[\d.]+ MB (?P<strategy>\w+) durability (?P<durability>on|off) cpu): "
    r"(?P<ups>\S+) updates/s, (?P<mbps>\S+) MB/s, push p50 (?P<p50>\S+) ms p99 (?P<p99>\S+) ms"
)


def test_gpu_server_bench_dry_run() -> None:
    """`bench/gpu_server.py --dry-run` runs every strategy and durability mode on the CPU, and
    prints finite, positive figures for each."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu_server.py"), "--dry-run"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "dry run: all ok" in proc.stdout
    runs = [m for m in map(LINE.match, proc.stdout.splitlines()) if m]
    cases = {(m["strategy"], m["durability"]) for m in runs}
    assert cases == {(s, d) for s in ("fedbuff", "orthofl") for d in ("off", "on")}, proc.stdout
    for m in runs:
        figures = {k: float(m[k]) for k in ("ups", "mbps", "p50", "p99")}
        assert all(math.isfinite(v) and v > 0 for v in figures.values()), (m["case"], figures)
        assert figures["p99"] >= figures["p50"], (m["case"], figures)
