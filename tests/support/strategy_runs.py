"""Every strategy driven in-process by a few clients: registrations, job requests (some while a
job is outstanding, some that get none), updates with float buffers, replays, deadlines. Shared
by the tests of the strategies' state and change signals (tests/ is not a package: import as
`from strategy_runs import StrategyRun`)."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable

import torch
from strategy_cases import strategy_cases

from aggsrv.layout import ModelLayout
from aggsrv.strategies import Job, Strategy, StrategyError, Update, UpdateKind, make_strategy

CLIENTS = 5


def run_layout() -> ModelLayout:
    """Odd sizes and BatchNorm statistics, so float buffers travel with every job and update."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(7, 5), torch.nn.BatchNorm1d(5), torch.nn.ReLU(), torch.nn.Linear(5, 3)
    )
    return ModelLayout.from_module(model)


class StrategyRun:
    """One strategy and its clients; ``step()`` makes one random call at the advancing time."""

    def __init__(self, name: str, seed: int, clients: int = CLIENTS, **overrides) -> None:
        self.name = name
        self.rng = random.Random(seed)
        self.gen = torch.Generator().manual_seed(seed)
        self.layout = run_layout()
        config = {**strategy_cases(clients)[name], **overrides}
        self.strategy: Strategy = make_strategy(
            name,
            layout=self.layout,
            initial=torch.randn(self.layout.numel, generator=self.gen),
            initial_buffers=torch.rand(self.layout.buffer_numel, generator=self.gen) + 0.5,
            config=config,
        )
        self.clients = [f"c{i}" for i in range(clients)]
        self.registered: list[str] = []
        self.held: dict[str, Job] = {}
        self.sent: list[Update] = []
        self.now = 0.0
        self.n = 0

    def register_next(self) -> None:
        cid = self.clients[len(self.registered)]
        self.strategy.on_register(cid, self.now)
        self.registered.append(cid)

    def job_for(self, cid: str) -> Job | None:
        job = self.strategy.job_for(cid, self.now)
        if job is not None:
            self.held[cid] = job
        return job

    def update_for(self, job: Job) -> Update:
        """A DELTA (or WEIGHTS) update with fresh random values and valid float buffers."""
        self.n += 1
        delta = torch.randn(self.layout.numel, generator=self.gen) * 0.05
        kind = UpdateKind.DELTA if self.rng.random() < 0.7 else UpdateKind.WEIGHTS
        tensor = delta if kind is UpdateKind.DELTA else job.weights + delta
        buffers = job.tensors["buffers"] + torch.rand(self.layout.buffer_numel, generator=self.gen)
        return Update(
            client_id=job.client_id, job_id=job.job_id, base_version=job.base_version,
            update_id=f"u{self.n}", num_samples=self.rng.randrange(1, 40),
            work_done=job.recipe.work_target, kind=kind, tensor=tensor, buffers=buffers,
        )  # fmt: skip

    def step(self, on_job: Callable[[str], None] | None = None) -> None:
        """One call: a registration, a job request (``on_job`` makes it instead when given), an
        update (or a replay of an old one), or time passing to the next deadline."""
        s = self.strategy
        r = self.rng.random()
        self.now += self.rng.uniform(0.0, 0.2)
        if len(self.registered) < len(self.clients) and (r < 0.15 or not self.registered):
            self.register_next()
            return
        if r < 0.55:
            cid = self.rng.choice(self.registered)
            (on_job or self.job_for)(cid)
            return
        if r < 0.85 and self.held:
            cid = self.rng.choice(sorted(self.held))
            job = self.held.pop(cid)
            upd = self.update_for(job)
            self.sent.append(upd)
            with contextlib.suppress(StrategyError):  # superseded or closed: the client drops it
                s.on_update(upd, self.now)
            return
        if r < 0.92 and self.sent:
            with contextlib.suppress(StrategyError):
                s.on_update(self.rng.choice(self.sent), self.now)  # a replay: DUPLICATE
            return
        deadline = s.next_deadline()
        if deadline is not None:
            self.now = max(self.now, deadline)
            s.on_timer(self.now)
