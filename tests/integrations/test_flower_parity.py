"""The Flower adapter gives the same global model as `aggsrv serve` for every registered strategy.

Both of the adapter's paths run against the real `flwr` package, and each run is replayed on a
real server (`RunningServer` with real gRPC clients) in the same order:

* rounds: `AggsrvStrategy.configure_train` / `aggregate_train` for every strategy that
  tests/integrations/test_flower_adapter.py does not cover already (between them they cover the
  registry),
  plus the strategies' round, epoch and grouping deadlines;
* async: `run_async` on the virtual-clock FakeGrid (tests/support/flower_helpers.py) for FedAsync,
  ORTHOFL, FedHist and FedDGIC (with and without a grouping timeout that fires).

Every job the server hands out must equal the adapter's (id, base version, weights and further
tensors: Fed-OGD's basis), every update must get the same outcome, and the final models must be
equal bit for bit, since the same strategy code runs on the same inputs on the same device
(CPU). Strategies read time only from `now`; the server is given the adapter's clock
(`ServerReplay(clock=...)` replaces its wall clock), so the times are the same too. A strategy's
timer runs in the replay exactly where it ran for the adapter (the `Timer` events), through the
server's own timer. FedEN samples with the strategy's own RNG (seeded by the config's `seed`).
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

flwr = pytest.importorskip("flwr")

from flower_helpers import (  # noqa: E402
    START,
    FakeGrid,
    NodeGrid,
    Push,
    Reply,
    ServerReplay,
    Timer,
    VirtualClock,
    assert_same_model,
    initial_record,
    log_timers,
    replay,
    rounds_parity,
    train_reply,
)
from flwr.app import ConfigRecord, Error, Message  # noqa: E402
from test_flower_adapter import CASES as ADAPTER_CASES  # noqa: E402

from aggsrv.integrations.flower.arrays import layout_of, record_to_flat  # noqa: E402
from aggsrv.integrations.flower.async_loop import REFUSED, run_async  # noqa: E402
from aggsrv.integrations.flower.strategy import AggsrvStrategy  # noqa: E402
from aggsrv.strategies import STRATEGIES  # noqa: E402

pytestmark = pytest.mark.usefixtures("flower_identity")

# Node ids whose numeric and string orders differ: the strategies see "105", "12", "30", "7".
NODES = [7, 12, 30, 105]
ROUNDS = 4

# Small configs that aggregate within a few rounds of 4 nodes. `seed` is added per run.
ROUND_CASES: dict[str, dict[str, Any]] = {
    # Node 105 is a straggler (fixed group S): A-clients get b_S as their basis, 105 gets b_A.
    "fedogd": {"tiers": {"105": 2}, "epoch_timeout": None, "server_lr": 0.05},
    "mifa": {"tiers": {"105": 2}, "epoch_timeout": None},
    "orthofl": {"beta": 0.7},
    # Two synchronous similarity rounds over all 4 nodes, then the asynchronous phase.
    "feddgic": {"min_available": 4, "similarity_rounds": 2, "grouping_round_timeout": None},
    "fedfg": {
        "min_available": 4,
        "similarity_rounds": 1,
        "fixed_groups": 2,
        "grouping_round_timeout": None,
    },
    # Half of the 4 nodes sampled per round by the strategy's RNG.
    "feden": {"min_available": 4, "participation": 0.5, "round_timeout": None, "lam": 0.01},
    "fedprox": {"min_available": 4, "round_timeout": None, "mu": 0.1},
    # K = 3 of 4 per buffer: an update waits across a round boundary.
    "ca2fl": {"buffer_size": 3},
    "twafl": {"buffer_size": 3, "learning_rate": 0.1},
}

# Deadlines (60 s) that pass while node DEAD fails to answer round 1.
DEAD = 30
DEADLINE_CASES: dict[str, dict[str, Any]] = {
    "fedavg": {"min_available": 4, "round_timeout": 60.0},
    # Deadline detection moves node 30 to the stragglers (it then gets b_A as its basis).
    "fedogd": {"epoch_timeout": 60.0, "server_lr": 0.05},
    "feddgic": {"min_available": 4, "similarity_rounds": 2, "grouping_round_timeout": 60.0},
}


def test_every_registered_strategy_is_checked_against_the_server() -> None:
    covered = set(ROUND_CASES) | set(ADAPTER_CASES)
    assert not set(ROUND_CASES) & set(ADAPTER_CASES)
    assert covered == set(STRATEGIES), (
        f"not compared with the server through Flower: {sorted(set(STRATEGIES) - covered)}; "
        f"unknown: {sorted(covered - set(STRATEGIES))}"
    )


@pytest.mark.parametrize("name", list(ROUND_CASES))
def test_rounds_match_the_server(name: str, monkeypatch) -> None:
    log = rounds_parity(name, ROUND_CASES[name], monkeypatch, nodes=NODES, rounds=ROUNDS)
    assert not any(isinstance(e, Timer) for e in log)
    if name == "fedogd":
        bases = [e.extras["basis"] for e in log if isinstance(e, Push)]
        assert any(b.abs().sum() > 0 for b in bases), "only zero bases were sent"


@pytest.mark.parametrize("name", list(DEADLINE_CASES))
def test_rounds_deadlines_match_the_server(name: str, monkeypatch) -> None:
    """A node that fails round 1 does not stall the strategy: the round's deadline passes
    before round 2, whose configure_train runs the strategy's timer first, as the server's
    timer does at that time; the round closes with the other nodes' updates."""
    log = rounds_parity(
        name, DEADLINE_CASES[name], monkeypatch, nodes=NODES, rounds=ROUNDS, dead=DEAD
    )
    timers = [e.time for e in log if isinstance(e, Timer)]
    assert timers and timers[0] == START, timers
    round2 = [e.node for e in log if isinstance(e, Push) and e.time == START]
    assert DEAD in round2  # the failed node gets a fresh job in the next round
    if name == "fedogd":
        basis = next(e.extras["basis"] for e in log if isinstance(e, Push) and e.time == START)
        assert basis.abs().sum() == 0 and any(
            e.extras["basis"].abs().sum() > 0
            for e in log
            if isinstance(e, Push) and e.node == DEAD and e.time == START
        )  # node 30 was moved to S: it gets b_A, the others the still empty b_S


def test_aggregate_train_closes_a_round_past_its_deadline() -> None:
    """When Flower's round outlasts the strategy's round deadline, aggregate_train closes the
    round with what arrived (FedAvg: the sample-weighted mean of the replies, by hand)."""
    seed = random.randrange(1 << 30)
    gen = torch.Generator().manual_seed(seed)
    clock = VirtualClock()
    adapter = AggsrvStrategy("fedavg", DEADLINE_CASES["fedavg"], clock=clock)
    initial = initial_record(seed)
    layout = layout_of(initial)
    messages = list(adapter.configure_train(1, initial, ConfigRecord(), NodeGrid(NODES)))
    replies, want, total = [], torch.zeros(layout.numel, dtype=torch.float64), 0
    for msg in messages:
        if msg.metadata.dst_node_id == DEAD:
            replies.append(Message(Error(code=1, reason="node crashed"), reply_to=msg))
            continue
        start = record_to_flat(msg.content["arrays"], layout)
        final = start + torch.randn(layout.numel, generator=gen)
        n = 5 + len(replies)
        want += n * final.double()
        total += n
        replies.append(train_reply(msg, final, layout, n))
    clock.now = 61.0
    arrays, metrics = adapter.aggregate_train(1, replies)
    assert adapter.strategy.version == 1 and metrics["num-examples"] == total
    got = record_to_flat(arrays, layout).double()
    assert torch.allclose(got, want / total, rtol=0, atol=1e-5), f"seed {seed}"
    again = adapter.configure_train(2, arrays, ConfigRecord(), NodeGrid(NODES))
    assert [m.metadata.dst_node_id for m in again] == NODES  # a new round for everybody


ASYNC_DELAYS = {1: 0.1, 2: 0.25, 3: 0.6, 4: 1.3}
ASYNC_CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "fedasync": ("fedasync", {"alpha": 0.6}),
    "orthofl": ("orthofl", {}),
    "fedhist": ("fedhist", {"buffer_size": 2, "history": 2, "learning_rate": 0.1}),
    # One similarity round that waits for all 4 nodes (node 4 is slow), then the async phase.
    "feddgic": (
        "feddgic",
        {"min_available": 4, "similarity_rounds": 1, "grouping_round_timeout": None},
    ),
    # Nodes 1-3 in the similarity round; its deadline (0.4 s) passes before node 3 (0.6 s)
    # reports: the timer closes the round, node 3's late update is refused (ABORTED).
    "feddgic-timeout": (
        "feddgic",
        {"min_available": 3, "similarity_rounds": 1, "grouping_round_timeout": 0.4},
    ),
}


@pytest.mark.parametrize("case", list(ASYNC_CASES))
def test_async_loop_matches_the_server(case: str, monkeypatch) -> None:
    name, config = ASYNC_CASES[case]
    seed = random.randrange(1 << 30)
    config = {**config, "seed": seed}
    where = f"{case} seed {seed}"
    initial = initial_record(seed)
    layout = layout_of(initial)
    grid = FakeGrid(ASYNC_DELAYS, layout, seed)
    adapter = AggsrvStrategy(name, config)
    adapter.adopt(initial)
    log_timers(adapter.strategy, grid.log, monkeypatch)
    result = run_async(grid, adapter, initial, max_updates=30, duration=60.0, poll_interval=0.05,
                       clock=grid.clock, sleep=grid.sleep)  # fmt: skip
    assert result.stop_reason == "max_updates=30", where
    assert result.version > 0 and any(o.staleness > 0 for o in result.outcomes), where
    refused = [o for o in result.outcomes if o.status == REFUSED]
    timers = [e for e in grid.log if isinstance(e, Timer)]
    if case == "feddgic-timeout":
        assert timers and refused and all(o.node == 3 for o in refused), where
    else:
        assert not timers and not refused, where
    if name == "fedhist":  # a node whose update waits in the round gets its next job later
        assert {o.status for o in result.outcomes} == {"BUFFERED", "APPLIED"}, where

    # Pulled replies that the loop stopped before folding never reached the strategy.
    folded = {(o.node, o.job_id) for o in result.outcomes}
    log = [e for e in grid.log if not isinstance(e, Reply) or (e.node, e.job_id) in folded]
    assert [(e.node, e.job_id) for e in log if isinstance(e, Reply)] == [
        (o.node, o.job_id) for o in result.outcomes
    ], where
    # Each node holds one job at a time (its next one goes out once its reply is folded), so
    # real clients can follow the interleaving exactly.
    clock = VirtualClock()
    first = record_to_flat(initial, layout)
    nodes = sorted(ASYNC_DELAYS)  # run_async registers the connected nodes in node order
    with ServerReplay(name, config, layout, first, nodes, clock=clock) as server:
        outcomes = [(o.status, o.version) for o in result.outcomes]
        server_model = replay(server, clock, log, outcomes, where)
    assert_same_model(where, record_to_flat(result.arrays, layout), server_model, first)
