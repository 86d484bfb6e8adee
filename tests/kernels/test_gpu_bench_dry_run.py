"""The GPU benchmark script must keep working: its dry run checks every kernel on tiny shapes.

Like conftest.py, the dry run interprets the kernels only where there is no GPU: on a CUDA machine
it compiles them (the interpreter of Triton 3.6, which torch 2.11 pins, cannot run them under
numpy 2.4 or newer: it calls int() on one-element arrays, which numpy now refuses).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_bench_dry_run() -> None:
    """`bench/gpu_kernels.py --dry-run` runs every kernel and baseline and exits 0."""
    env = dict(os.environ)
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu_kernels.py"), "--dry-run"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "dry run: all ok" in proc.stdout
