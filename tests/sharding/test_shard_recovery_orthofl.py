"""A reducing strategy (ORTHOFL: its per-segment calibration sums dot products over the shards)
on `aggsrv serve --shards N` processes SIGKILLed at random while clients push, then resumed
(docs/sharding.md "Crashes and recovery").

Oracle: rank 0's log is the decision. Nothing is pruned (checkpoint_keep is large), so rank 0's
state directory holds every call the federation made, from segment 1 on, across every restart.
Every update a client saw acknowledged is there exactly once as an update record that is not a
duplicate; and one unsharded ORTHOFL strategy making rank 0's logged calls, with the whole
updates rebuilt from their ids (a one-hot of the client's coordinate), ends within 1e-5
(relative) of the model the clients join from the shards (1e-5: the shards' partial sums round
differently, docs/sharding.md).
"""

from __future__ import annotations

import random
import threading
from pathlib import Path

import pytest
import torch
from shard_kills import CLIENTS, ShardProcesses, kill_at_random, start_pushing, wait_for

from aggsrv.client import Client
from aggsrv.layout import ModelLayout
from aggsrv.server import durability as D
from aggsrv.strategies import Outcome, Status, Update, UpdateKind, make_strategy

D_ = 389  # odd: the slices' cuts fall inside the tensors
SETTINGS = """
shard_slice_wait_seconds = 2.0
shard_heartbeat_seconds = 0.2
shard_timeout_seconds = 20.0
rate_limit_per_second = 0.0
checkpoint_every_updates = 7
checkpoint_keep = 1000
lease_seconds = 600.0
"""


def _layout() -> ModelLayout:
    # Two tensors: ORTHOFL calibrates per named tensor (a segment sum cut by a shard boundary).
    return ModelLayout.from_named_shapes([("w", (13, 23)), ("b", (D_ - 13 * 23,))])


def _coordinate(client: str) -> int:
    return (37 * (int(client[1:]) + 1)) % D_


def _one_hot(client: str) -> torch.Tensor:
    delta = torch.zeros(D_)
    delta[_coordinate(client)] = 1.0
    return delta


def _replay_rank0_log(directory: Path) -> tuple[torch.Tensor, dict[str, list[Outcome]]]:
    """One whole-model ORTHOFL making every call rank 0 logged, from segment 1 on; (its
    model, the logged outcomes by update id)."""
    layout = _layout()
    single = make_strategy("orthofl", layout=layout, initial=torch.zeros(D_), config={},
                           device="cpu")  # fmt: skip
    logged: dict[str, list[Outcome]] = {}
    kinds: set[str] = set()
    for _, record in D.iter_records(directory, 1):
        m = record.meta
        kinds.add(record.kind)
        if record.kind == "register":
            single.on_register(m["client"], m["now"])
        elif record.kind == "job":
            single.job_for(m["client"], m["now"])
        elif record.kind == "timer":
            single.on_timer(m["now"])
        elif record.kind == "cut":
            continue  # the sums a checkpoint's load made on the shards: nothing to call
        elif record.kind == "update":
            assert m["kind"] == UpdateKind.DELTA.name, m
            assert m["update_id"].startswith(m["client"] + "-"), m
            update = Update(
                client_id=m["client"], job_id=int(m["job_id"]),
                base_version=int(m["base_version"]), update_id=m["update_id"],
                num_samples=int(m["num_samples"]), work_done=float(m["work_done"]),
                kind=UpdateKind.DELTA, tensor=_one_hot(m["client"]),
            )  # fmt: skip
            outcome = Outcome.from_tuple(m["outcome"])
            assert single.on_update(update, m["now"]) == outcome, (m, outcome)
            logged.setdefault(m["update_id"], []).append(outcome)
        else:
            raise AssertionError(f"an unexpected record in rank 0's log: {record.kind} {m}")
    assert {"register", "job", "update"} <= kinds, kinds
    return single.global_model(), logged


@pytest.mark.parametrize("shards", [2, 3])
def test_orthofl_survives_random_sigkills(tmp_path: Path, shards: int) -> None:
    """Clients push all the while; at random moments one shard, rank 0 or all of them are
    SIGKILLed, then every shard is restarted with --resume."""
    rng = random.Random()
    fed = ShardProcesses(tmp_path, shards, "orthofl", SETTINGS)
    acked: list[str] = []
    stop = threading.Event()
    try:
        fed.start(resume=False)
        with Client(fed.address, "init", timeout=20) as c:
            c.register(layout=_layout(), initial=torch.zeros(D_))
        threads = start_pushing(fed, 10, acked, stop, _layout(), _one_hot)
        kill_at_random(fed, rng)
        wait_for(fed, threads)
        with Client(fed.address, "reader", timeout=20, retries=3) as reader:
            reader.register(layout=_layout())
            version, model = reader.get_model()
        fed.kill(list(range(shards)))  # the log is read as a crash leaves it

        want, logged = _replay_rank0_log(tmp_path / "shard0")
        assert len(acked) == len(set(acked)) == CLIENTS * 10, acked
        for update_id in acked:
            outcomes = logged.get(update_id, [])
            assert len(outcomes) == 1, (update_id, outcomes, fed.logs())
            assert outcomes[0].status is not Status.DUPLICATE, (update_id, outcomes)
            assert outcomes[0].original is None, (update_id, outcomes)
        # Logged but never acknowledged (the client was killed with the shard before its
        # answer): in the model all the same, since recovery replays rank 0's log.
        assert all(len(o) == 1 for o in logged.values()), logged
        assert version == len(logged), (version, len(logged))  # one version per update
        err = float((model.double() - want.double()).norm() / want.double().norm())
        assert err <= 1e-5, (err, fed.logs())
    finally:
        stop.set()
        fed.close()
