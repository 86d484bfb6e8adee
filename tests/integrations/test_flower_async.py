"""`run_async`: asynchronous aggregation in a Flower ServerApp loop, against a fake Grid.

The fake Grid (tests/support/flower_helpers.py) simulates client nodes with different delays on a
virtual clock that only the loop's `sleep` advances, so runs are deterministic and take no real
waiting. Each TRAIN message is answered after its node's delay with the message's weights plus a
seeded random delta. The loop must give FedAsync the model an independent replay of the same
jobs and replies gives (bit for bit) and the FedAsync formula by hand (float64); fast nodes must
not wait for slow ones; stop conditions, dead nodes, error replies, joining nodes and refusals
must behave.
"""

from __future__ import annotations

import math

import pytest
import torch

flwr = pytest.importorskip("flwr")

from flower_helpers import FakeGrid, Push, Reply, initial_record  # noqa: E402
from flwr.app import ArrayRecord, MetricRecord  # noqa: E402

from aggsrv.integrations.flower.arrays import layout_of, record_to_flat  # noqa: E402
from aggsrv.integrations.flower.async_loop import REFUSED, AsyncResult, run_async  # noqa: E402
from aggsrv.integrations.flower.strategy import AggsrvStrategy  # noqa: E402
from aggsrv.strategies import Update, UpdateKind, make_strategy  # noqa: E402

POLL = 0.05


pytestmark = pytest.mark.usefixtures("flower_identity")


def _run(name, config, delays, seed=0, **kwargs) -> tuple[AsyncResult, FakeGrid, AggsrvStrategy]:
    initial = initial_record(seed)
    grid = FakeGrid(
        delays,
        layout_of(initial),
        seed,
        joins=kwargs.pop("joins", None),
        errors=kwargs.pop("errors", frozenset()),
    )
    adapter = AggsrvStrategy(name, config)
    result = run_async(
        grid, adapter, initial, poll_interval=POLL, clock=grid.clock, sleep=grid.sleep, **kwargs
    )
    return result, grid, adapter


def _per_node(result: AsyncResult) -> dict[int, int]:
    counts: dict[int, int] = {}
    for o in result.outcomes:
        if o.status != REFUSED:
            counts[o.node] = counts.get(o.node, 0) + 1
    return counts


DELAYS = {1: 0.1, 2: 0.25, 3: 0.6, 4: 1.3}


def test_fedasync_matches_a_replay_and_the_formula_and_nobody_waits() -> None:
    seed = 1234
    config = {"alpha": 0.6}
    snapshots: dict[int, torch.Tensor] = {}
    initial = initial_record(seed)
    layout = layout_of(initial)

    def evaluate(version: int, arrays: ArrayRecord) -> MetricRecord:
        snapshots[version] = record_to_flat(arrays, layout)
        return MetricRecord({"norm": float(snapshots[version].norm())})

    result, grid, _ = _run(
        "fedasync", config, DELAYS, seed=seed, max_updates=60, evaluate_fn=evaluate,
        evaluate_every=1,
    )  # fmt: skip
    final = record_to_flat(result.arrays, layout)
    assert result.updates_applied == 60 and result.version == 60 and result.updates_refused == 0
    assert result.stop_reason == "max_updates=60"
    assert sorted(result.evaluations) == list(range(61))  # keyed by version, 0 included
    assert torch.equal(snapshots[60], final)

    # An independent replay: the same jobs and replies, in the same order, straight into a
    # fresh FedAsync (on_register/job_for/on_update) gives the loop's model bit for bit.
    replay = make_strategy(
        "fedasync", layout=layout, initial=record_to_flat(initial, layout), config=config,
        device="cpu", max_clients=64,
    )  # fmt: skip
    folded = {(o.node, o.job_id) for o in result.outcomes}
    applied = []
    for event in grid.log:
        client = str(event.node)
        if isinstance(event, Push):
            if client not in replay.clients:
                replay.on_register(client, event.time)
            job = replay.job_for(client, event.time)
            assert job is not None and job.job_id == event.job_id
            assert job.base_version == event.base_version
            assert torch.equal(job.weights, event.weights)
        elif (event.node, event.job_id) in folded:
            job = replay.outstanding_job(client)
            assert job is not None and job.job_id == event.job_id
            replay.on_update(
                Update(client, job.job_id, job.base_version, f"u{len(applied)}", event.n,
                       job.recipe.work_target, UpdateKind.WEIGHTS, event.final.clone()),
                event.time,
            )  # fmt: skip
            applied.append(event)
    assert len(applied) == 60
    assert torch.equal(replay.global_model(), final)

    # FedAsync by hand in float64 for the first updates: x <- (1 - a_s) x + a_s x_client with
    # a_s = alpha * (s + 1) ** -0.5 (the default polynomial staleness, a = 0.5).
    base_of = {(e.node, e.job_id): e.base_version for e in grid.log if isinstance(e, Push)}
    x = record_to_flat(initial, layout).double()
    for k, event in enumerate(applied[:8]):
        s = k - base_of[(event.node, event.job_id)]  # every update makes one version
        assert result.outcomes[k].staleness == s and result.outcomes[k].version == k + 1
        a = 0.6 * (s + 1) ** -0.5
        x = (1 - a) * x + a * event.final.double()
        assert torch.allclose(snapshots[k + 1].double(), x, rtol=0, atol=1e-6)

    # Asynchrony: the fast node does many more updates than the slowest, stale updates occur,
    # and the fast node keeps contributing between two updates of the slow one.
    counts = _per_node(result)
    assert counts[1] > counts[2] > counts[4] >= 1 and counts[1] >= 4 * counts[4]
    assert any(o.staleness > 0 for o in result.outcomes)
    slow = [i for i, o in enumerate(result.outcomes) if o.node == 4]
    assert len(slow) >= 2
    between = [o.node for o in result.outcomes[slow[0] + 1 : slow[1]]]
    assert between.count(1) >= 5
    # A node's next job goes out at the virtual time its reply was folded in: no waiting.
    replies = [e for e in grid.log if isinstance(e, Reply) and e.node == 1]
    pushes = grid.pushes(1)
    assert all(p.time == r.time for r, p in zip(replies, pushes[1:], strict=False))


def test_stop_conditions() -> None:
    result, _, _ = _run("fedasync", {}, DELAYS, max_updates=7)
    assert result.updates_applied == 7 and len(result.outcomes) == 7 and result.version == 7
    result, _, _ = _run("fedasync", {}, DELAYS, max_versions=5)
    assert result.version == 5 and result.new_versions == 5
    result, grid, _ = _run("fedasync", {}, DELAYS, duration=2.0)
    assert 2.0 <= result.elapsed <= 2.0 + 1e-9 and grid.now == result.elapsed
    assert result.stop_reason == "duration=2.0" and result.outstanding == 4
    # The first condition met wins.
    result, _, _ = _run("fedasync", {}, DELAYS, max_updates=1000, duration=1.0)
    assert result.stop_reason == "duration=1.0" and result.updates_applied < 1000
    with pytest.raises(ValueError, match="at least one"):
        _run("fedasync", {}, DELAYS)
    with pytest.raises(ValueError, match="job_timeout"):
        _run("fedasync", {}, DELAYS, max_updates=1, job_timeout=0.0)


def test_dead_node_is_reissued_error_node_retried_late_node_joins() -> None:
    delays = {1: 0.1, 2: 0.3, 5: 0.2, 7: 0.2, 99: math.inf}
    result, grid, adapter = _run(
        "fedasync", {"alpha": 0.5}, delays, duration=4.0, job_timeout=0.5,
        joins={7: 1.0}, errors=frozenset({5}),
    )  # fmt: skip
    counts = _per_node(result)
    # The dead node blocks nobody and is re-issued a fresh job every job_timeout.
    assert counts[1] >= 25 and counts[2] >= 8 and 99 not in counts
    dead = grid.pushes(99)
    assert len(dead) >= 6
    gaps = [b.time - a.time for a, b in zip(dead, dead[1:], strict=False)]
    assert all(0.5 <= g <= 0.5 + POLL + 1e-9 for g in gaps), gaps
    assert len({p.job_id for p in dead}) == len(dead)  # fresh jobs (the model moved on)
    strategy = adapter.strategy
    assert all(strategy.job_state("99", p.job_id) == "superseded" for p in dead[:-1])
    assert result.jobs_timed_out == len(dead) - 1  # the last one was outstanding at the end
    # The error node's replies count as failed jobs; it gets a new job each time.
    errored = grid.pushes(5)
    assert 5 not in counts and len(errored) >= 10 and result.jobs_failed >= len(errored) - 1
    # The node that connects at t=1 gets jobs from then on and contributes.
    late = grid.pushes(7)
    assert late and late[0].time >= 1.0 and counts[7] >= 5
    assert late[0].base_version > 0  # it starts from the model as it is when it joins


def test_too_stale_updates_are_refused_and_the_node_gets_a_new_job() -> None:
    result, grid, _ = _run(
        "fedasync", {"alpha": 0.5, "max_staleness": 2}, {1: 0.1, 2: 0.12, 3: 1.0}, duration=4.0
    )
    refused = [o for o in result.outcomes if o.status == REFUSED]
    assert refused and all(o.node == 3 and o.staleness > 2 for o in refused)
    assert result.updates_refused == len(refused)
    assert len(grid.pushes(3)) >= len(refused) + 1  # a new job after each refusal


@pytest.mark.parametrize(
    ("name", "config"),
    [
        ("fedhist", {"buffer_size": 2, "history": 2, "learning_rate": 0.1}),
        ("orthofl", {}),
        ("feddgic", {"min_available": 3, "grouping_round_timeout": 0.4, "similarity_rounds": 1}),
    ],
)
def test_other_async_strategies_run_through_the_loop(name: str, config: dict) -> None:
    result, grid, _ = _run(name, config, DELAYS, max_updates=30, duration=30.0)
    assert result.version > 0 and result.updates_applied > 0
    assert result.updates_applied == 30 or result.stop_reason.startswith("duration")
    counts = _per_node(result)
    assert counts.get(1, 0) > counts.get(4, 0)
    if name == "fedhist":  # two updates per version; a node waits while its update is buffered
        assert {o.status for o in result.outcomes} >= {"BUFFERED", "APPLIED"}
    if name == "feddgic":
        # The grouping round's deadline (0.4 s) passes before node 3 (0.6 s) reports: on_timer
        # closes the round, so node 3's late grouping update is refused and it gets a new job.
        assert result.outcomes[0].status == "BUFFERED"
        late = [o for o in result.outcomes if o.node == 3]
        assert late[0].status == REFUSED and late[0].time >= 0.6
        assert any(o.status == "APPLIED" for o in late[1:])
