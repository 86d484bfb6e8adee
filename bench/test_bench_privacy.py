"""What differential privacy costs (docs/privacy.md).

Run: `pytest bench/test_bench_privacy.py --benchmark-only -s` (about a minute, ~2 GiB RAM);
`AGGSRV_BENCH_SCALE=0.01` for a smoke run.

- `test_bench_ingest_with_clipping`: one client pushes the same D = 16M float32 delta (64 MB,
  1 MiB chunks) to two FedBuff servers, rounds interleaved: one plain, one with
  `dp_clip_norm` set so small that every update is clipped (its norm is summed in float64 in the
  NaN/Inf pass; the clip factor goes into the accumulate's weight). The buffer is larger than the
  run, so every push is the same work: receive, check, accumulate, BUFFERED; no release, no
  noise. Three fresh server pairs, created in alternating order: on this VM a server whose
  tensors sat idle while the other worked can stay slow for its whole life (either one, with
  DP or without), so one pair is not a measurement. Target: clipping on within 1.05x the time
  with it off (the median over the pairs).
- `test_bench_noise_per_version`: drawing one version's noise, N(0, (z C)^2) for D = 16M
  float32 (what every published version costs under DP, beside its usual step), against the
  floor of writing D floats (`fill_`), interleaved; effective GB/s of the 64 MB written.

Targets are shown, never asserted (shared 2-core machine).
"""

from __future__ import annotations

import numpy as np
import torch
from conftest import REPS, SCALE, emit, fmt_size, median_ratio, scaled
from ingest_helpers import AggsrvServer, interleaved_prepared, layered_layout

from aggsrv.client.client import Client, ClientJob
from aggsrv.strategies.base import Status, UpdateKind

MB = 1e6
D_INGEST = scaled(16 * 2**20)


PAIRS = 3  # fresh server pairs: a server whose idle tensors the VM reclaimed stays slow


def _pair_times(layout, initial, delta, configs, order) -> tuple[dict[str, list[float]], int, list]:
    """Interleaved pushes to a fresh server per config (created in ``order``): per config the
    push times, the DP server's clip count, and the outcomes."""
    servers = {name: AggsrvServer(strategy="fedbuff", strategy_config=configs[name])
               for name in order}  # fmt: skip
    clients = {name: Client(srv.address, f"ingest-{name}") for name, srv in servers.items()}
    outcomes: list[Status] = []
    try:
        for client in clients.values():
            assert client.register(layout=layout, initial=initial).initial_model_adopted

        def pusher(name: str):
            client = clients[name]

            def push(job: ClientJob) -> None:
                outcomes.append(client.push(job, delta, kind=UpdateKind.DELTA).status)

            return client.get_job, push

        times = interleaved_prepared({name: pusher(name) for name in sorted(servers)}, REPS)
        clipped = servers["clip"].server.federation.strategy.privacy.clipped
    finally:
        for client in clients.values():
            client.close()
        for srv in servers.values():
            srv.stop()
    return times, clipped, outcomes


def test_bench_ingest_with_clipping(benchmark) -> None:
    D = D_INGEST
    layout = layered_layout(D)
    nbytes = D * 4
    initial = torch.randn(D)
    delta = torch.randn(D) * 1e-3
    norm = float(torch.linalg.vector_norm(delta, dtype=torch.float64))
    plain = {"buffer_size": 1_000_000}
    private = {**plain, "dp_clip_norm": norm / 2, "dp_noise_multiplier": 1.0}
    configs = {"off": plain, "clip": private}
    ratios, medians, all_times = [], [], []
    for k in range(PAIRS):
        order = ["off", "clip"] if k % 2 == 0 else ["clip", "off"]
        times, clipped, outcomes = _pair_times(layout, initial, delta, configs, order)
        assert all(s is Status.BUFFERED for s in outcomes), outcomes
        assert clipped == REPS + 1  # every push to the DP server was clipped
        ratios.append(median_ratio(times["clip"], times["off"]))
        medians.append({n: float(np.median(v)) for n, v in times.items()})
        all_times.append(times)
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)
    ratio = float(np.median(ratios))
    ok = ratio <= 1.05
    info = {
        "scale": SCALE, "rounds": REPS, "pairs": PAIRS, "D": D, "bytes": nbytes,
        "pair_ratios": ratios, "pair_medians_s": medians, "times_s": all_times,
        "clip_vs_off": ratio, "target_met": ok,
    }  # fmt: skip
    pairs = ", ".join(
        f"{m['off'] * 1e3:.0f}/{m['clip'] * 1e3:.0f} ms ({r:.2f}x)"
        for m, r in zip(medians, ratios, strict=True)
    )
    line = (
        f"ingest fedbuff D={fmt_size(D)} ({nbytes / MB:.0f} MB), clipping off/on per server "
        f"pair: {pairs} -> median {ratio:.3f}x  [<=1.05x {'ok' if ok else 'MISSED'}]"
    )
    emit(benchmark, line, info)


def test_bench_noise_per_version(benchmark) -> None:
    from aggsrv.strategies.privacy import GaussianPrivacy, PrivacyConfig

    D = D_INGEST
    nbytes = D * 4
    privacy = GaussianPrivacy(
        PrivacyConfig(dp_clip_norm=1.0, dp_noise_multiplier=1.1), D, torch.device("cpu")
    )
    floor = torch.empty(D)

    def noise(_: object) -> None:
        privacy.noise()

    def fill(_: object) -> None:
        floor.fill_(1.0)

    times = interleaved_prepared({"noise": (None, noise), "fill": (None, fill)}, REPS)
    benchmark.pedantic(lambda: privacy.noise(), rounds=1, iterations=1)
    drawn = privacy.noise()
    assert abs(float(drawn.std()) - 1.1) < 0.01 * 1.1 + 5 / D**0.5
    med = {n: float(np.median(v)) for n, v in times.items()}
    ratio = median_ratio(times["noise"], times["fill"])
    info = {
        "scale": SCALE, "D": D, "bytes": nbytes, "threads": torch.get_num_threads(),
        **{f"{n}_s": t for n, t in med.items()}, **{f"{n}_times_s": v for n, v in times.items()},
        "noise_vs_fill": ratio,
    }  # fmt: skip
    line = (
        f"DP noise per version D={fmt_size(D)} ({nbytes / MB:.0f} MB float32, "
        f"{torch.get_num_threads()} threads): {med['noise'] * 1e3:.1f} ms "
        f"({nbytes / 1e9 / med['noise']:.2f} GB/s written) against the write floor "
        f"{med['fill'] * 1e3:.1f} ms ({nbytes / 1e9 / med['fill']:.2f} GB/s): {ratio:.1f}x"
    )
    emit(benchmark, line, info)
