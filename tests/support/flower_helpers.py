"""Helpers shared by the Flower adapter test modules (tests/ is not a package: import as
`from flower_helpers import ...`): the 4-tensor test model, a virtual-clock Grid of client nodes
for `run_async`, Flower rounds driven through `AggsrvStrategy`, and a real `aggsrv serve` with
one gRPC client per node that replays the jobs, updates and timers an adapter run saw, in the
same order (:func:`rounds_parity`, :func:`replay`)."""

from __future__ import annotations

import random
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
import torch
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Error,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from server_helpers import RunningServer

from aggsrv.client.client import Client, ClientJob, PushResult
from aggsrv.integrations.flower.arrays import flat_to_record, layout_of, record_to_flat
from aggsrv.integrations.flower.async_loop import REFUSED
from aggsrv.integrations.flower.strategy import BASE_VERSION, JOB_ID, AggsrvStrategy
from aggsrv.layout import ModelLayout
from aggsrv.values import UpdateKind


def model_state(gen: torch.Generator) -> dict[str, torch.Tensor]:
    """The test model's four tensors, of odd sizes: D = 108 + 4 + 180 + 5 = 297."""
    return {
        "conv.weight": torch.randn(4, 3, 3, 3, generator=gen),
        "conv.bias": torch.randn(4, generator=gen),
        "fc.weight": torch.randn(5, 36, generator=gen),
        "fc.bias": torch.randn(5, generator=gen),
    }


def initial_record(seed: int) -> ArrayRecord:
    """The test model's initial weights as Flower's record, drawn from ``seed``."""
    return ArrayRecord(torch_state_dict=model_state(torch.Generator().manual_seed(seed)))


def job_extras(msg: Message, layout: ModelLayout) -> dict[str, torch.Tensor]:
    """The job tensors beyond the weights that a TRAIN message carries (``aggsrv.<name>``
    records: Fed-OGD's basis), flat."""
    return {
        key.removeprefix("aggsrv."): record_to_flat(record, layout)
        for key, record in msg.content.array_records.items()
        if key.startswith("aggsrv.")
    }


def train_reply(msg: Message, final: torch.Tensor, layout: ModelLayout, n: int) -> Message:
    """A ClientApp's reply to a TRAIN message: the final weights and the sample count."""
    content = RecordDict(
        {"arrays": flat_to_record(final, layout), "metrics": MetricRecord({"num-examples": n})}
    )
    return Message(content, reply_to=msg)


class NodeGrid:
    """The part of Flower's Grid a strategy's configure_* calls use: the connected nodes."""

    def __init__(self, nodes: Iterable[int]) -> None:
        self.nodes = list(nodes)

    def get_node_ids(self) -> list[int]:
        return list(self.nodes)


@dataclass
class Push:
    time: float
    node: int
    job_id: int
    base_version: int
    weights: torch.Tensor
    extras: dict[str, torch.Tensor]


@dataclass
class Reply:
    time: float
    node: int
    job_id: int
    final: torch.Tensor
    n: int


@dataclass
class Timer:
    """The aggsrv strategy's ``on_timer`` ran at ``time`` (see :func:`log_timers`)."""

    time: float


def log_timers(strategy: Any, log: list, monkeypatch: Any) -> None:
    """Record every ``on_timer(now)`` call of ``strategy`` in ``log`` (a FakeGrid's), in order
    with the pushes and replies, so a replay can fire the server's timer at the same point."""
    on_timer = strategy.on_timer

    def logged(now: float) -> None:
        log.append(Timer(now))
        on_timer(now)

    monkeypatch.setattr(strategy, "on_timer", logged)


class VirtualClock:
    """A clock that moves only when a test sets ``now`` (seconds)."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class FakeGrid:
    """Client nodes with per-node delays on a virtual clock (seconds; `sleep` advances it).

    Each TRAIN message is answered after its node's delay (times 1 to 1.2, seeded) with the
    message's weights plus a seeded random delta. A node with delay `math.inf` never replies;
    nodes in `errors` answer with an error; nodes in `joins` connect at the given time. `log`
    records pushes and delivered replies in order.
    """

    def __init__(
        self,
        delays: dict[int, float],
        layout: ModelLayout,
        seed: int,
        joins: dict[int, float] | None = None,
        errors: frozenset[int] = frozenset(),
    ) -> None:
        self.delays = delays
        self.layout = layout
        self.joins = joins or {}
        self.errors = errors
        self.now = 0.0
        self.gen = torch.Generator().manual_seed(seed)
        self.rng = random.Random(seed)
        self.pending: dict[str, tuple[float, int, Message, Reply | None]] = {}
        self.log: list[Push | Reply] = []
        self.count = 0

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds >= 0
        self.now += seconds

    def get_node_ids(self) -> list[int]:
        return [n for n in self.delays if self.joins.get(n, 0.0) <= self.now]

    def push_messages(self, messages) -> list[str]:
        ids = []
        for msg in messages:
            assert msg.metadata.message_type == MessageType.TRAIN
            message_id = f"m{self.count}"
            self.count += 1
            msg.metadata.__dict__["_message_id"] = message_id  # as Flower's grids do
            node = msg.metadata.dst_node_id
            config = msg.content["config"]
            job_id = int(config[JOB_ID])
            base = record_to_flat(msg.content["arrays"], self.layout)
            assert config["server-round"] == int(config[BASE_VERSION]) + 1
            extras = job_extras(msg, self.layout)
            self.log.append(Push(self.now, node, job_id, int(config[BASE_VERSION]), base, extras))
            delay = self.delays[node] * (1.0 + 0.2 * self.rng.random())
            if node in self.errors:
                reply, record = Message(Error(code=1, reason="boom"), reply_to=msg), None
            else:
                final = base + torch.randn(self.layout.numel, generator=self.gen) * 0.1
                n = self.rng.randrange(5, 50)
                reply = train_reply(msg, final, self.layout, n)
                record = Reply(0.0, node, job_id, final, n)
            reply.metadata.__dict__["_message_id"] = "r" + message_id
            self.pending[message_id] = (self.now + delay, self.count, reply, record)
            ids.append(message_id)
        return ids

    def pull_messages(self, message_ids) -> list[Message]:
        ready = sorted(
            (self.pending[m][:2], m)
            for m in message_ids
            if m in self.pending and self.pending[m][0] <= self.now
        )
        out = []
        for _, m in ready:
            _, _, reply, record = self.pending.pop(m)
            if record is not None:
                record.time = self.now
                self.log.append(record)
            out.append(reply)
        return out

    def pushes(self, node: int) -> list[Push]:
        return [e for e in self.log if isinstance(e, Push) and e.node == node]


class ServerReplay:
    """A real server (``RunningServer``, on the CPU like the adapter, so the same kernels run)
    for strategy ``name`` with one real gRPC :class:`Client` per node, registered in ``nodes``
    order (the first offers ``initial`` as version 0). :meth:`job` and :meth:`push` replay an
    adapter run's jobs and updates one by one; use as a context manager.

    ``clock`` (optional) replaces the server's wall clock (``Federation.clock``, the ``now`` of
    every strategy call) from before the registrations on, so the server sees the adapter's
    times; its timer then fires at :meth:`fire_timer`, not on wall time."""

    def __init__(
        self,
        name: str,
        config: Mapping[str, Any],
        layout: ModelLayout,
        initial: torch.Tensor,
        nodes: Iterable[int],
        clock: VirtualClock | None = None,
        initial_buffers: torch.Tensor | None = None,
    ) -> None:
        self.srv = RunningServer(
            strategy=name, strategy_config=dict(config), device="cpu", rate_limit_per_second=0.0
        )
        self.clock = clock
        if clock is not None:
            self.srv.federation.clock = clock
        self.clients: dict[int, Client] = {}
        self.jobs: dict[int, ClientJob] = {}
        try:
            for node in nodes:
                client = self.clients[node] = Client(self.srv.address, str(node))
                first = len(self.clients) == 1
                client.register(
                    layout=layout,
                    initial=initial if first else None,
                    initial_buffers=initial_buffers if first else None,
                )
        except BaseException:
            self.close()
            raise

    def job(self, node: int) -> ClientJob:
        """The node's next job (the server must have one for it now: 10 s at most)."""
        job = self.jobs[node] = self.clients[node].get_job(timeout=10)
        return job

    def push(
        self, node: int, final: torch.Tensor, n: int, buffers: torch.Tensor | None = None
    ) -> PushResult:
        """The node's final weights (and float buffers) for its last job, reporting the job's
        complete work (steps or epochs, as its recipe counts: what the adapter reports,
        ``recipe.work_target``)."""
        job = self.jobs[node]
        recipe = job.recipe
        return self.clients[node].push(
            job, final, kind=UpdateKind.WEIGHTS, num_samples=n, buffers=buffers,
            steps=recipe.local_steps or 0, epochs=recipe.local_epochs or 0.0,
        )  # fmt: skip

    def fire_timer(self, at: float) -> None:
        """Move the server's clock to ``at``, past the strategy's deadline, and let the server's
        own timer run there: any call re-arms it (``Federation.publish``), due at once."""
        assert self.clock is not None, "fire_timer needs a ServerReplay with a clock"
        fed = self.srv.federation
        # Read before the clock moves: until then a timer firing on its own does nothing.
        due = self.srv.run(fed.call(fed.strategy.next_deadline))
        assert due is not None and due <= at, f"no deadline due at {at} (deadline {due})"
        self.clock.now = at
        limit = time.monotonic() + 10.0
        while self.srv.run(fed.call(fed.strategy.next_deadline)) == due:
            assert time.monotonic() < limit, "the server's timer did not fire"
            time.sleep(0.002)

    def model(self) -> torch.Tensor:
        return self.srv.model()

    def close(self) -> None:
        for client in self.clients.values():
            client.close()
        self.srv.stop()

    def __enter__(self) -> ServerReplay:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ------------------------------------------------------------------ adapter runs and replays

START, FOLD = 100.0, 30.0  # round r's jobs go out at START * (r - 1), its replies FOLD later


def run_rounds(
    adapter: AggsrvStrategy,
    clock: VirtualClock,
    initial: ArrayRecord,
    nodes: list[int],
    rounds: int,
    seed: int,
    monkeypatch: Any,
    dead: int | None = None,
) -> tuple[list[Push | Reply | Timer], ArrayRecord]:
    """``rounds`` Flower rounds through ``adapter.configure_train`` / ``aggregate_train`` on
    ``clock`` (jobs at START * (r - 1), replies FOLD later): every job answered with its weights
    plus a random delta, the replies folded in a shuffled order; node ``dead`` answers round 1
    with an error. The log of jobs, folded replies and timers, and the final arrays."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    layout = layout_of(initial)
    log: list[Push | Reply | Timer] = []
    adapter.adopt(initial)
    log_timers(adapter.strategy, log, monkeypatch)
    grid, arrays = NodeGrid(nodes), initial
    for server_round in range(1, rounds + 1):
        clock.now = START * (server_round - 1)
        messages = list(adapter.configure_train(server_round, arrays, ConfigRecord(), grid))
        assert messages, f"seed {seed}: no node got a job in round {server_round}"
        sent = [m.metadata.dst_node_id for m in messages]
        assert sent == sorted(sent)  # in node order: the replay asks for the jobs in that order
        replies = []
        for msg in messages:
            assert msg.metadata.message_type == MessageType.TRAIN
            node = msg.metadata.dst_node_id
            config = msg.content["config"]
            start = record_to_flat(msg.content["arrays"], layout)
            job_id = int(config[JOB_ID])
            log.append(Push(clock.now, node, job_id, int(config[BASE_VERSION]), start,
                            job_extras(msg, layout)))  # fmt: skip
            if server_round == 1 and node == dead:
                replies.append((Message(Error(code=1, reason="node crashed"), reply_to=msg), None))
                continue
            final = start + torch.randn(layout.numel, generator=gen) * 0.1
            n = rng.randrange(5, 50)
            replies.append((train_reply(msg, final, layout, n), Reply(0.0, node, job_id, final, n)))
        rng.shuffle(replies)  # replies arrive in any order; the server gets the same order
        clock.now += FOLD
        folded = [r for _, r in replies if r is not None]
        for r in folded:
            r.time = clock.now
        log.extend(folded)
        arrays, metrics = adapter.aggregate_train(server_round, [m for m, _ in replies])
        assert metrics is not None and metrics["num-examples"] == sum(r.n for r in folded)
    return log, arrays


def replay(
    server: ServerReplay,
    clock: VirtualClock,
    log: list[Push | Reply | Timer],
    outcomes: list[tuple[str, int]],
    where: str,
) -> torch.Tensor:
    """Replay ``log`` on ``server`` (on ``clock``): each Push is the server's next job for its
    node (it must be the adapter's: id, base version, weights, further tensors), each Reply a
    push whose outcome must be the adapter's (``outcomes``: (status, version) in fold order;
    REFUSED: the server answers ABORTED), each Timer the server's timer at that time. Returns
    the server's final model."""
    results = iter(outcomes)
    for k, event in enumerate(log):
        at = f"{where}: event {k} at t={event.time:.4g}"
        if isinstance(event, Timer):
            server.fire_timer(event.time)
            continue
        clock.now = event.time
        if isinstance(event, Push):
            job = server.job(event.node)
            at += f" job for node {event.node}"
            assert (int(job.job_id), job.base_version) == (event.job_id, event.base_version), at
            assert torch.equal(job.weights, event.weights), f"{at}: start weights differ"
            extras = {k: v for k, v in job.tensors.items() if k not in ("weights", "buffers")}
            assert set(extras) == set(event.extras), at
            for key, tensor in event.extras.items():
                assert torch.equal(extras[key], tensor), f"{at}: job tensor {key!r} differs"
            continue
        status, version = next(results)
        at += f" update of node {event.node}"
        if status == REFUSED:
            with pytest.raises(grpc.RpcError) as refused:
                server.push(event.node, event.final, event.n)
            assert refused.value.code() == grpc.StatusCode.ABORTED, at
        else:
            got = server.push(event.node, event.final, event.n)
            assert (got.status.name, got.version) == (status, version), f"{at}: server {got}"
    assert next(results, None) is None, f"{where}: fewer replies than outcomes"
    return server.model()


def assert_same_model(
    where: str, adapter_model: torch.Tensor, server_model: torch.Tensor, initial: torch.Tensor
) -> None:
    """Bit for bit the same model, and one the updates changed."""
    assert not torch.equal(adapter_model, initial), f"{where}: the model never changed"
    assert torch.equal(adapter_model, server_model), (
        f"{where}: max difference {(adapter_model - server_model).abs().max():.3g}"
    )


def rounds_parity(
    name: str,
    config: Mapping[str, Any],
    monkeypatch: Any,
    *,
    nodes: list[int],
    rounds: int,
    dead: int | None = None,
) -> list[Push | Reply | Timer]:
    """:func:`run_rounds` with a fresh seed (also the strategy's ``seed``), replayed on a real
    server that shares the adapter's clock: same jobs, outcomes and final model. The log."""
    seed = random.randrange(1 << 30)
    config = {**config, "seed": seed}
    where = f"{name} seed {seed}"
    clock = VirtualClock()
    adapter = AggsrvStrategy(name, config, clock=clock, seed=seed)
    initial = initial_record(seed)
    layout = layout_of(initial)
    log, arrays = run_rounds(adapter, clock, initial, nodes, rounds, seed, monkeypatch, dead)
    outcomes = [(status, version) for _, status, version in adapter.outcomes]
    assert len(outcomes) == sum(isinstance(e, Reply) for e in log), f"{where}: refusals"
    first = record_to_flat(initial, layout)
    clock.now = 0.0
    with ServerReplay(name, config, layout, first, nodes, clock=clock) as server:
        server_model = replay(server, clock, log, outcomes, where)
    assert_same_model(where, record_to_flat(arrays, layout), server_model, first)
    return log
