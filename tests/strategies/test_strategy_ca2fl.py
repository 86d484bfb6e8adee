"""CA2FL against a hand-computed trace, a float64 oracle and FedBuff (its zero-cache case)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from state_helpers import assert_same_state as _same

from aggsrv.layout import ModelLayout
from aggsrv.strategies.ca2fl import CA2FL, CA2FLConfig
from aggsrv.strategies.fedbuff import FedBuff
from aggsrv.strategies.job import Job
from aggsrv.values import Status, Update, UpdateKind

F64 = torch.float64
TINY = ModelLayout.from_named_shapes([("w", (3,))])
LAYOUT = ModelLayout.from_named_shapes([("fc.weight", (4, 7)), ("fc.bias", (4,)), ("out", (5,))])
D = LAYOUT.numel


_uid = iter(range(10**9))


def update(
    job: Job, delta: torch.Tensor, kind: UpdateKind = UpdateKind.DELTA, uid: str | None = None
) -> Update:
    tensor = delta.clone() if kind is UpdateKind.DELTA else job.weights + delta
    return Update(
        client_id=job.client_id,
        job_id=job.job_id,
        base_version=job.base_version,
        update_id=uid or f"u{next(_uid)}",
        num_samples=10,
        work_done=job.recipe.work_target,
        kind=kind,
        tensor=tensor,
    )


def t32(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def test_hand_trace() -> None:
    """K = 2, N = 3, server_lr = 1; every value exact in float32."""
    s = CA2FL(layout=TINY, initial=t32(1, 2, 3), config={"buffer_size": 2})
    for c in "ABC":
        s.on_register(c, 0.0)

    def send(c: str, delta: torch.Tensor, kind: UpdateKind = UpdateKind.DELTA):
        return s.on_update(update(s.job_for(c, 0.0), delta, kind), 0.0)

    # Buffer 1, empty cache: v = mean of the deltas = [1.5, 3, 0].
    assert send("A", t32(3, 0, 3)).status is Status.BUFFERED
    out = send("B", t32(0, 6, -3), UpdateKind.WEIGHTS)
    assert (out.status, out.version) == (Status.APPLIED, 1)
    assert torch.equal(s.global_model(), t32(2.5, 5, 3))
    # Buffer 2: h_bar = ([3,0,3] + [0,6,-3] + 0) / 3 = [1,2,0]; corrections C: [6,3,0] - 0,
    # A: [0,3,6] - [3,0,3] = [-3,3,3]; v = [1,2,0] + [3,6,3]/2 = [2.5,5,1.5].
    assert send("C", t32(6, 3, 0)).status is Status.BUFFERED
    assert send("A", t32(0, 3, 6)).version == 2
    assert torch.equal(s.global_model(), t32(5, 10, 4.5))
    assert torch.equal(s.cached_update("A"), t32(0, 3, 6))
    # Buffer 3, A twice: h_bar = ([0,3,6] + [0,6,-3] + [6,3,0]) / 3 = [2,4,1]; A: [3,3,3] -
    # [0,3,6] = [3,0,-3], then [6,0,0] - [3,3,3] = [3,-3,-3]; v = [2,4,1] + [6,-3,-6]/2.
    send("A", t32(3, 3, 3))
    send("A", t32(6, 0, 0))
    assert torch.equal(s.global_model(), t32(10, 12.5, 2.5))
    assert torch.equal(s.cached_update("A"), t32(6, 0, 0))
    assert torch.equal(s.cached_update("B"), t32(0, 6, -3))


def test_first_buffer_is_fedbuff(gen: torch.Generator) -> None:
    init = torch.randn(D, generator=gen)
    ca = CA2FL(layout=LAYOUT, initial=init, config={"buffer_size": 3, "server_lr": 0.7})
    fb = FedBuff(layout=LAYOUT, initial=init, config={"buffer_size": 3, "server_lr": 0.7})
    for c in "ABC":
        ca.on_register(c, 0.0)
        fb.on_register(c, 0.0)
    for c in "ABC":
        d = torch.randn(D, generator=gen)
        ca.on_update(update(ca.job_for(c, 0.0), d), 0.0)
        fb.on_update(update(fb.job_for(c, 0.0), d), 0.0)
    assert ca.version == fb.version == 1
    assert torch.equal(ca.global_model(), fb.global_model())


class Oracle:
    """CA2FL's Algorithm 1 in float64: v = h_bar(start) + (1/K) sum (delta_i - h_i)."""

    def __init__(self, init: torch.Tensor, k: int, lr: float, n: int) -> None:
        self.x = init.to(F64).clone()
        self.k, self.lr, self.n = k, lr, n
        self.h: dict[str, torch.Tensor] = {}
        self.buf: list[torch.Tensor] = []
        self.hbar = torch.zeros_like(self.x)

    def arrive(self, c: str, delta: torch.Tensor) -> None:
        d = delta.to(F64)
        if not self.buf:
            self.hbar = sum(self.h.values(), torch.zeros_like(self.x)) / self.n
        self.buf.append(d - self.h.get(c, torch.zeros_like(self.x)))
        self.h[c] = d
        if len(self.buf) == self.k:
            v = self.hbar + sum(self.buf, torch.zeros_like(self.x)) / self.k
            self.x = self.x + self.lr * v
            self.buf = []


def test_random_trace_matches_oracle(gen: torch.Generator) -> None:
    """Four clients, K = 3, random order with repeats, WEIGHTS and DELTA updates."""
    init = torch.randn(D, generator=gen)
    s = CA2FL(layout=LAYOUT, initial=init, config={"buffer_size": 3, "server_lr": 0.5})
    o = Oracle(init, 3, 0.5, 4)
    clients = ["a", "b", "c", "d"]
    for c in clients:
        s.on_register(c, 0.0)
    for step in range(31):
        c = clients[int(torch.randint(4, (1,), generator=gen))]
        d = torch.randn(D, generator=gen)
        kind = UpdateKind.WEIGHTS if step % 2 else UpdateKind.DELTA
        out = s.on_update(update(s.job_for(c, 0.0), d, kind), float(step))
        o.arrive(c, d)
        assert out.status is (Status.APPLIED if not o.buf else Status.BUFFERED)
        torch.testing.assert_close(s.global_model().to(F64), o.x, rtol=1e-5, atol=1e-5)
    assert s.buffered == len(o.buf) == 1


def _drive(s: CA2FL, g: torch.Generator, steps: int, start: int = 0) -> None:
    for i in range(start, start + steps):
        c = "abc"[i % 3]
        job = s.outstanding_job(c) or s.job_for(c, 0.0)
        s.on_update(update(job, torch.randn(D, generator=g), uid=f"{c}-{i}"), float(i))


def test_state_dict_resumes_bit_exactly_mid_buffer(gen: torch.Generator) -> None:
    init = torch.randn(D, generator=gen)
    s = CA2FL(layout=LAYOUT, initial=init, config={"buffer_size": 4})
    for c in "abc":
        s.on_register(c, 0.0)
    _drive(s, gen, 6)
    assert s.buffered == 2
    state = s.state_dict()
    r = CA2FL(layout=LAYOUT, initial=torch.zeros(D), config={"buffer_size": 4})
    r.load_state_dict(state)
    _same(r.state_dict(), state)
    seed = int(torch.randint(2**31, (1,), generator=gen))
    _drive(s, torch.Generator().manual_seed(seed), 9, 6)
    _drive(r, torch.Generator().manual_seed(seed), 9, 6)
    _same(r.state_dict(), s.state_dict())
    assert s.version == 3


def test_config_checks() -> None:
    assert (CA2FLConfig().buffer_size, CA2FLConfig().server_lr) == (5, 1.0)
    for bad in ({"buffer_size": 0}, {"server_lr": 0.0}):
        with pytest.raises(ValueError):
            CA2FLConfig.from_dict(bad)


def test_cache_grows_past_a_block(gen: torch.Generator) -> None:
    s = CA2FL(layout=TINY, initial=t32(0, 1, 2), config={"buffer_size": 7}, max_clients=20)
    deltas = {}
    for i in range(11):
        c = f"c{i}"
        s.on_register(c, 0.0)
        deltas[c] = torch.randn(3, generator=gen)
        s.on_update(update(s.job_for(c, 0.0), deltas[c]), 0.0)
    for c, d in deltas.items():
        assert torch.equal(s.cached_update(c), d)


def test_simulated_run_learns_digits(tmp_path: Path) -> None:
    from aggsrv.sim import run

    result = run(
        {
            "strategy": "aggsrv.strategies.ca2fl:CA2FL",
            "strategy_config": {"buffer_size": 3, "learning_rate": 0.05, "batch_size": 16},
            "dataset": "digits",
            "clients": 5,
            "model": "mlp",
            "transport": "inproc",
            "budget": "8s",
            "seed": 3,
            "out": str(tmp_path),
        },
        progress=False,
    )
    assert result.summary["updates_applied"] > 10 and result.summary["updates_rejected"] == 0
    assert result.final_accuracy > 0.6, result.final_accuracy  # chance is 0.1
