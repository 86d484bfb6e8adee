"""A short coverage-guided run (atheris / libFuzzer) of bench/fuzz/atheris_transport.py: a
structure-aware PushUpdate header plus chunks and trailer through the decoder, where any input
must end in a decoded update or a clean CodecError/ValueError and never write outside the
update. The harness runs for as long as one likes by hand; CI runs a few seconds of it."""

from __future__ import annotations

import re
import resource
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("atheris")

HARNESS = Path(__file__).resolve().parents[2] / "bench" / "fuzz" / "atheris_transport.py"
RUNS = 50_000


def test_atheris_transport_finds_nothing(tmp_path: Path) -> None:
    # libFuzzer's RSS limit reads the process's peak RSS, which Linux carries over from the parent
    # through fork and exec: a pytest process that has grown past 2 GiB (a long run, a busy
    # xdist worker) made a fresh harness "run out of memory" at its first input. The limit is
    # therefore counted from the peak it inherits; one allocation stays capped at 2 GiB.
    inherited_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    proc = subprocess.run(
        [sys.executable, str(HARNESS), f"-runs={RUNS}", "-seed=0", f"-artifact_prefix={tmp_path}/",
         f"-rss_limit_mb={inherited_mb + 2048}", "-malloc_limit_mb=2048"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    done = re.search(r"Done (\d+) runs", out)
    assert done and int(done.group(1)) == RUNS, out[-2000:]
    cov = re.findall(r"cov: (\d+)", out)
    # Coverage feedback works: the run reached well into the decoder, not just the entry.
    assert cov and int(cov[-1]) >= 50, out[-2000:]
    assert not list(tmp_path.glob("crash-*"))
    print(f"atheris: {RUNS} inputs, coverage {cov[-1]} edges, no finding")
