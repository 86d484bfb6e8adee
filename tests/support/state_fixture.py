"""The state directory kept as a test fixture of today's formats (docs/compatibility.md): a
durable FedAsync run whose log must be replayed on resume, with float32 and INT8 updates (the
latter folded from their codes), and the model the live server held.

`python tests/support/state_fixture.py tests/fixtures/NAME` writes one. A fixture is written once,
when a format changes, and then kept: every later version must resume it (or refuse it with a
message that says how to migrate), which `tests/server/test_compatibility.py` checks.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch

from aggsrv.client.client import Client
from aggsrv.client.compression import Compression
from aggsrv.layout import ModelLayout
from aggsrv.server import durability as D
from aggsrv.server.persistence import FORMAT
from aggsrv.trace_format import FORMAT as TRACE_FORMAT

LAYOUT = ModelLayout.from_named_shapes([("fc.weight", (7, 3)), ("fc.bias", (3,))])
# On the CPU: a log of updates folded from their codes resumes only where they fold again.
CONFIG = {"strategy": "fedasync", "auth": "none", "durability": "on", "rate_limit_per_second": 0.0,
          "checkpoint_every_updates": 0, "device": "cpu",
          "strategy_config": {"alpha": 0.5}}  # fmt: skip


def write_state(state_dir: Path) -> dict:
    """A state directory whose newest checkpoint is gone (so resuming replays the log), and what
    a resumed server must hold: its version and model (float32 bytes, hex)."""
    from server_helpers import RunningServer

    shutil.rmtree(state_dir, ignore_errors=True)
    srv = RunningServer(state_dir=str(state_dir), **CONFIG)
    try:
        initial = torch.linspace(-1.0, 1.0, LAYOUT.numel)
        with Client(srv.address, "plain") as c:
            c.register(layout=LAYOUT, initial=initial)
            for i in range(2):
                c.push(c.get_job(), torch.linspace(0.0, 0.01 * (i + 1), LAYOUT.numel))
        with Client(srv.address, "int8", compression=Compression(quantization="int8")) as c:
            c.register(layout=LAYOUT)
            for i in range(2):
                c.push(c.get_job(), torch.linspace(0.02 * (i + 1), -0.01, LAYOUT.numel))
        live = srv.state()
    finally:
        srv.stop()
    newest = D.list_checkpoints(state_dir)[-1][1]
    newest.unlink()  # the stop's checkpoint: a resume starts from the first one and the log
    return {
        "checkpoint_format": FORMAT,
        "wal_magic": D.WAL_MAGIC.decode(),
        "trace_format": TRACE_FORMAT,
        "version": int(live["version"]),
        "model": live["model"].numpy().astype("<f4").tobytes().hex(),
        "config": CONFIG,
        "layout": [[n, list(shape)] for n, shape in zip(LAYOUT.names, LAYOUT.shapes, strict=True)],
    }


if __name__ == "__main__":
    out = Path(sys.argv[1])
    expected = write_state(out / "state")
    (out / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")
    print(f"wrote {out}: version {expected['version']}")
