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
- `test_bench_noise_per_version`: drawing one version's noise, N(0, (z C)^2) for D = 4M and
  25M (what every published version costs under DP, beside its usual step) from the secure
  sampler (AES-CTR stream, ziggurat, two draws per value, float64), against torch's
  `normal_` on the same D (float32 from 24-bit uniforms) and one pass over the model (read D
  floats, write D), interleaved.

Targets are shown, never asserted (shared 2-core machine).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import REPS, SCALE, emit, fmt_size, median_ratio, scaled
from ingest_helpers import AggsrvServer, interleaved_prepared, layered_layout

from aggsrv.client.client import Client, ClientJob
from aggsrv.values import Status, UpdateKind

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


@pytest.mark.parametrize("D", [scaled(4_000_000), scaled(25_000_000)], ids=["4M", "25M"])
def test_bench_noise_per_version(benchmark, D: int) -> None:
    from aggsrv.strategies.privacy import GaussianPrivacy, PrivacyConfig

    privacy = GaussianPrivacy(
        PrivacyConfig(dp_clip_norm=1.0, dp_noise_multiplier=1.1), D, torch.device("cpu")
    )
    torch_noise = torch.empty(D)
    gen = torch.Generator().manual_seed(1)
    model, floor = torch.randn(D), torch.empty(D)

    def secure(_: object) -> None:
        privacy.noise()

    def torch_randn(_: object) -> None:  # the noise before: float32, 24-bit uniforms
        torch_noise.normal_(0.0, 1.1, generator=gen)

    def one_pass(_: object) -> None:  # one pass over the model: read D floats, write D
        torch.mul(model, 1.0001, out=floor)

    cands = {"secure": (None, secure), "torch": (None, torch_randn), "pass": (None, one_pass)}
    times = interleaved_prepared(cands, REPS)
    benchmark.pedantic(lambda: privacy.noise(), rounds=1, iterations=1)
    drawn = privacy.noise()
    assert abs(float(drawn.std()) - 1.1) < 0.01 * 1.1 + 5 / D**0.5
    med = {n: float(np.median(v)) for n, v in times.items()}
    vs_torch = median_ratio(times["secure"], times["torch"])
    vs_pass = median_ratio(times["secure"], times["pass"])
    info = {
        "scale": SCALE, "D": D, "threads": torch.get_num_threads(),
        **{f"{n}_s": t for n, t in med.items()}, **{f"{n}_times_s": v for n, v in times.items()},
        "secure_vs_torch": vs_torch, "secure_vs_pass": vs_pass,
    }  # fmt: skip
    line = (
        f"DP noise per version D={fmt_size(D)}: secure {med['secure'] * 1e3:.1f} ms "
        f"({D / 1e9 / med['secure']:.2f} G values/s), torch.normal_ "
        f"{med['torch'] * 1e3:.1f} ms, one pass over the model {med['pass'] * 1e3:.1f} ms "
        f"({8 * D / 1e9 / med['pass']:.1f} GB/s): secure/torch {vs_torch:.2f}x, "
        f"secure/pass {vs_pass:.1f}x"
    )
    emit(benchmark, line, info)
