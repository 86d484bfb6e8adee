"""What rank 0's relay costs (docs/sharding.md "One address"): a client that streams each
update's slices to both shards itself (``direct_to_shards=True``) against one that talks to
rank 0 only (``direct_to_shards=False``: rank 0 takes the whole update and forwards shard 1's
slice; GetJob returns the whole job, rank 0 fetching shard 1's slice), over real gRPC on
loopback, in the same federation, interleaved.

`aggsrv serve --shards 2` (two processes, one gloo group, `--state-dir ''`, `--auth none`,
durability off, no rate limit, torch's default threads), FedAsync (alpha 0.6: the shards only
vote), D = 1M and 4M float32 in the 6-tensor layout of `test_bench_sharding_grpc`. Two clients
in the pytest process, "direct" and "relay", registered with the same federation; a round is,
per client in turn (the one going first alternates), `get_job()` (timed) then `push(job,
delta)` (timed, APPLIED). E2E_WARMUP rounds untimed, then E2E_UPDATES timed.

Bytes through rank 0 per call, from the shards' Prometheus counters read between the calls
(payload bytes, without gRPC's framing): a push's bytes into rank 0 are rank 0's
`aggsrv_received_bytes`; out of it, for a relayed push, what shard 1 received (the slice rank 0
forwarded). A GetJob's bytes out of rank 0 are rank 0's `aggsrv_sent_bytes`; into it, for a
whole job, what shard 1 sent (its slice, to rank 0).

Effective GB/s = 4D bytes / median time. The client, both shards and the relay share this
machine's cores and loopback is no network card: the difference is the relay's CPU cost plus
one more hop, not a network's.
"""

from __future__ import annotations

import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from conftest import SCALE, emit, fmt_size, fmt_time, random_tensor, scaled
from test_bench_sharding import (
    E2E_SIZES,
    E2E_UPDATES,
    E2E_WARMUP,
    SEED,
    _free_port,
    _med,
    _p90,
    _ServeProc,
    _wait_ready,
    e2e_layout,
)

COUNTERS = ("aggsrv_received_bytes_total", "aggsrv_sent_bytes_total")


def _counters(port: int) -> dict[str, float]:
    """The byte counters of one shard's metrics endpoint (summed over their labels)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out = dict.fromkeys(COUNTERS, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in out:
                out[sample.name] += sample.value
    return out


@pytest.mark.parametrize("size", list(E2E_SIZES))
def test_bench_shard_relay(benchmark: Any, size: str, tmp_path: Path) -> None:
    from aggsrv.client.client import Client
    from aggsrv.strategies import Status

    layout = e2e_layout(scaled(E2E_SIZES[size]))
    D = layout.numel
    initial = random_tensor(D, seed=SEED)
    delta = random_tensor(D, seed=SEED + 1).mul_(1e-3)
    settings = tmp_path / "serve.toml"
    settings.write_text('rate_limit_per_second = 0.0\ndurability = "off"\n'
                        "[strategy_config]\nalpha = 0.6\n")  # fmt: skip
    url = f"tcp://127.0.0.1:{_free_port()}"
    metrics = [_free_port(), _free_port()]
    procs: list[_ServeProc] = []
    clients: dict[str, Any] = {}
    try:
        for r in range(2):
            args = ["--strategy", "fedasync", "--config", str(settings), "--shards", "2"]
            args += ["--rank", str(r), "--dist-url", url, "--metrics-port", str(metrics[r])]
            procs.append(_ServeProc(tmp_path / f"shard{r}.log", _free_port(), *args))
        ready_s = _wait_ready(procs)
        for cand, direct in (("direct", True), ("relay", False)):
            c = Client(procs[0].address, cand, timeout=60.0, retries=0, direct_to_shards=direct)
            clients[cand] = c
            c.register(layout=layout, initial=initial)
        assert clients["direct"].shard_map is not None and clients["relay"].shard_map is None
        own = clients["direct"].shard_map.local_numel(0)

        def one_round(cand: str) -> tuple[float, float, dict[str, float]]:
            c = clients[cand]
            before = [_counters(p) for p in metrics]
            t0 = time.perf_counter()
            job = c.get_job()
            t1 = time.perf_counter()
            middle = [_counters(p) for p in metrics]
            t2 = time.perf_counter()
            res = c.push(job, delta, num_samples=10)
            t3 = time.perf_counter()
            after = [_counters(p) for p in metrics]
            assert res.status is Status.APPLIED, (cand, res)
            assert job.weights.numel() == D
            rx, tx = COUNTERS

            def moved(r: int, name: str, a: list, b: list) -> float:
                return b[r][name] - a[r][name]

            relayed = cand == "relay"
            nbytes = {
                "push_in": moved(0, rx, middle, after),
                "push_out": moved(1, rx, middle, after) if relayed else 0.0,
                "job_out": moved(0, tx, before, middle),
                "job_in": moved(1, tx, before, middle) if relayed else 0.0,
            }
            return t1 - t0, t3 - t2, nbytes

        def run() -> dict[str, list]:
            times: dict[str, list] = {"direct": [], "relay": []}
            for i in range(E2E_WARMUP + E2E_UPDATES):
                for cand in ("direct", "relay") if i % 2 == 0 else ("relay", "direct"):
                    t = one_round(cand)
                    if i >= E2E_WARMUP:
                        times[cand].append(t)
            return times

        times = benchmark.pedantic(run, rounds=1, iterations=1)
        total = 2 * (E2E_WARMUP + E2E_UPDATES)
        version, model = clients["direct"].get_model()
        version_relay, model_relay = clients["relay"].get_model()
        assert version == version_relay == total, (version, version_relay)
        assert model.equal(model_relay)
    finally:
        for c in clients.values():
            c.close()
        for p in reversed(procs):
            p.close()

    nbytes = 4 * D
    info: dict[str, Any] = {"scale": SCALE, "D": D, "update_bytes": nbytes, "shards": 2,
                            "rank0_slice": own, "updates": E2E_UPDATES, "warmup": E2E_WARMUP,
                            "ready_s": ready_s}  # fmt: skip
    parts = [
        f"shard relay fedasync D={fmt_size(D)} ({nbytes / 1e6:.1f} MB, 6 tensors), 2 shard "
        f"processes (rank 0's slice {own}), direct to both shards vs through rank 0, "
        f"{E2E_UPDATES} rounds each after {E2E_WARMUP} warm-up, interleaved:"
    ]
    for k, call in ((1, "push"), (0, "get_job")):
        xs = {c: [t[k] for t in times[c]] for c in times}
        m1, m2 = _med(xs["direct"]), _med(xs["relay"])
        q1, q2 = _p90(xs["direct"]), _p90(xs["relay"])
        per_round = _med([b - a for a, b in zip(xs["direct"], xs["relay"], strict=True)])
        parts.append(
            f"  {call}: direct p50 {fmt_time(m1)} p90 {fmt_time(q1)} ({nbytes / m1 / 1e9:.2f} "
            f"GB/s), relayed p50 {fmt_time(m2)} p90 {fmt_time(q2)} ({nbytes / m2 / 1e9:.2f} "
            f"GB/s); relayed - direct {(m2 - m1) * 1e3:+.2f} ms (median per-round difference "
            f"{per_round * 1e3:+.2f} ms)"
        )
        info.update({
            f"{call}_direct_p50_s": m1, f"{call}_direct_p90_s": q1, f"{call}_relay_p50_s": m2,
            f"{call}_relay_p90_s": q2, f"{call}_diff_per_round_s": per_round,
            f"{call}_direct_GBps": nbytes / m1 / 1e9, f"{call}_relay_GBps": nbytes / m2 / 1e9,
        })  # fmt: skip
    for cand in ("direct", "relay"):
        b = {k: _med([t[2][k] for t in times[cand]]) for k in times[cand][0][2]}
        parts.append(
            f"  bytes through rank 0 per update ({cand}): push in {b['push_in'] / 1e6:.2f} MB, "
            f"out {b['push_out'] / 1e6:.2f} MB; get_job out {b['job_out'] / 1e6:.2f} MB, in "
            f"{b['job_in'] / 1e6:.2f} MB; total {sum(b.values()) / 1e6:.2f} MB "
            f"(= {sum(b.values()) / nbytes:.2f} x 4D)"
        )
        info.update({f"{cand}_{k}_bytes": v for k, v in b.items()})
    parts.append(
        f"  start-up {ready_s:.1f} s; both clients' models equal at version {total}; NOT a "
        "network measurement: client, shards and relay share this machine's cores (loopback)"
    )
    emit(benchmark, "\n".join(parts), info)
