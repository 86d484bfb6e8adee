"""Every strategy resumes exactly on a sharded federation (docs/sharding.md "Crashes and
recovery"): a script of calls (registrations, jobs, updates with one sent twice, timers) runs
on shard processes with a state directory each and a checkpoint every few updates; the
processes are SIGKILLed after some of it, resumed, and the script goes on. The oracle is an
uninterrupted run of the same script on the same number of shards:

- every answer (job ids and base versions, push outcomes and versions, refusals) is the same;
- each shard's durable state (the strategy's whole state_dict: models, buffers, kept rows, the
  update-id ledger, leases, DP accountant, filter windows, groupings; the registry; the counts
  that survive restarts) right after the resume equals the uninterrupted run's at the same
  call, and so does it at the end;
- the joined model, and every job's weights, are bit for bit equal for the elementwise
  strategies, within 1e-5 relative for the reducing ones (docs/sharding.md);
- an update acknowledged before the crash, sent again after it, is answered DUPLICATE.

The calls are made one at a time on a clock the test sets (tests/sharding/recovery_shards.py),
so both runs make the same calls with the same ``now``.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from bitwise_diff import describe_difference
from recovery_shards import ShardGroupOfWorkers, ShardPool
from strategy_cases import strategy_cases

from aggsrv.client.client import Client, ClientJob
from aggsrv.layout import ModelLayout
from aggsrv.server import durability as D
from aggsrv.strategies import STRATEGIES, Status, UpdateKind
from aggsrv.v1 import aggregation_pb2 as pb

CLIENTS = 3
CHECKPOINT_EVERY = 5  # updates: checkpoints are cut before the crash, with records after them
# Server work that is elementwise: a shard's slice needs nothing from the others (bit for bit).
ELEMENTWISE = {"fedavg", "fedasync", "fedbuff", "fedprox", "fedogd", "mifa", "feden", "ca2fl",
               "twafl"}  # fmt: skip
# What each strategy keeps beyond its model: the DP accountant and its noise streams' positions
# (a fixed seed, so both runs draw the same noise), a robust aggregator's rows, a filter's
# window of norms and its centre.
VARIANTS = {
    "fedbuff+dp": {"buffer_size": 2, "dp_clip_norm": 0.8, "dp_noise_multiplier": 0.5,
                   "dp_seed": 5, "dp_insecure_seed": True},
    "fedavg+dp": {"mode": "sync", "min_clients": 3, "round_timeout": 0.5, "dp_clip_norm": 0.8,
                  "dp_noise_multiplier": 0.3, "dp_seed": 9, "dp_insecure_seed": True},
    "fedbuff+median": {"buffer_size": 3, "aggregator": "median"},
    "fedbuff+geomed": {"buffer_size": 3, "aggregator": "geometric_median"},
    "fedasync+filter": {"alpha": 0.6,
                        "update_filter": "norm:factor=3,warmup=2 > centered_clip:warmup=2"},
}  # fmt: skip
CASES = {**strategy_cases(CLIENTS), **VARIANTS}
# Noise from a secret key: two runs differ (only the accountant is compared).
SECURE_DP = {"fedbuff+secure-dp": {"buffer_size": 2, "dp_clip_norm": 0.8,
                                   "dp_noise_multiplier": 0.5}}  # fmt: skip


def _strategy(case: str) -> str:
    return case.split("+")[0]


def _exact(case: str) -> bool:
    """Whether the case's joined model is bit for bit (elementwise server work only: DP's
    clipping sums the whole model's norm over the shards, geometric median its distances)."""
    return case in ELEMENTWISE or case == "fedbuff+median"


def _layout() -> ModelLayout:
    # Odd sizes: the 2- and 3-shard cuts fall inside tensors (D = 251).
    return ModelLayout.from_named_shapes(
        [("a.weight", (11, 13)), ("a.bias", (11,)), ("b.weight", (7, 11)), ("b.bias", (7,)),
         ("c.weight", (2, 7)), ("c.bias", (2,))]
    )  # fmt: skip


SETTINGS = {
    "host": "127.0.0.1", "port": 0, "auth": "none", "device": "cpu",
    "rate_limit_per_second": 0.0, "shard_heartbeat_seconds": 0.2,
    "shard_slice_wait_seconds": 5.0, "shard_timeout_seconds": 30.0, "durability": "on",
    "checkpoint_every_updates": CHECKPOINT_EVERY, "checkpoint_every_seconds": 0.0,
    "checkpoint_keep": 1000, "lease_seconds": 3600.0,
}  # fmt: skip


def _configs(case: str, world: int, state: Path, resume: bool) -> list[dict[str, Any]]:
    """Each rank's ServerConfig keys (``world`` 1: one unsharded server)."""
    return [
        {**SETTINGS, "strategy": _strategy(case), "strategy_config": {**CASES, **SECURE_DP}[case],
         "shards": world, "rank": r, "state_dir": str(state / f"shard{r}"), "resume": resume}
        for r in range(world)
    ]  # fmt: skip


class Script:
    """The calls of the script, one at a time, each at its own time; what every call was
    answered (``answers``) and the weights of every job handed out (``weights``)."""

    def __init__(self, shards: ShardGroupOfWorkers, layout: ModelLayout, initial: torch.Tensor,
                 seed: int) -> None:  # fmt: skip
        self.shards = shards
        self.layout = layout
        self.initial = initial
        self.seed = seed
        self.answers: list[tuple] = []
        self.weights: list[torch.Tensor] = []
        self.jobs: dict[str, ClientJob] = {}
        self.sent: dict[str, tuple[torch.Tensor, UpdateKind]] = {}
        self.clients: list[Client] = []
        self.acked: list[tuple[int, str]] = []  # (client, update id) acknowledged as new

    def connect(self, port: int, first: bool) -> None:
        """(Re-)register every client with the federation at ``port``."""
        for c in self.clients:
            c.close()
        address = f"127.0.0.1:{port}"
        self.clients = [Client(address, f"c{i}", timeout=30, retries=0) for i in range(CLIENTS)]
        for i, c in enumerate(self.clients):
            self.shards.tick(0.01)
            c.register(layout=self.layout, initial=self.initial if first and i == 0 else None)
            self.answers.append(("register", i))

    def round(self, r: int, twice: int | None = None) -> None:
        """Every client asks for a job; those that got one push an update (client ``twice``
        pushes its update twice)."""
        got = {}
        for i, c in enumerate(self.clients):
            self.shards.tick(0.01)
            if not self.shards.has_job(c.client_id):
                self.answers.append(("no job", i))
                continue
            job = c.get_job(timeout=30)
            got[i] = job
            self.answers.append(("job", i, job.job_id, job.base_version))
            self.weights.append(job.weights.clone())
        for i, job in got.items():
            c = self.clients[i]
            gen = torch.Generator().manual_seed(self.seed * 101 + 10 * r + i)
            noise = 0.05 * torch.randn(self.layout.numel, generator=gen)
            kind = UpdateKind.WEIGHTS if (i + r) % 2 else UpdateKind.DELTA
            tensor = job.weights + noise if kind is UpdateKind.WEIGHTS else noise
            update_id = f"u{i}-{r}"
            self.jobs[update_id] = job
            self.sent[update_id] = (tensor, kind)
            for _ in range(2 if i == twice else 1):
                self.push(i, update_id)

    def push(self, i: int, update_id: str) -> Any:
        """Push (again) update ``update_id`` of client ``i``, with the job it was made for."""
        self.shards.tick(0.01)
        job, (tensor, kind) = self.jobs[update_id], self.sent[update_id]
        recipe = job.recipe
        try:
            answer = self.clients[i].push(
                job, tensor, kind=kind, num_samples=10 + 7 * i, update_id=update_id,
                steps=recipe.local_steps or 0, epochs=recipe.local_epochs or 0.0,
            )  # fmt: skip
        except grpc.RpcError as exc:
            self.answers.append(("push", i, update_id, exc.code().name))
            return exc.code()
        self.answers.append(("push", i, update_id, answer.status.name, answer.version,
                             answer.original and answer.original.name))  # fmt: skip
        if answer.status in (Status.APPLIED, Status.BUFFERED):
            self.acked.append((i, update_id))
        return answer

    def timer(self) -> None:
        """Past every round's and epoch's deadline, then rank 0's timer."""
        self.shards.tick(1.0)
        self.shards.timer()
        self.answers.append(("timer",))

    def model(self) -> tuple[int, torch.Tensor]:
        version, model = self.clients[0].get_model()
        return version, model

    def shutdown(self) -> None:
        with Client(self.clients[0].address, "operator") as op:
            op.admin_call("Shutdown", pb.ShutdownRequest(grace_seconds=1))
        for c in self.clients:
            c.close()
        assert self.shards.stopped() == [None] * len(self.shards.workers)


def _before_crash(script: Script) -> None:
    script.round(0, twice=1)
    script.timer()
    script.round(1)
    script.round(2)
    script.timer()


def _after_crash(script: Script) -> Any:
    """The rest of the script; the answer to the first update acknowledged, sent again."""
    again = script.push(*script.acked[0])
    script.round(3)
    script.timer()
    script.round(4, twice=2)
    script.timer()
    return again


def _wait_for_common_checkpoints(state: Path, world: int) -> list[int]:
    """The checkpoints rank 0 wrote, once every shard has them too (written in the
    background by the shards of rank >= 1)."""
    deadline = time.monotonic() + 30
    while True:
        numbers = [[n for n, _ in D.list_checkpoints(state / f"shard{r}")] for r in range(world)]
        if all(n == numbers[0] for n in numbers) or time.monotonic() > deadline:
            assert all(n == numbers[0] for n in numbers), numbers
            return numbers[0]
        time.sleep(0.05)


def _unnumbered_calls(rank0: Path) -> list[str]:
    """The kinds of the calls in rank 0's log that carry no number in rank 0's order (``seq``:
    recovery replays the calls numbered after the checkpoint it loads)."""
    calls = ("register", "job", "update", "timer")
    return sorted({r.kind for _, r in D.iter_records(rank0, 1)
                   if r.kind in calls and "seq" not in r.meta})  # fmt: skip


class UnnumberedCalls(AssertionError):
    """Rank 0 logged calls without their number: a shard recovering alone skips them (it
    replays the calls numbered after its checkpoint). Timers were, until 8152933."""


def _differences(a: Any, b: Any, exact: bool, path: str = "") -> list[str]:
    """Where two durable states differ: floating-point tensors within 1e-5 (relative) unless
    ``exact``, everything else exactly (times, counts, ids, and the numbers a strategy derives
    from the shards' sums, which two runs sum in the same order)."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = [f"{path}.{k}: only in one" for k in set(a) ^ set(b)]
        for k in sorted(set(a) & set(b), key=str):
            out += _differences(a[k], b[k], exact, f"{path}.{k}")
        return out
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{path}: {len(a)} items against {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True))
                for d in _differences(x, y, exact, f"{path}[{i}]")]  # fmt: skip
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.shape != b.shape or a.dtype != b.dtype:
            return [f"{path}: {a.dtype}{list(a.shape)} against {b.dtype}{list(b.shape)}"]
        if exact or not a.is_floating_point():
            return [] if torch.equal(a, b) else [f"{path}: tensors differ"]
        scale = float(b.double().norm()) or 1.0
        err = float((a.double() - b.double()).norm()) / scale
        return [] if err <= 1e-5 else [f"{path}: relative error {err:.2e}"]
    if hasattr(a, "__array__") and hasattr(b, "__array__"):
        return _differences(torch.as_tensor(a), torch.as_tensor(b), exact, path)
    same = a == b or (isinstance(a, float) and a != a and b != b)
    return [] if same else [f"{path}: {a!r} against {b!r}"]


def _same_model(exact: bool, got: torch.Tensor, want: torch.Tensor, bounds: list[int]) -> str:
    if exact:
        return describe_difference(got, want, bounds)
    err = float((got.double() - want.double()).norm() / want.double().norm())
    return "" if err <= 1e-5 else f"relative error {err:.2e}"


@pytest.fixture(scope="module")
def pool():
    pool = ShardPool(spare=6)
    yield pool
    pool.close()


def _run(case: str, world: int, pool: ShardPool, state: Path, crash: str | int | None
         ) -> dict[str, Any]:  # fmt: skip
    """The script on ``world`` shards: uninterrupted (``crash`` None), every shard SIGKILLed
    halfway and the federation resumed ("all"), or only shard ``crash`` SIGKILLed halfway and
    restarted alone (the others keep their state and take it back in)."""
    seed = int.from_bytes(case.encode(), "little") % (1 << 30)
    layout = _layout()
    initial = torch.randn(layout.numel, generator=torch.Generator().manual_seed(seed))
    state.mkdir()
    alone = isinstance(crash, int)
    shards = ShardGroupOfWorkers(pool, world, None if alone else state / "rendezvous-1")
    configs = _configs(case, world, state, resume=False)
    if alone:  # they meet at rank 0's store, where the restarted shard meets them again
        from server_helpers import free_port

        url = f"tcp://127.0.0.1:{free_port()}"
        configs = [{**c, "dist_url": url} for c in configs]
    script = Script(shards, layout, initial, seed)
    port = shards.serve(configs)
    script.connect(port, first=True)
    _before_crash(script)
    out: dict[str, Any] = {"checkpoints": _wait_for_common_checkpoints(state, world)}
    out["unnumbered"] = _unnumbered_calls(state / "shard0")
    if crash == "all":
        shards.kill()
        resumed = ShardGroupOfWorkers(pool, world, state / "rendezvous-2")
        resumed.set_clock(shards.now)
        script.shards = shards = resumed
        port = shards.serve(_configs(case, world, state, resume=True))
    elif alone:
        shards.restart(crash, {**configs[crash], "resume": True})
        # A restarted rank 0 answers at another port (chosen by the system: port 0).
        port = shards.workers[0].call("port") if crash == 0 else port
    out["at crash"] = shards.states()
    script.connect(port, first=False)
    out["again"] = _after_crash(script)
    out["version"], out["model"] = script.model()
    out["end"] = shards.states()
    out["bounds"] = [0, *(s.end for s in script.clients[0].status().shard_map.shards)]
    out["answers"], out["weights"] = script.answers, script.weights
    script.shutdown()
    shards.leave()
    return out


def _runs(runs: dict[str, tuple], pool: ShardPool, tmp: Path) -> dict[str, dict[str, Any]]:
    """Several runs at once (name: (case, world, crash)): their processes mostly wait on each
    other's calls, so two runs take little longer than one."""
    out: dict[str, Any] = {}

    def run(name: str, case: str, world: int, crash: str | int | None) -> None:
        try:
            out[name] = _run(case, world, pool, tmp / name, crash)
        except BaseException as exc:  # reported by the test's thread
            out[name] = exc

    threads = [threading.Thread(target=run, args=(name, *how)) for name, how in runs.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    for name in runs:
        if isinstance(out.get(name), BaseException):
            raise out[name]
        assert name in out, f"run {name} did not finish"
    return out


def _check(context: str, exact: bool, want: dict[str, Any], got: dict[str, Any]) -> None:
    assert got["answers"] == want["answers"], context
    assert len(got["weights"]) == len(want["weights"]), context
    for i, (a, b) in enumerate(zip(got["weights"], want["weights"], strict=True)):
        diff = _same_model(exact, a, b, want["bounds"])
        assert not diff, f"{context}: job {i}'s weights: {diff}"
    for point in ("at crash", "end"):
        for r, (a, b) in enumerate(zip(got[point], want[point], strict=True)):
            diff = _differences(a, b, exact)
            assert not diff, f"{context}: shard {r}'s state {point}: {diff[:8]}"
    assert got["version"] == want["version"], context
    diff = _same_model(exact, got["model"], want["model"], want["bounds"])
    assert not diff, f"{context}: the joined model: {diff}"


def _params() -> list[Any]:
    cases = [pytest.param(c, 2, id=f"{c}-2") for c in CASES]
    # Three shards: one elementwise and one reducing strategy (a middle slice, two cuts).
    cases += [pytest.param(c, 3, id=f"{c}-3") for c in ("fedbuff+dp", "orthofl")]
    return cases


@pytest.mark.parametrize(("case", "world"), _params())
def test_a_resumed_federation_goes_on_as_an_uninterrupted_one(
    case: str, world: int, pool: ShardPool, tmp_path: Path
) -> None:
    runs = _runs({"uninterrupted": (case, world, None), "crashed": (case, world, "all")},
                 pool, tmp_path)  # fmt: skip
    want, got = runs["uninterrupted"], runs["crashed"]
    if got["unnumbered"]:
        raise UnnumberedCalls(f"rank 0 logged {got['unnumbered']} calls without a seq")
    # Checkpoints were cut before the crash (the first one at the first model).
    assert len(want["checkpoints"]) >= 2 and got["checkpoints"] == want["checkpoints"], runs
    _check(f"{case} on {world} shards", _exact(case), want, got)
    # The update acknowledged before the crash, sent again after it.
    assert not isinstance(got["again"], grpc.StatusCode), got["again"]
    assert got["again"].status is Status.DUPLICATE, (case, got["again"])


@pytest.mark.parametrize(
    ("case", "world", "victim"),
    [("fedbuff", 2, 1), ("orthofl", 2, 0), ("feddgic", 3, 1), ("fedbuff+dp", 2, 1),
     ("fedavg", 3, 0)],
)  # fmt: skip
def test_a_shard_restarted_alone_goes_on_as_if_never_lost(
    case: str, world: int, victim: int, pool: ShardPool, tmp_path: Path
) -> None:
    """Only shard ``victim`` is SIGKILLed and restarted (the others stay up, refuse writes
    meanwhile, and keep their state when the group forms again): the same comparison."""
    runs = _runs({"uninterrupted": (case, world, None), "restarted": (case, world, victim)},
                 pool, tmp_path)  # fmt: skip
    want, got = runs["uninterrupted"], runs["restarted"]
    if got["unnumbered"]:
        raise UnnumberedCalls(f"rank 0 logged {got['unnumbered']} calls without a seq")
    _check(f"{case} on {world} shards, shard {victim} restarted", _exact(case), want, got)
    assert got["again"].status is Status.DUPLICATE, (case, got["again"])


def test_a_resumed_shard_charges_what_recovery_republished(pool: ShardPool,
                                                          tmp_path: Path) -> None:  # fmt: skip
    """Differential privacy with a secret noise key (no dp_seed): recovery republishes the
    versions after the checkpoint with new noise, so each is charged a second time
    (docs/privacy.md "A crash"), on shards as on one server: the accountant of every resumed
    shard equals a resumed single server's after the same calls, and has spent more than
    an uninterrupted run."""
    case = "fedbuff+secure-dp"
    runs = _runs({"sharded": (case, 2, "all"), "single": (case, 1, "all"),
                  "uninterrupted": (case, 1, None)}, pool, tmp_path)  # fmt: skip
    sharded, single, uninterrupted = runs["sharded"], runs["single"], runs["uninterrupted"]
    assert sharded["answers"] == single["answers"] == uninterrupted["answers"]
    for point in ("at crash", "end"):
        want = single[point][0]["strategy"]["privacy"]
        for r, state in enumerate(sharded[point]):
            diff = _differences(state["strategy"]["privacy"], want, exact=False)
            assert not diff, f"shard {r}'s accountant {point}: {diff}"
        plain = uninterrupted[point][0]["strategy"]["privacy"]
        assert max(want["spent"].values()) > max(plain["spent"].values()), (want, plain)


def test_every_strategy_has_a_case() -> None:
    assert {_strategy(c) for c in CASES} == set(STRATEGIES)
