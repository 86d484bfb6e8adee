"""Differential privacy against Flower's own: sync FedAvg with the dp_ keys through the Flower
adapter, and Flower's DifferentialPrivacyServerSideFixedClipping around Flower's FedAvg, given
the same updates and the same noise draws, publish the same models; and the adapter's epsilon
for those rounds is what dp-accounting computes directly for the same noise multiplier."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

flwr = pytest.importorskip("flwr")
dpa = pytest.importorskip("dp_accounting", reason="the dp extra (pip install 'aggsrv[dp]')")

from flower_helpers import NodeGrid, VirtualClock, initial_record, train_reply  # noqa: E402
from flwr.app import ConfigRecord  # noqa: E402
from flwr.common import (  # noqa: E402
    Code,
    FitRes,
    Status,
    ndarrays_to_parameters,
    parameters_to_ndarrays,
)
from flwr.server.strategy import (  # noqa: E402
    DifferentialPrivacyServerSideFixedClipping,
    FedAvg,
)

from aggsrv.integrations.flower.arrays import layout_of, record_to_flat  # noqa: E402
from aggsrv.integrations.flower.strategy import AggsrvStrategy  # noqa: E402
from aggsrv.strategies.dp_noise import NoiseKey, draw_values  # noqa: E402

pytestmark = pytest.mark.usefixtures("flower_identity")


class SameNoise:
    """Stands in for numpy's normal() inside Flower's noise function: hands out, array by
    array, the draw aggsrv's generator makes for the round (N(0, (z C)^2) on the sum), divided
    by the number of clients as Flower's std (z C / n) says."""

    def __init__(self, seed: int, std: float, clients: int, dim: int) -> None:
        self.key = NoiseKey.insecure(seed)
        self.rounds = 0
        self.std, self.clients, self.dim = std, clients, dim
        self.flat: np.ndarray | None = None
        self.used = 0

    def next_round(self) -> None:
        draw = draw_values(self.key, 0, self.rounds, self.dim, self.std)
        self.rounds += 1
        self.flat = draw / self.clients
        self.used = 0

    def __call__(self, loc, scale, size):
        assert loc == 0 and scale == pytest.approx(self.std / self.clients, rel=1e-12)
        n = int(np.prod(size))
        part = self.flat[self.used : self.used + n].reshape(size)
        self.used += n
        return part


def test_sync_fedavg_with_dp_equals_flowers_fixed_clipping(monkeypatch) -> None:
    seed = random.randrange(1 << 30)
    nodes, rounds, C, z = [3, 5, 8, 13], 4, 0.6, 0.9
    keys = {"mode": "sync", "min_clients": len(nodes), "round_timeout": None,
            "dp_clip_norm": C, "dp_noise_multiplier": z, "dp_seed": seed,
            "dp_insecure_seed": True, "dp_accountant": "rdp"}  # fmt: skip
    clock = VirtualClock()
    adapter = AggsrvStrategy("fedavg", keys, clock=clock, seed=seed)
    initial = initial_record(seed)
    layout = layout_of(initial)
    adapter.adopt(initial)
    names = list(layout.names)
    theirs = [initial[name].numpy().copy() for name in names]
    flower = DifferentialPrivacyServerSideFixedClipping(
        FedAvg(), noise_multiplier=z, clipping_norm=C, num_sampled_clients=len(nodes)
    )
    noise = SameNoise(seed, z * C, len(nodes), layout.numel)
    monkeypatch.setattr("flwr.supercore.differential_privacy.np.random.normal", noise)
    gen = torch.Generator().manual_seed(seed)
    arrays = initial
    for server_round in range(1, rounds + 1):
        clock.now = 100.0 * server_round
        messages = list(adapter.configure_train(server_round, arrays, ConfigRecord(),
                                                NodeGrid(nodes)))  # fmt: skip
        assert len(messages) == len(nodes)
        replies, results = [], []
        for i, msg in enumerate(messages):
            start = record_to_flat(msg.content["arrays"], layout)
            # Norms around C: some clipped, some not (and num-examples differ, which DP ignores
            # in aggsrv; Flower's FedAvg weighs by it, so Flower gets them equal).
            delta = torch.randn(layout.numel, generator=gen) * (0.01 if i == 0 else 0.1)
            final = start + delta
            replies.append(train_reply(msg, final, layout, 10 + i))
            finals = [a.copy() for a in _split(final, layout)]
            results.append((None, FitRes(Status(Code.OK, ""), ndarrays_to_parameters(finals),
                                         10, {})))  # fmt: skip
        clock.now += 30.0
        arrays, _ = adapter.aggregate_train(server_round, replies)
        flower.current_round_params = [a.copy() for a in theirs]
        noise.next_round()
        params, _ = flower.aggregate_fit(server_round, results, [])
        assert noise.used == layout.numel  # Flower drew noise for every element once
        theirs = parameters_to_ndarrays(params)
        ours = record_to_flat(arrays, layout).numpy()
        flat_theirs = np.concatenate([a.reshape(-1) for a in theirs])
        np.testing.assert_allclose(ours, flat_theirs, rtol=0, atol=2e-6,
                                   err_msg=f"seed {seed}, round {server_round}")  # fmt: skip
    assert adapter.strategy.version == rounds
    direct = dpa.rdp.RdpAccountant()
    direct.compose(dpa.GaussianDpEvent(z), rounds)
    epsilon = adapter.strategy.privacy.accountant.epsilon()
    assert epsilon == pytest.approx(direct.get_epsilon(1e-5), rel=1e-9)


def _split(flat: torch.Tensor, layout) -> list[np.ndarray]:
    """The flat vector as the model's arrays, in layout order (Flower's parameter list)."""
    out, at = [], 0
    for shape in layout.shapes:
        n = int(np.prod(shape))
        out.append(flat[at : at + n].reshape(shape).numpy().astype(np.float32))
        at += n
    return out
