"""Side channels of differential privacy: with the dp_ keys on, nothing a non-admin can read
(GetStatus with a client token or without authentication, /api/status and the page, the
Prometheus port) carries a quantity that depends on what some update holds (clip counts,
norms, cosines, refusals for the update's values), while an admin's GetStatus still does, and
a server without DP shows everything as before. A NaN/Inf update under DP is not refused (a
refusal would say so to everyone) but clipped to zero: published like its zero-out
neighbour, and only its client is told. Real pushes over gRPC on loopback, fresh random
updates of odd sizes."""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
import pkgutil
import re
import urllib.request
from pathlib import Path

import grpc
import pytest
import torch
from browser import wait_until
from server_helpers import RunningServer, scrape_metrics

import aggsrv.server
import aggsrv.strategies
import aggsrv.transport.errors as codec_errors
from aggsrv.client.client import Client
from aggsrv.layout import ModelLayout
from aggsrv.server import auth as A
from aggsrv.server.disclosure import (
    DATA_REASONS,
    DATA_SERIES,
    PUBLIC_REASONS,
    class_reason,
)
from aggsrv.strategies import Status, Update, UpdateKind, make_strategy
from aggsrv.strategies.errors import NonFiniteUpdate, StrategyError
from aggsrv.transport import Decoder, NonFinite, StagingSlot
from aggsrv.transport.crc import Crc32c

pytest.importorskip("dp_accounting", reason="the dp extra (pip install 'aggsrv[dp]')")

REPO = Path(__file__).resolve().parents[2]
LAYOUT = ModelLayout.from_named_shapes([("enc.weight", (37, 5)), ("enc.bias", (13,))])  # D=198
D = LAYOUT.numel
BIG = 3.35e38  # the model's first element: one unclipped step of 1e37 there overflows float32


def _seeded() -> torch.Generator:
    return torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))


# ---------------------------------------------------------------------- the classification


def _refusal_reasons() -> set[str]:
    """Every reason a refused upload can be counted under: the classes of the strategies' and
    the codec's refusals (every subclass, wherever it is defined), the reasons the request
    checks name, and the default."""
    for package in (aggsrv.strategies, aggsrv.server):
        for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            importlib.import_module(info.name)

    def subclasses(cls: type) -> set[type]:
        found = {cls}
        for sub in cls.__subclasses__():
            found |= subclasses(sub)
        return found

    reasons = {class_reason(c) for c in subclasses(StrategyError)}
    reasons |= {class_reason(c) for c in subclasses(codec_errors.CodecError)}
    named = re.compile(r"""(?:reason=|REFUSAL_REASON\.set\()\s*["']([a-z_]+)["']""")
    for path in (REPO / "aggsrv" / "server").rglob("*.py"):
        reasons |= set(named.findall(path.read_text()))
    return reasons | {"request"}


def test_every_refusal_reason_is_classified_public_or_data() -> None:
    reasons = _refusal_reasons()
    # The ones this test must find, or it looks in the wrong places.
    assert {"non_finite", "non_finite_update", "non_finite_result", "update_norm_too_large",
            "too_stale", "checksum_mismatch", "rate_limited", "credentials",
            "slice_missing", "privacy_budget_spent"} <= reasons  # fmt: skip
    assert not PUBLIC_REASONS & DATA_REASONS
    assert reasons - (PUBLIC_REASONS | DATA_REASONS) == set(), "classify these reasons"
    assert (PUBLIC_REASONS | DATA_REASONS) - reasons == set(), "no such reason any more"


# ---------------------------------------------------------------------- the decoder


def _decode(values: torch.Tensor, **flags) -> Decoder:
    slot = StagingSlot(values.numel())
    decoder = Decoder(slot, {"update": values.numel()}, "float32", 1 << 20, **flags)
    data = values.numpy().tobytes()
    decoder.feed("update", 0, data)
    crc = Crc32c()
    crc.update(data)
    decoder.finish(crc.value, len(data))
    return decoder


def test_the_decoder_leaves_non_finite_values_to_the_strategy_only_when_asked() -> None:
    values = torch.randn(D, generator=_seeded())
    values[int(torch.randint(D, ()))] = float("inf")
    with pytest.raises(NonFinite):
        _decode(values, exact_norm=True)
    decoder = _decode(values, exact_norm=True, refuse_non_finite=False)
    assert decoder.non_finite and decoder.norm is None and not decoder.norm_exact
    fine = _decode(values.nan_to_num(posinf=0.0), exact_norm=True, refuse_non_finite=False)
    assert not fine.non_finite and fine.norm_exact and math.isfinite(fine.norm)


# ---------------------------------------------------------------------- strategies


class Sender:
    """Registers clients and sends updates through on_update: a DELTA, or WEIGHTS (the job's
    weights plus the delta); ``delta`` may be a function of the job's weights giving the
    tensor to send as it is."""

    def __init__(self, strategy, names: str) -> None:
        self.s, self.n = strategy, 0
        for c in names:
            strategy.on_register(c, 0.0)

    def send(self, client: str, delta, kind=UpdateKind.DELTA):
        job = self.s.job_for(client, float(self.n))
        assert job is not None
        if callable(delta):
            tensor = delta(job.weights)
        else:
            tensor = delta if kind is UpdateKind.DELTA else job.weights + delta
        self.n += 1
        update = Update(client, job.job_id, job.base_version, f"u{self.n}", 1, 1.0, kind,
                        tensor.float())  # fmt: skip
        return self.s.on_update(update, float(self.n))


STRATEGIES = {
    "fedbuff": {"buffer_size": 2},
    "fedasync": {},
    "ca2fl": {"buffer_size": 2},
    "fedavg": {"mode": "k_async", "k": 2},
}


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_a_non_finite_update_under_dp_is_published_like_its_zero_out_neighbour(name) -> None:
    """Two federations with the same noise seed: in one, client b sends NaN (DELTA), +Inf
    (WEIGHTS) and finite weights whose delta overflows float32 (WEIGHTS); in the other (its
    zero-out neighbour) b sends zero deltas. Every published model is bitwise the same, so
    is epsilon, and b's answers say its updates were clipped."""
    rng = _seeded()
    x0 = torch.randn(D, generator=rng)
    x0[3] = -1e38  # weights of 3e38 there are finite, their delta is not
    keys = {**STRATEGIES[name], "dp_clip_norm": 0.7, "dp_noise_multiplier": 0.6,
            "dp_seed": 5, "dp_insecure_seed": True}  # fmt: skip
    here = make_strategy(name, layout=LAYOUT, initial=x0, config=keys)
    there = make_strategy(name, layout=LAYOUT, initial=x0, config=keys)
    ours, theirs = Sender(here, "ab"), Sender(there, "ab")
    nan = torch.randn(D, generator=rng)
    nan[int(torch.randint(D, (), generator=rng))] = float("nan")

    def inf(weights: torch.Tensor) -> torch.Tensor:
        w = weights.clone()
        w[-1] = float("inf")
        return w

    def huge(weights: torch.Tensor) -> torch.Tensor:
        w = weights.clone()
        w[3] = 3e38
        return w

    for bad, kind in [(nan, UpdateKind.DELTA), (inf, UpdateKind.WEIGHTS),
                      (huge, UpdateKind.WEIGHTS)]:  # fmt: skip
        d = torch.randn(D, generator=rng) * 3.0  # clipped
        ours.send("a", d)
        theirs.send("a", d)
        answer = ours.send("b", bad, kind)
        neighbour = theirs.send("b", torch.zeros(D), kind)
        assert answer.clipped and "clipped to zero" in answer.detail
        assert answer.status is neighbour.status and answer.version == neighbour.version
        assert torch.equal(here.global_model(), there.global_model())
        assert torch.isfinite(here.global_model()).all()
    assert here.version == there.version >= 2
    assert here.privacy.accountant.epsilon() == there.privacy.accountant.epsilon()
    assert here.privacy.clipped == there.privacy.clipped + 3


def test_without_dp_a_non_finite_update_is_still_refused() -> None:
    s = make_strategy("fedbuff", layout=LAYOUT, initial=torch.zeros(D), config={"buffer_size": 2})
    sender = Sender(s, "a")
    bad = torch.randn(D, generator=_seeded())
    bad[7] = float("nan")
    before = s.state_dict()
    with pytest.raises(NonFiniteUpdate):
        sender.send("a", bad)
    assert s.version == 0 and s.ledger.lookup("a", "u1") is None
    assert before["model"].equal(s.state_dict()["model"])


def test_a_non_finite_slice_on_one_shard_zeroes_the_update_on_every_shard() -> None:
    """Two shards (threads): only rank 1's slice of b's update holds NaN. Both shards take it
    as clipped to zero (the clip factor is the whole model's: one shard's infinity reaches
    every shard through the summed squares), and the joined model equals that of the same
    federation sent zeros."""
    from thread_shards import reducers, run_shards

    from aggsrv.sharding import ShardLayout, ShardMap

    whole = ModelLayout.from_named_shapes([("w", (67,)), ("b", (6,))])
    n = whole.numel
    shard_map = ShardMap.even(n, 2, align=8)
    rng = _seeded()
    x0 = torch.randn(n, generator=rng)
    good = [torch.randn(n, generator=rng) * 2 for _ in range(2)]
    bad = torch.randn(n, generator=rng)
    bad[n - 3] = float("nan")  # in rank 1's slice
    keys = {"buffer_size": 2, "dp_clip_norm": 1.0, "dp_noise_multiplier": 0.0}

    def run(b_sends: torch.Tensor, layers: str) -> tuple[torch.Tensor, list[int]]:
        models: list = [None, None]
        clipped = [0, 0]
        sums = reducers(2)

        def shard(r: int) -> None:
            layout = ShardLayout(whole, shard_map, r)
            s = make_strategy("fedbuff", layout=layout, initial=layout.local(x0).contiguous(),
                              config={**keys, "dp_clip_layers": layers},
                              reducer=sums[r])  # fmt: skip
            for c in "ab":
                s.on_register(c, 0.0)
            for i, (c, d) in enumerate([("a", good[0]), ("b", b_sends), ("a", good[1])]):
                job = s.job_for(c, float(i))
                update = Update(c, job.job_id, job.base_version, f"u{i}", 1, 1.0,
                                UpdateKind.DELTA, layout.local(d).contiguous())  # fmt: skip
                s.on_update(update, float(i))
            models[r], clipped[r] = s.global_model().clone(), s.privacy.clipped

        run_shards(shard, 2)
        return torch.cat(models), clipped

    for layers in ("whole", "equal"):
        model, clipped = run(bad, layers)
        neighbour, theirs = run(torch.zeros(n), layers)
        assert torch.equal(model, neighbour), layers
        assert clipped[0] == clipped[1] == theirs[0] + 1, (layers, clipped, theirs)


# ---------------------------------------------------------------------- over gRPC


@dataclasses.dataclass
class Run:
    """What one federation showed: GetStatus for a client token and an admin token, the
    status page's JSON (raw and parsed), the Prometheus samples, the NaN pushes' answers."""

    dp: bool
    client: object
    admin: object
    page: dict
    page_text: str
    metrics: dict
    nan_answers: list
    model_moved: list


def _federate(tmp: Path, dp: bool) -> Run:
    """FedAsync (each update a version) with hmac auth; client a pushes: a clipped delta, a
    small one, a NaN delta, NaN weights, a delta that overflows the model (refused for its
    values), and one for a finished job (refused for a public reason)."""
    secret = A.new_secret()
    path = tmp / f"secret-{dp}"
    A.save_secret(path, secret)
    keys = {"dp_clip_norm": 1e38, "dp_noise_multiplier": 0.0, "dp_seed": 3,
            "dp_insecure_seed": True} if dp else {}  # fmt: skip
    srv = RunningServer(strategy="fedasync", strategy_config=keys, auth="hmac",
                        auth_secret_file=str(path), metrics_port=0, dashboard_port=0,
                        rate_limit_per_second=0.0)  # fmt: skip
    rng = _seeded()
    x0 = torch.randn(D, generator=rng)
    x0[0] = BIG
    token = A.issue_token(secret, "a")
    nan_answers, moved = [], []
    try:
        with (
            Client(srv.address, "a", token=token) as a,
            Client(srv.address, "ops", token=srv.server.admin_token) as ops,
        ):
            a.register(layout=LAYOUT, initial=x0)
            clipped = torch.randn(D, generator=rng) * 1e37  # norm ~1.4e38 > C
            clipped[0] = 0.0
            a.push(a.get_job(), clipped)
            small = a.get_job()
            a.push(small, torch.randn(D, generator=rng) * 0.01)
            for kind in (UpdateKind.DELTA, UpdateKind.WEIGHTS):
                job = a.get_job()
                bad = torch.randn(D, generator=rng) + (job.weights if kind.name == "WEIGHTS"
                                                      else 0.0)  # fmt: skip
                bad[int(torch.randint(1, D, (), generator=rng))] = float("nan")
                before = srv.model()
                try:
                    nan_answers.append(a.push(job, bad, kind=kind))
                except grpc.RpcError as exc:
                    nan_answers.append(exc)
                moved.append(not torch.equal(before, srv.model()))
            overflow = torch.zeros(D)
            overflow[0] = 1e37
            with pytest.raises(grpc.RpcError) as refused:
                a.push(a.get_job(), overflow)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "non-finite" in refused.value.details()
            with pytest.raises(grpc.RpcError) as stale:
                a.push(small, torch.randn(D, generator=rng))
            assert stale.value.code() == grpc.StatusCode.ABORTED
            rejected = 2 if dp else 4
            # A refusal is counted just after it is answered.
            wait_until(lambda: ops.status().updates_rejected == rejected, "the refusals' counts")
            client, admin = a.status(), ops.status()
        url = f"http://127.0.0.1:{srv.server.dashboard_port}/api/status"
        with urllib.request.urlopen(url, timeout=10) as resp:
            page_text = resp.read().decode()
        metrics = scrape_metrics(srv.server.metrics_port)
    finally:
        srv.stop()
    return Run(dp, client, admin, json.loads(page_text), page_text, metrics, nan_answers, moved)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[bool, Run]:
    tmp = tmp_path_factory.mktemp("channels")
    return {dp: _federate(tmp, dp) for dp in (True, False)}


def test_a_client_token_reads_no_data_dependent_quantity_under_dp(runs) -> None:
    s = runs[True].client
    assert s.data_withheld
    assert s.updates_accepted == 4 and s.updates_applied == 4  # public: who pushed when
    assert s.updates_rejected == 1 and dict(s.rejected_by_code) == {"ABORTED": 1}
    assert dict(s.filtered_by_reason) == {} and s.updates_clipped == 0
    assert s.HasField("privacy") and s.privacy.updates_clipped == 0
    assert s.privacy.releases == 4 and s.privacy.clip_norm == 1e38


def test_an_admin_token_still_reads_them_under_dp(runs) -> None:
    s = runs[True].admin
    assert not s.data_withheld
    assert s.updates_rejected == 2
    assert dict(s.rejected_by_code) == {"ABORTED": 1, "INVALID_ARGUMENT": 1}
    assert s.privacy.updates_clipped == 3  # the big delta and the two NaN updates


def test_a_nan_update_under_dp_is_clipped_to_zero_and_only_its_client_is_told(runs) -> None:
    run = runs[True]
    for answer in run.nan_answers:
        assert not isinstance(answer, grpc.RpcError), answer
        assert answer.status is Status.APPLIED and answer.clipped
        assert "clipped to zero" in answer.message
    assert run.model_moved == [False, False]  # published as its zero-out neighbour would be


def test_the_status_page_json_carries_none_under_dp(runs) -> None:
    page, text = runs[True].page, runs[True].page_text
    assert page["data_withheld"] is True
    assert page["refusals"] == {"ABORTED": 1} and page["updates"]["rejected"] == 1
    assert page["refusal_reasons"] == [{"code": "ABORTED", "reason": "job_superseded",
                                        "count": 1}]  # fmt: skip
    assert "updates_clipped" not in page["privacy"] and page["privacy"]["releases"] == 4
    assert page["strategy"]["settings"]["dp_seed"] == "withheld"
    for word in ("non_finite", "clipped", "norm_outlier", "cosine"):
        assert word not in text, word


def _family(sample: str) -> str:
    return re.sub(r"_(total|created|bucket|count|sum|gcount|gsum)$", "", sample)


def test_the_metrics_port_carries_none_under_dp(runs) -> None:
    m = runs[True].metrics
    families = {_family(name) for name, _ in m}
    assert not families & DATA_SERIES, families & DATA_SERIES
    assert "aggsrv_dp_epsilon" in families and "aggsrv_staleness" in families
    reasons = {dict(labels).get("reason") for name, labels in m if name == "aggsrv_refusals_total"}
    assert reasons == {"job_superseded"}
    outcomes = {dict(labels)["outcome"] for name, labels in m if name == "aggsrv_updates_total"}
    assert outcomes == {"applied", "aborted"}


def test_without_dp_every_channel_shows_what_it_did(runs) -> None:
    run = runs[False]
    for s in (run.client, run.admin):
        assert not s.data_withheld and not s.HasField("privacy")
        assert s.updates_rejected == 4 and s.updates_accepted == 2
        assert dict(s.rejected_by_code) == {"ABORTED": 1, "INVALID_ARGUMENT": 3}
    for answer in run.nan_answers:
        assert isinstance(answer, grpc.RpcError)
        assert answer.code() == grpc.StatusCode.INVALID_ARGUMENT
    page = run.page
    assert page["data_withheld"] is False and page["privacy"] is None
    assert page["refusals"] == {"ABORTED": 1, "INVALID_ARGUMENT": 3}
    assert {r["reason"] for r in page["refusal_reasons"]} == {
        "job_superseded", "non_finite", "non_finite_result"}  # fmt: skip
    m = run.metrics
    assert m[("aggsrv_update_norm_count", frozenset())] == 2
    assert ("aggsrv_updates_clipped_total", frozenset()) in m
    key = ("aggsrv_refusals_total", frozenset({("code", "invalid_argument"),
                                               ("reason", "non_finite")}))  # fmt: skip
    assert m[key] == 2
    assert m[("aggsrv_updates_total", frozenset({("outcome", "invalid_argument")}))] == 3


def test_without_authentication_every_caller_is_a_non_admin_under_dp() -> None:
    srv = RunningServer(strategy="fedbuff", rate_limit_per_second=0.0,
                        strategy_config={"buffer_size": 1, "dp_clip_norm": 0.1})  # fmt: skip
    try:
        with Client(srv.address, "a") as a:
            a.register(layout=LAYOUT, initial=torch.zeros(D))
            assert a.push(a.get_job(), torch.randn(D, generator=_seeded())).clipped
            status = a.status()
        assert status.data_withheld and status.privacy.updates_clipped == 0
        assert srv.strategy.privacy.clipped == 1
    finally:
        srv.stop()


def test_aggsrv_status_says_what_a_non_admin_token_does_not_read() -> None:
    from aggsrv.cli import format_status
    from aggsrv.v1 import aggregation_pb2 as pb

    privacy = pb.PrivacyStatus(epsilon=1.5, delta=1e-5, clip_norm=1.0, noise_multiplier=1.1,
                               releases=3)  # fmt: skip
    withheld = format_status(pb.StatusResponse(privacy=privacy, data_withheld=True))
    assert "clip count withheld" in withheld and "0 clipped" not in withheld
    assert "public refusals only" in withheld
    privacy.updates_clipped = 2
    admin = format_status(pb.StatusResponse(privacy=privacy))
    assert "2 clipped" in admin and "withheld" not in admin


def test_a_clipped_to_zero_update_replays_from_the_log(tmp_path) -> None:
    """The write-ahead log holds the NaN update as it arrived; recovery clips it to zero again
    and reaches the same version (an outcome that differed would stop the recovery)."""
    from aggsrv.server import durability as durable

    settings = {"strategy": "fedbuff", "rate_limit_per_second": 0.0, "durability": "on",
                "state_dir": str(tmp_path / "state"),
                "strategy_config": {"buffer_size": 2, "dp_clip_norm": 1.0,
                                    "dp_noise_multiplier": 0.0}}  # fmt: skip
    rng = _seeded()
    srv = RunningServer(**settings)
    try:
        with Client(srv.address, "a") as a:
            a.register(layout=LAYOUT, initial=torch.randn(D, generator=rng))
            bad = torch.randn(D, generator=rng)
            bad[11] = float("-inf")
            for delta in (bad, *(torch.randn(D, generator=rng) for _ in range(3))):
                answer = a.push(a.get_job(), delta)
            assert answer.status is Status.APPLIED and answer.version == 2
        live = srv.model()
    finally:
        srv.stop()
    for _, path in durable.list_checkpoints(Path(settings["state_dir"]))[1:]:
        path.unlink()  # recovery replays the whole log
    resumed = RunningServer(**settings, resume=True)
    try:
        assert resumed.strategy.version == 2
        assert torch.equal(resumed.model(), live)  # no noise: the same sums
        assert resumed.strategy.privacy.clipped >= 1
    finally:
        resumed.stop()
