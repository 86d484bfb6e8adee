"""Fed-OGD (docs/algorithms/fedogd.md): server traces against float64 oracles, the client projection
inside ``train()``, epochs and detection, the privacy variant, state round trips, a short run."""

from __future__ import annotations

import dataclasses
import io
from typing import Any

import pytest
import torch
from torch import nn

from aggsrv.client.train import _FlatSGD, train
from aggsrv.layout import ModelLayout
from aggsrv.strategies.base import Strategy
from aggsrv.strategies.errors import InvalidUpdate
from aggsrv.strategies.fedogd import FedOGD, FedOGDConfig
from aggsrv.values import ProjectionMode, Recipe, Status, Update, UpdateKind

LAYOUT = ModelLayout.from_named_shapes([("fc.weight", (2, 3)), ("fc.bias", (2,)), ("out.w", (3,))])
D = LAYOUT.numel  # 11


def close64(actual: torch.Tensor, oracle: torch.Tensor) -> None:
    """float32 result against a float64 oracle: a few float32 roundings of values ~1."""
    torch.testing.assert_close(actual.double(), oracle, rtol=1e-6, atol=1e-6)


class Driver:
    """Submits updates for the outstanding jobs of a strategy, with unique update ids."""

    def __init__(self, s: Strategy) -> None:
        self.s = s
        self.n = 0

    def submit(
        self, cid: str, delta: torch.Tensor, t: float, kind: UpdateKind = UpdateKind.DELTA
    ) -> Any:
        job = self.s.outstanding_job(cid)
        assert job is not None, cid
        self.n += 1
        tensor = delta if kind is UpdateKind.DELTA else job.weights + delta
        upd = Update(cid, job.job_id, job.base_version, f"u{self.n}", 10, 1.0, kind, tensor)
        return self.s.on_update(upd, t)


def fresh(gen: torch.Generator, scale: float = 0.1) -> torch.Tensor:
    return torch.randn(D, generator=gen) * scale


# ----------------------------------------------------------------------------- server traces


@pytest.mark.parametrize("aggregation", ["group_sum", "uniform_mean"])
@pytest.mark.parametrize("count_empty", [False, True])
def test_hand_trace_bases_step_cross_assignment_and_reuse(
    aggregation: str, count_empty: bool
) -> None:
    gen = torch.Generator().manual_seed(11)
    w0 = torch.randn(D, generator=gen)
    lr, glr = 0.1, 0.5
    cfg = {
        "tiers": {"a1": 1, "a2": 1, "s1": 3},
        "detect": False,
        "learning_rate": lr,
        "server_lr": glr,
        "epoch_timeout": None,
        "aggregation": aggregation,
        "count_empty_rows": count_empty,
    }
    s = FedOGD(LAYOUT, w0, cfg)
    drv = Driver(s)
    for c in ("a1", "a2", "s1"):
        s.on_register(c, 0.0)
    jobs = {c: s.job_for(c, 0.0) for c in ("a1", "a2", "s1")}
    for job in jobs.values():  # both bases are zero at t = 0
        assert job.recipe.projection is ProjectionMode.WHOLE and job.recipe.only_conflicting
        assert torch.equal(job.tensors["basis"], torch.zeros(D))
    assert (s.group_of("a1"), s.group_of("s1")) == ("A", "S")

    rows: dict[str, torch.Tensor] = {}

    def oracle_step(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        a = [rows[c] for c in ("a1", "a2") if c in rows]
        st = [rows.get("s1", torch.zeros(D, dtype=torch.float64))] if count_empty else []
        if "s1" in rows and not count_empty:
            st = [rows["s1"]]
        b_a = torch.stack(a).mean(0)
        b_s = torch.stack(st).mean(0) if st else torch.zeros(D, dtype=torch.float64)
        if aggregation == "group_sum":
            step = b_a + b_s
        else:
            counted = a + st
            step = torch.stack(counted).mean(0)
        return w - glr * step, b_a, b_s

    def send(c: str, t: float) -> Any:
        d = fresh(gen)
        rows[c] = -d.double() / lr  # the pseudo-gradient -DELTA / lr
        return drv.submit(c, d, t)

    # Epoch 0: the two active clients close it; the straggler is still working.
    assert send("a1", 1.0).status is Status.BUFFERED
    assert s.job_for("a1", 1.0) is None  # reported: waits for the next epoch
    out = send("a2", 1.0)
    assert (out.status, out.version) == (Status.APPLIED, 1)
    w1, b_a, b_s = oracle_step(w0.double())
    close64(s.global_model(), w1)
    close64(s.bases[0], b_a)
    close64(s.bases[1], b_s)

    # Epoch 1: the straggler's job (from v0) lands, then the actives close the epoch.
    ja = s.job_for("a1", 1.0)
    assert ja.base_version == 1 and torch.equal(ja.tensors["basis"], s.bases[1])
    s.job_for("a2", 1.0)
    out = send("s1", 2.0)
    assert (out.status, out.version) == (Status.BUFFERED, 1)
    send("a1", 2.0)
    assert send("a2", 2.0).version == 2
    w2, b_a, b_s = oracle_step(w1)
    close64(s.global_model(), w2)
    close64(s.bases[1], b_s)

    # Epoch 2: actives get b_S, the straggler gets b_A (spec G1); its stale row is reused.
    js = s.job_for("s1", 2.0)
    ja = s.job_for("a1", 2.0)
    assert torch.equal(js.tensors["basis"], s.bases[0])
    assert torch.equal(ja.tensors["basis"], s.bases[1])
    close64(js.tensors["basis"], b_a)
    close64(ja.tensors["basis"], b_s)
    s.job_for("a2", 2.0)
    send("a1", 3.0)
    assert send("a2", 3.0).version == 3
    w3, _, _ = oracle_step(w2)
    close64(s.global_model(), w3)

    # The straggler's next update overwrites its row (no accumulation, no staleness weight).
    s.job_for("a1", 3.0)
    s.job_for("a2", 3.0)
    send("s1", 4.0)
    send("a1", 4.0)
    send("a2", 4.0)
    w4, _, _ = oracle_step(w3)
    close64(s.global_model(), w4)


def test_sign_and_scale_one_client_reproduces_its_local_weights() -> None:
    """Acceptance check 2: one group, no projection, server_lr = lr, one client -> FedAvg."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    layout = ModelLayout.from_module(model)
    s = FedOGD(
        layout,
        layout.flatten(model),
        {"learning_rate": 0.1, "server_lr": 0.1, "projection": "none", "local_steps": 3},
    )
    s.on_register("c", 0.0)
    job = s.job_for("c", 0.0)
    assert "basis" not in job.tensors and job.recipe.projection is ProjectionMode.NONE
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 4, generator=gen), torch.randint(0, 3, (4,), generator=gen))]
    res = train(model, batches * 3, job.recipe, job.weights, layout=layout)
    Driver(s).submit("c", res.delta, 1.0)
    assert s.version == 1
    torch.testing.assert_close(s.global_model(), res.weights, rtol=0, atol=2e-7)


def test_empty_straggler_group_without_projection_is_plain_cache_averaging() -> None:
    gen = torch.Generator().manual_seed(5)
    w0 = torch.randn(D, generator=gen)
    s = FedOGD(LAYOUT, w0, {"projection": "none", "server_lr": 0.3, "epoch_timeout": None,
                            "learning_rate": 0.01})  # fmt: skip
    drv = Driver(s)
    cids = [f"c{i}" for i in range(4)]
    cache = {}
    w = w0.double()
    for epoch in range(3):
        # Growing participation (a client joins each epoch); older rows are reused.
        for c in cids[: 2 + epoch]:
            s.on_register(c, float(epoch))
            s.job_for(c, float(epoch))
        for c in cids[: 2 + epoch]:
            d = fresh(gen)
            cache[c] = -d.double() / 0.01
            drv.submit(c, d, epoch + 0.5)
        assert s.version == epoch + 1
        w = w - 0.3 * torch.stack(list(cache.values())).mean(0)
        close64(s.global_model(), w)
        assert torch.equal(s.bases[1], torch.zeros(D))
        assert all(s.group_of(c) == "A" for c in cids[: 2 + epoch])


def test_authors_code_preset_by_hand() -> None:
    """docs/algorithms/fedogd.md 2.10 authors-code preset: momentum 0.1 in the recipe, eta_l 0.01,
    and a step of eta_g = 0.003 times the uniform mean over all K rows, a never-uploaded row
    counting as 0."""
    gen = torch.Generator().manual_seed(8)
    w0 = torch.randn(D, generator=gen)
    # "never" is a straggler (not waited for) that never uploads: its row counts as zero.
    cfg = FedOGDConfig.from_dict({"preset": "authors_code", "epoch_timeout": None,
                                  "projection": "none", "tiers": {"never": 2}})  # fmt: skip
    assert (cfg.momentum, cfg.learning_rate, cfg.server_lr) == (0.1, 0.01, 0.003)
    assert cfg.aggregation == "uniform_mean" and cfg.count_empty_rows
    s = FedOGD(LAYOUT, w0, cfg)
    drv = Driver(s)
    for c in ("a", "b", "never"):
        s.on_register(c, 0.0)
    assert s.job_for("a", 0.0).recipe.momentum == 0.1
    s.job_for("b", 0.0)
    da, db = fresh(gen), fresh(gen)
    drv.submit("a", da, 0.5)
    drv.submit("b", db, 0.6)
    assert s.version == 1
    rows = torch.stack(
        [-da.double() / 0.01, -db.double() / 0.01, torch.zeros(D, dtype=torch.float64)]
    )
    close64(s.global_model(), w0.double() - 0.003 * rows.mean(0))
    # A key given beside the preset wins.
    assert FedOGDConfig.from_dict({"preset": "authors_code", "server_lr": 0.01}).server_lr == 0.01
    with pytest.raises(ValueError, match="unknown FedOGDConfig preset 'authors-code'; presets: "):
        FedOGDConfig.from_dict({"preset": "authors-code"})
    with pytest.raises(ValueError, match="unknown FedOGDConfig preset"):
        FedOGDConfig(preset="nope")


def test_fixed_tier_schedule_matches_the_paper_timing() -> None:
    """Acceptance check 4 in small: periods {1,1,1,3,5}: arrivals per epoch and staleness."""
    periods = {"a0": 1, "a1": 1, "a2": 1, "b": 3, "c": 5}
    s = FedOGD(LAYOUT, torch.zeros(D), {"tiers": periods, "detect": False, "epoch_timeout": None})
    drv = Driver(s)
    gen = torch.Generator().manual_seed(2)
    for c in periods:
        s.on_register(c, 0.0)
    busy: dict[str, int] = {}
    for t in range(15):
        for c in periods:
            if c not in busy:
                job = s.job_for(c, float(t))
                assert job is not None and job.base_version == t
                busy[c] = t
        due = [c for c in ("b", "c", "a0", "a1", "a2") if busy[c] + periods[c] - 1 == t]
        assert len(due) == 3 + ((t + 1) % 3 == 0) + ((t + 1) % 5 == 0)
        for c in due:
            assert s.staleness(s.outstanding_job(c)) == periods[c] - 1
            out = drv.submit(c, fresh(gen), t + 0.5)
            del busy[c]
        assert (out.status, out.version) == (Status.APPLIED, t + 1)


# ----------------------------------------------------------------------------- detection


def test_deadline_detection_moves_late_clients_and_back() -> None:
    gen = torch.Generator().manual_seed(3)
    s = FedOGD(LAYOUT, torch.randn(D, generator=gen), {"epoch_timeout": 10.0})
    drv = Driver(s)
    for c in ("c0", "c1", "c2"):
        s.on_register(c, 0.0)
        s.job_for(c, 0.0)
    assert s.next_deadline() == 10.0
    drv.submit("c0", fresh(gen), 1.0)
    assert drv.submit("c1", fresh(gen), 1.0).status is Status.BUFFERED  # c2 still pending
    s.on_timer(9.0)
    assert s.version == 0
    s.on_timer(10.0)
    assert s.version == 1 and s.group_of("c2") == "S" and s.next_deadline() == 20.0
    s.job_for("c0", 10.0)
    s.job_for("c1", 10.0)
    drv.submit("c2", fresh(gen), 12.0)  # late: stays a straggler
    drv.submit("c0", fresh(gen), 13.0)
    assert drv.submit("c1", fresh(gen), 13.0).version == 2
    assert s.group_of("c2") == "S"
    assert torch.count_nonzero(s.bases[1]) > 0  # its row now forms b_S
    for c in ("c0", "c1", "c2"):
        job = s.job_for(c, 13.0)
    assert torch.equal(job.tensors["basis"], s.bases[0])  # a straggler gets b_A
    drv.submit("c2", fresh(gen), 14.0)  # on time this epoch
    drv.submit("c0", fresh(gen), 14.0)
    drv.submit("c1", fresh(gen), 14.0)
    assert s.version == 3 and s.group_of("c2") == "A"


# ----------------------------------------------------------------------------- epoch membership


def test_a_straggler_upload_right_after_a_close_does_not_close_the_next_epoch() -> None:
    """Spec S1: the epoch that opens at a close has dispatched every idle client, so it waits
    for the active clients that just reported even before they ask for their next job; a
    straggler's upload arriving first is buffered, and the model moves once per epoch."""
    gen = torch.Generator().manual_seed(21)
    w0 = torch.randn(D, generator=gen)
    lr, glr = 0.1, 0.5
    cfg = {"tiers": {"s1": 3}, "detect": False, "epoch_timeout": None,
           "learning_rate": lr, "server_lr": glr}  # fmt: skip
    s = FedOGD(LAYOUT, w0, cfg)
    drv = Driver(s)
    for c in ("a1", "a2", "s1"):
        s.on_register(c, 0.0)
        s.job_for(c, 0.0)
    d = {k: fresh(gen) for k in ("a1", "a2", "s1", "a1'", "a2'")}
    drv.submit("a1", d["a1"], 1.0)
    assert drv.submit("a2", d["a2"], 1.0).version == 1
    w1 = s.global_model().clone()
    out = drv.submit("s1", d["s1"], 1.0)  # before a1 and a2 ask for their next jobs
    assert (out.status, out.version) == (Status.BUFFERED, 1)
    assert torch.equal(s.global_model(), w1)
    for c in ("a1", "a2"):
        assert s.job_for(c, 2.0).base_version == 1
    drv.submit("a1", d["a1'"], 2.0)
    assert drv.submit("a2", d["a2'"], 2.0).version == 2
    g = {k: -v.double() / lr for k, v in d.items()}
    close64(s.global_model(), w1.double() - glr * ((g["a1'"] + g["a2'"]) / 2 + g["s1"]))


# Each client's RPCs in its own order at virtual times (a4 joins late; s1 is a period-3
# straggler; a3 misses the deadline of the epoch that opens at t = 1 and a4 joins it).
SCRIPT: dict[str, list[tuple[float, str]]] = {
    "a1": [(0, "register"), (0, "job"), (1, "upload"), (2, "job"), (3, "upload"), (11, "job"),
           (12, "upload"), (13, "job"), (14, "upload"), (15, "job"), (16, "upload")],
    "a2": [(0, "register"), (0, "job"), (1, "upload"), (2, "job"), (3, "upload"), (11, "job"),
           (12, "upload"), (13, "job"), (14, "upload"), (15, "job"), (16, "upload")],
    "a3": [(0, "register"), (0, "job"), (1, "upload"), (2, "job"), (11, "upload"), (13, "job"),
           (14, "upload"), (15, "job"), (16, "upload")],
    "a4": [(4, "register"), (4, "job"), (11, "upload"), (13, "job"), (14, "upload"), (15, "job"),
           (16, "upload")],
    "s1": [(0, "register"), (0, "job"), (2, "upload"), (11, "job"), (15, "upload")],
}  # fmt: skip
# The intended epochs (spec 2.4/2.6): the cache rows, as (client, its n-th upload), that each
# close averages; s1 is the straggler group.
EPOCHS = [
    {"a1": 1, "a2": 1, "a3": 1},
    {"a1": 2, "a2": 2, "a3": 1, "s1": 1},  # closed by the deadline at t = 11
    {"a1": 3, "a2": 3, "a3": 2, "a4": 1, "s1": 1},
    {"a1": 4, "a2": 4, "a3": 3, "a4": 2, "s1": 1},
    {"a1": 5, "a2": 5, "a3": 4, "a4": 3, "s1": 2},
]


def replay(
    order: str, seed: int, deltas: dict[tuple[str, int], torch.Tensor], restore_at: float = -1
) -> FedOGD:
    """Deliver SCRIPT with the clients' RPCs of each time interleaved: by client name
    ("ascending"/"descending") or at random; a job request answered None is retried after the
    other RPCs of its time, as a polling client would. Before time ``restore_at`` the
    strategy is saved and replaced by a fresh one that loads the state."""
    cfg = {"tiers": {"s1": 3}, "detect": False, "epoch_timeout": 10.0,
           "learning_rate": 0.1, "server_lr": 0.5}  # fmt: skip
    s = FedOGD(LAYOUT, torch.linspace(-1, 1, D), cfg)
    rng = torch.Generator().manual_seed(seed)
    sent = dict.fromkeys(SCRIPT, 0)
    n = 0
    for t in sorted({t for acts in SCRIPT.values() for t, _ in acts}):
        if t == restore_at:
            buf = io.BytesIO()
            torch.save(s.state_dict(), buf)
            buf.seek(0)
            s = FedOGD(LAYOUT, torch.zeros(D), cfg)
            s.load_state_dict(torch.load(buf, weights_only=False))
        s.on_timer(float(t))
        queues = {c: [a for tt, a in acts if tt == t] for c, acts in SCRIPT.items()}
        queues = {c: q for c, q in queues.items() if q}
        retry: list[str] = []
        while queues:
            names = sorted(queues, reverse=order == "descending")
            if order == "random":
                names = [names[int(torch.randint(len(names), (1,), generator=rng))]]
            c = names[0]
            action = queues[c].pop(0)
            if not queues[c]:
                del queues[c]
            if action == "register":
                s.on_register(c, float(t))
            elif action == "job":
                if s.job_for(c, float(t)) is None:
                    retry.append(c)
            else:
                job = s.outstanding_job(c)
                assert job is not None, (order, seed, t, c)
                sent[c] += 1
                n += 1
                upd = Update(c, job.job_id, job.base_version, f"u{n}", 10, 1.0,
                             UpdateKind.DELTA, deltas[c, sent[c]])  # fmt: skip
                s.on_update(upd, float(t))
        for c in retry:
            assert s.job_for(c, float(t)) is not None, (order, seed, t, c)
    return s


def test_epoch_membership_does_not_depend_on_the_order_rpcs_arrive_in() -> None:
    """The same registrations, job requests and uploads at the same virtual times, the RPCs of
    each time arriving in different orders (and once through a state-dict round trip): the
    same model bit for bit, one version per intended epoch, equal to a float64 oracle of
    those epochs."""
    gen = torch.Generator().manual_seed(17)
    uploads = {c: sum(a == "upload" for _, a in acts) for c, acts in SCRIPT.items()}
    deltas = {(c, k): fresh(gen) for c in SCRIPT for k in range(1, uploads[c] + 1)}
    runs = [replay("ascending", 0, deltas), replay("descending", 0, deltas)]
    runs += [replay("random", seed, deltas) for seed in range(4)]
    # Saved right after a close, while the new epoch waits for members that have not asked yet.
    runs.append(replay("descending", 0, deltas, restore_at=2))
    w = torch.linspace(-1, 1, D).double()
    for rows in EPOCHS:
        g = {c: -deltas[c, k].double() / 0.1 for c, k in rows.items()}
        b_a = torch.stack([v for c, v in g.items() if c != "s1"]).mean(0)
        b_s = g.get("s1", torch.zeros(D, dtype=torch.float64))
        w = w - 0.5 * (b_a + b_s)
    for s in runs:
        assert s.version == len(EPOCHS)
        assert torch.equal(s.global_model(), runs[0].global_model())
        assert torch.equal(s.bases[0], runs[0].bases[0])
        assert torch.equal(s.bases[1], runs[0].bases[1])
    close64(runs[0].global_model(), w)


def test_deadline_without_updates_is_extended() -> None:
    s = FedOGD(LAYOUT, torch.zeros(D), {"epoch_timeout": 5.0, "min_available": 2})
    s.on_register("c0", 0.0)
    assert s.job_for("c0", 0.0) is None and s.next_deadline() is None  # waits for 2 clients
    s.on_register("c1", 1.0)
    s.job_for("c0", 1.0)
    s.on_timer(6.0)
    assert s.version == 0 and s.next_deadline() == 11.0


# ----------------------------------------------------------------------------- privacy variant


def test_send_differences_matches_the_cache_and_refuses_weights() -> None:
    tiers = {"a1": 1, "a2": 1, "s1": 2}
    base = {"tiers": tiers, "detect": False, "epoch_timeout": None, "server_lr": 0.2}
    gen = torch.Generator().manual_seed(9)
    w0 = torch.randn(D, generator=gen)
    plain = FedOGD(LAYOUT, w0, base)
    diff = FedOGD(LAYOUT, w0, {**base, "send_differences": True})
    last = {c: torch.zeros(D) for c in tiers}
    drivers = (Driver(plain), Driver(diff))
    for s in (plain, diff):
        for c in tiers:
            s.on_register(c, 0.0)
    for t in range(5):
        for s in (plain, diff):
            for c in tiers:
                if s.outstanding_job(c) is None:
                    s.job_for(c, float(t))
        order = (["s1"] if t % 2 == 1 else []) + ["a1", "a2"]
        for c in order:
            d = fresh(gen)
            drivers[0].submit(c, d, t + 0.5)
            drivers[1].submit(c, d - last[c], t + 0.5)
            last[c] = d
        torch.testing.assert_close(diff.global_model(), plain.global_model(), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(diff.bases[0], plain.bases[0], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(diff.bases[1], plain.bases[1], rtol=1e-6, atol=1e-6)
    diff.job_for("a1", 9.0)
    before = diff.state_dict()
    with pytest.raises(InvalidUpdate, match="send_differences"):
        drivers[1].submit("a1", fresh(gen), 9.5, kind=UpdateKind.WEIGHTS)
    assert_same(diff.state_dict(), before)


# ----------------------------------------------------------------------------- state


def assert_same(a: Any, b: Any, path: str = "state") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype, path
        assert torch.equal(a, b), path
    elif isinstance(a, dict):
        assert set(a) == set(b), path
        for k in a:
            assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, path


CFG = {"epoch_timeout": 10.0, "server_lr": 0.05, "learning_rate": 0.05, "tiers": {"c3": 2}}


def local_delta(job: Any, k: int) -> torch.Tensor:
    """A deterministic client: a step towards its target, bent by the job's basis."""
    target = torch.linspace(-1, 1, D) * (k + 1)
    d = (target - job.weights) * 0.1
    return d - 0.01 * job.tensors["basis"]


def phase_one(s: FedOGD, drv: Driver) -> None:
    for k in range(4):
        s.on_register(f"c{k}", 0.0)
        s.job_for(f"c{k}", 0.0)
    for k in (0, 1):
        drv.submit(f"c{k}", local_delta(s.outstanding_job(f"c{k}"), k), 1.0)
    s.on_timer(10.0)  # c2 (detected) and c3 (tier 2) are late
    for k in (0, 1):
        s.job_for(f"c{k}", 10.0)
    drv.submit("c2", local_delta(s.outstanding_job("c2"), 2), 11.0)
    drv.submit("c0", local_delta(s.outstanding_job("c0"), 0), 12.0)  # mid-epoch: c1 pending


def phase_two(s: FedOGD, drv: Driver) -> None:
    drv.submit("c1", local_delta(s.outstanding_job("c1"), 1), 12.5)
    for t in (13.0, 14.0, 15.0):
        for k in range(4):
            if s.outstanding_job(f"c{k}") is None:
                s.job_for(f"c{k}", t)
        for k in (3, 2, 0, 1):
            job = s.outstanding_job(f"c{k}")
            if job is not None and (k != 3 or t != 14.0):
                drv.submit(f"c{k}", local_delta(job, k), t + 0.5)
        s.on_timer(t + 0.9)


def test_state_dict_round_trip_resumes_bit_exactly() -> None:
    w0 = torch.linspace(0, 1, D)
    straight = FedOGD(LAYOUT, w0, CFG)
    d0 = Driver(straight)
    phase_one(straight, d0)
    phase_two(straight, d0)
    assert straight.version >= 4

    first = FedOGD(LAYOUT, w0, CFG)
    d1 = Driver(first)
    phase_one(first, d1)
    buf = io.BytesIO()
    torch.save(first.state_dict(), buf)
    buf.seek(0)
    resumed = FedOGD(LAYOUT, torch.zeros(D), CFG)
    resumed.load_state_dict(torch.load(buf, weights_only=False))
    assert_same(resumed.state_dict(), first.state_dict())
    d2 = Driver(resumed)
    d2.n = d1.n
    phase_two(resumed, d2)
    assert torch.equal(resumed.global_model(), straight.global_model())
    assert_same(resumed.state_dict(), straight.state_dict())


# ----------------------------------------------------------------------------- configs


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ({"aggregation": "mean"}, "aggregation must be"),
        ({"projection": "global"}, "projection must be"),
        ({"tiers": {"c1": 0}}, r"tiers\['c1'\] must be an integer >= 1, got 0"),
        ({"tiers": {"c1": 2.5}}, r"tiers\['c1'\] must be an integer >= 1, got 2.5 \(float\)"),
        ({"send_differences": True}, "send_differences needs fixed groups"),
        ({"server_lr": 0.0}, "server_lr must be > 0"),
        ({"epoch_timeout": -1.0}, "epoch_timeout must be > 0"),
        ({"min_updates": 0}, "min_updates must be an integer >= 1"),
        ({"hysteresis": True}, r"hysteresis must be an integer >= 1, got True \(bool\)"),
        ({"basis_eps": 1e-9}, "unknown FedOGDConfig key 'basis_eps'"),
        ({"learning_rate": 0.0}, "learning_rate must be > 0"),
    ],
)
def test_bad_configs_are_refused_clearly(config: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        FedOGDConfig.from_dict(config)


def test_layerwise_and_always_recipes() -> None:
    s = FedOGD(LAYOUT, torch.zeros(D), {"projection": "layerwise", "only_conflicting": False})
    assert s.make_recipe().projection is ProjectionMode.LAYERWISE
    assert not s.make_recipe().only_conflicting


# ----------------------------------------------------------------------------- client side


def test_direction_projects_in_place_only_when_conflicting() -> None:
    """Acceptance check 1 through the client's hook (fp32): orthogonal after a projection,
    bit-identical without a conflict or with a zero basis, and never a copy."""
    gen = torch.Generator().manual_seed(4)
    n = 1000
    w = torch.zeros(n)
    for _ in range(3):
        b = torch.randn(n, generator=gen)
        g = torch.randn(n, generator=gen)
        if float(g @ b) > 0:
            g = -g  # conflicting
        recipe = Recipe(local_epochs=1.0, projection=ProjectionMode.WHOLE, only_conflicting=True)
        sgd = _FlatSGD(w, g, w, recipe, b, None)
        keep = g.clone()
        assert sgd._direction(g) is g
        cos = float(g @ b) / (float(g.norm()) * float(b.norm()))
        assert abs(cos) < 1e-6
        oracle = keep.double() - (keep.double() @ b.double()) / (b.double() @ b.double()) * b
        close64(g, oracle)
        g2 = -keep  # not conflicting: unchanged bit for bit
        snapshot = g2.clone()
        _FlatSGD(w, g2, w, recipe, b, None)._direction(g2)
        assert torch.equal(g2, snapshot)
        _FlatSGD(w, g2, w, recipe, torch.zeros(n), None)._direction(g2)
        assert torch.equal(g2, snapshot)


def oracle_train(
    start: torch.Tensor,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    lr: float,
    basis: torch.Tensor,
    segments: list[tuple[int, int]],
    only_conflicting: bool,
) -> tuple[torch.Tensor, list[float]]:
    """Float64 re-implementation of projected SGD on nn.Linear(4, 3) (weight then bias)."""
    w = start.double().clone()
    b64 = basis.double()
    dots = []
    for x, y in batches:
        p = w.clone().requires_grad_(True)
        logits = x.double() @ p[:12].view(3, 4).T + p[12:]
        (g,) = torch.autograd.grad(nn.functional.cross_entropy(logits, y), p)
        for lo, hi in segments:
            gs, bs = g[lo:hi], b64[lo:hi]
            nb = float(bs @ bs)
            dot = float(gs @ bs)
            dots.append(dot)
            c = dot / nb if nb > 0 else 0.0
            if only_conflicting:
                c = min(c, 0.0)
            g[lo:hi] = gs - c * bs
        w = w - lr * g
    return w, dots


@pytest.mark.parametrize("mode", [ProjectionMode.WHOLE, ProjectionMode.LAYERWISE])
@pytest.mark.parametrize("only_conflicting", [True, False])
def test_train_projects_every_step_like_a_float64_oracle(
    mode: ProjectionMode, only_conflicting: bool
) -> None:
    torch.manual_seed(1)
    model = nn.Linear(4, 3)
    layout = ModelLayout.from_module(model)
    start = layout.flatten(model).clone()
    gen = torch.Generator().manual_seed(8)
    batches = [
        (torch.randn(5, 4, generator=gen), torch.randint(0, 3, (5,), generator=gen))
        for _ in range(4)
    ]
    # The first step's gradient, negated: the projection fires on the first steps.
    x, y = batches[0]
    loss = nn.functional.cross_entropy(model(x), y)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    basis = -torch.cat([t.reshape(-1) for t in grads]).detach() + 0.05 * torch.randn(
        layout.numel, generator=gen
    )
    segments = [(0, 12), (12, 15)] if mode is ProjectionMode.LAYERWISE else [(0, 15)]
    lr = 0.5
    recipe = Recipe(
        local_epochs=None,
        local_steps=4,
        learning_rate=lr,
        batch_size=5,
        projection=mode,
        only_conflicting=only_conflicting,
    )
    res = train(model, batches, recipe, start, layout=layout, basis=basis)
    oracle, dots = oracle_train(start, batches, lr, basis, segments, only_conflicting)
    assert min(dots) < 0  # the projection had something to do
    torch.testing.assert_close(res.weights.double(), oracle, rtol=1e-5, atol=1e-6)
    plain = train(model, batches, Recipe(local_epochs=None, local_steps=4, learning_rate=lr), start)
    assert not torch.allclose(plain.weights, res.weights)

    # One step with the basis along the step's own gradient (no conflict in any segment):
    # only_conflicting leaves plain SGD bit for bit; "always" still projects.
    one = dataclasses.replace(recipe, local_steps=1)
    _, dots = oracle_train(start, batches[:1], lr, -basis, segments, True)
    assert min(dots) > 0
    one_plain = train(model, batches[:1], dataclasses.replace(one, projection="NONE"), start)
    same = train(model, batches[:1], one, start, layout=layout, basis=-basis)
    assert torch.equal(same.weights, one_plain.weights) == only_conflicting
    # A zero basis, or none: plain SGD bit for bit.
    for b in (torch.zeros(layout.numel), None):
        again = train(model, batches, recipe, start, layout=layout, basis=b)
        assert torch.equal(again.weights, plain.weights)


def test_train_refuses_an_unknown_projection_mode() -> None:
    class Odd:
        local_epochs = None
        local_steps = 1
        learning_rate = 0.1
        batch_size = 2
        momentum = weight_decay = proximal_mu = elastic_lambda = elastic_alpha = 0.0
        projection = "DIAGONAL"
        only_conflicting = True
        extra: dict[str, float] = {}

    model = nn.Linear(2, 2)
    start = ModelLayout.from_module(model).flatten(model)
    with pytest.raises(ValueError, match="projection must be NONE, WHOLE or LAYERWISE"):
        train(model, [(torch.randn(2, 2), torch.tensor([0, 1]))], Odd(), start)


# ----------------------------------------------------------------------------- simulation


def test_short_simulated_run_learns(tmp_path) -> None:
    from aggsrv import sim

    res = sim.run(
        {
            "strategy": "aggsrv.strategies.fedogd:FedOGD",
            "strategy_config": {
                "learning_rate": 0.05,
                "server_lr": 0.05,
                "batch_size": 16,
                "epoch_timeout": 1.5,
            },
            "transport": "inproc",
            "dataset": "digits",
            "clients": 5,
            "model": "mlp",
            "profile": "tiers",
            "budget": "6s",
            "eval_every": "1s",
            "seed": 3,
            "out": str(tmp_path),
        },
        progress=False,
    )
    accs = [m["test_accuracy"] for m in res.metrics]
    assert accs[0] < 0.2 and res.final_accuracy > 0.6


def test_paper_preset_is_the_papers_rates_and_the_defaults_learn_faster() -> None:
    """docs/algorithms/fedogd.md 2.10 paper preset: plain SGD, group_sum, whole-model conditional
    projection, eta_l = 0.01, eta_g = 0.0015. The defaults keep the algorithm and set eta_g = eta_l
    = 0.05 (server_lr None); a close with the preset steps eta_g times the sum of the group
    bases."""
    paper = FedOGDConfig.from_dict({"preset": "paper"})
    assert (paper.learning_rate, paper.server_lr, paper.momentum) == (0.01, 0.0015, 0.0)
    assert (paper.aggregation, paper.projection, paper.only_conflicting) == (
        "group_sum", "whole", True
    )  # fmt: skip
    assert not paper.count_empty_rows and paper.effective_server_lr == 0.0015
    default = FedOGDConfig()
    assert default.preset is None and default.server_lr is None
    assert (default.learning_rate, default.effective_server_lr) == (0.05, 0.05)
    # Apart from the two rates, the preset and the defaults are the same algorithm.
    assert dataclasses.replace(paper, learning_rate=0.05, server_lr=None, preset=None) == default
    assert FedOGDConfig.from_dict({"preset": "paper", "server_lr": 0.01}).server_lr == 0.01
    assert set(FedOGDConfig.PRESET_NOTES) == {"paper", "authors_code"} == set(FedOGDConfig.PRESETS)
    # The preset's step, by hand: one active client, eta_g * (b_A + 0).
    gen = torch.Generator().manual_seed(12)
    w0 = torch.randn(D, generator=gen)
    s = FedOGD(LAYOUT, w0, FedOGDConfig.from_dict({"preset": "paper", "epoch_timeout": None}))
    s.on_register("a", 0.0)
    s.job_for("a", 0.0)
    d = fresh(gen)
    Driver(s).submit("a", d, 0.5)
    assert s.version == 1
    close64(s.global_model(), w0.double() - 0.0015 * (-d.double() / 0.01))
