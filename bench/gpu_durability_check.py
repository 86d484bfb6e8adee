"""Device check of the durable core on a GPU: a CUDA model is copied to the host once per
version however many readers (GetModel and jobs), the event loop keeps answering meanwhile, and a
Fed-OGD checkpoint with 50 outstanding jobs holds their shared basis once and resumes to the same
memory and bits on the device. Prints one JSON line ("GPUCHECK {...}") of counts and figures.

    python bench/gpu_durability_check.py         # CUDA (needs a GPU)
    python bench/gpu_durability_check.py cpu     # the same steps on the CPU (no host copies)

Run from the repository root (it imports tests/support/server_helpers.py).
"""

import json
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
import torch  # noqa: E402
from server_helpers import RunningServer  # noqa: E402

from aggsrv.client.client import Client  # noqa: E402
from aggsrv.layout import ModelLayout  # noqa: E402
from aggsrv.server import versions as V  # noqa: E402
from aggsrv.values import Status, UpdateKind  # noqa: E402

DEVICE = sys.argv[1] if len(sys.argv) > 1 else "cuda"
assert DEVICE == "cpu" or torch.cuda.is_available()
out = {
    "gpu": torch.cuda.get_device_name(0) if DEVICE == "cuda" else "cpu",
    "torch": torch.__version__,
}
copies: list[tuple[str, int, float]] = []
real = V.to_host


def counting(t: torch.Tensor, pinned: bool = False) -> torch.Tensor:
    t0 = time.perf_counter()
    host = real(t, pinned)
    copies.append((t.device.type, t.numel(), time.perf_counter() - t0))
    return host


V.to_host = counting  # where the host copies are made
D = (16 * 2**20 if DEVICE == "cuda" else 2**16) + 3
layout = ModelLayout.from_named_shapes([("a.weight", (D // 3, 3)), ("a.bias", (D - D // 3 * 3,))])
READERS = 16


def read_all(address: str, n: int) -> tuple[list, list[float]]:
    got: list = []
    lat: list[float] = []
    stop = threading.Event()

    def read() -> None:
        with Client(address, "r", max_message_bytes=8 << 20) as r:
            got.append(r.get_model())

    def probe() -> None:
        with Client(address, "probe") as p:
            while not stop.is_set():
                t0 = time.perf_counter()
                p.status()
                lat.append(time.perf_counter() - t0)

    prober = threading.Thread(target=probe, daemon=True)
    prober.start()
    threads = [threading.Thread(target=read, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    stop.set()
    prober.join(timeout=10)
    return got, lat


srv = RunningServer(strategy="fedasync", device=DEVICE, rate_limit_per_second=0.0)
try:
    assert srv.strategy is None
    with Client(srv.address, "a", max_message_bytes=8 << 20) as a:
        a.register(layout=layout, initial=torch.randn(D))
        assert srv.strategy.device.type == DEVICE
        want = srv.model().cpu()
        got, lat = read_all(srv.address, READERS)
        assert len(got) == READERS and all(v == 0 and torch.equal(w, want) for v, w in got)
        out["v0_copies"] = len(copies)
        out["status_p50_ms_during_reads"] = statistics.median(lat) * 1e3
        out["status_max_ms_during_reads"] = max(lat) * 1e3
        job = a.get_job()
        assert torch.equal(job.weights, want)
        out["copies_after_job_v0"] = len(copies)
        res = a.push(job, torch.randn(D) * 1e-3, kind=UpdateKind.DELTA)
        assert res.status is Status.APPLIED
        want1 = srv.model().cpu()
        got, lat = read_all(srv.address, READERS)
        assert all(v == 1 and torch.equal(w, want1) for v, w in got)
        job = a.get_job()
        assert torch.equal(job.weights, want1)
        out["copies_after_v1"] = len(copies)
        out["copy_ms"] = [round(c[2] * 1e3, 2) for c in copies]
        out["copy_devices"] = sorted({c[0] for c in copies})
finally:
    srv.stop()

# Durable on CUDA: publication after fsync, Fed-OGD checkpoints and resume bit-exact.
tmp = tempfile.mkdtemp()
cfg = {
    "strategy": "fedogd", "device": DEVICE, "durability": "on", "state_dir": tmp + "/s",
    "rate_limit_per_second": 0.0, "retained_versions": 1, "max_clients": 64,
    "strategy_config": {"epoch_timeout": 30.0},
}  # fmt: skip
small = ModelLayout.from_named_shapes([("w", (100_003,))])
srv = RunningServer(**cfg)
fed = srv.federation
try:
    with Client(srv.address, "c0") as c:
        c.register(layout=small, initial=torch.randn(small.numel))
    for i in range(1, 50):
        srv.run(fed.register(f"c{i}", {}))
    before = srv.run(fed.checkpoint()).bytes
    for i in range(50):
        srv.run(fed.next_job(f"c{i}"))[2].release()
    after = srv.run(fed.checkpoint()).bytes
    live = srv.run(fed.call(fed.cache_bytes))
    live_state = srv.state()
finally:
    srv.stop()
resumed = RunningServer(**cfg, resume=True)
try:
    rb = resumed.run(resumed.federation.call(resumed.federation.cache_bytes))
    rs = resumed.state()
    same = all(torch.equal(live_state[k].cpu(), rs[k].cpu()) for k in ("model",)) and torch.equal(
        live_state["extra"]["bases"].cpu(), rs["extra"]["bases"].cpu()
    )
finally:
    resumed.stop()
shutil.rmtree(tmp, ignore_errors=True)
out.update(
    fedogd_ckpt_growth_50_jobs=after - before, one_model_bytes=4 * small.numel,
    fedogd_cache_bytes_live=live, fedogd_cache_bytes_resumed=rb, fedogd_resumed_same=same,
)  # fmt: skip
print("GPUCHECK " + json.dumps(out))
