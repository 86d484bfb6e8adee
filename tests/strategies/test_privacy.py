"""Differential privacy (aggsrv.strategies.privacy): clipping and noise against a float64
reference, the noise's spread, the accountant against dp-accounting's own composition, the
budget stop, and the accountant's survival of a restart (state_dict)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from aggsrv.layout import ModelLayout
from aggsrv.strategies import Update, UpdateKind, make_strategy
from aggsrv.strategies.dp_noise import PURPOSE_COUNT, NoiseKey, draw_values
from aggsrv.strategies.privacy import PrivacyBudgetSpent

dpa = pytest.importorskip("dp_accounting", reason="the dp extra (pip install 'aggsrv[dp]')")

LAYOUT = ModelLayout.from_named_shapes([("w", (37, 27)), ("b", (13,))])  # D = 1012
D = LAYOUT.numel


def _strategy(name: str, x0: torch.Tensor, **config):
    s = make_strategy(name, layout=LAYOUT, initial=x0, config=config)
    return s


class Clients:
    """Registers clients and sends their updates, DELTA or WEIGHTS, through on_update."""

    def __init__(self, strategy, names: str) -> None:
        self.s = strategy
        self.n = 0
        for c in names:
            strategy.on_register(c, 0.0)

    def send(self, client: str, delta: torch.Tensor, kind=UpdateKind.DELTA, samples: int = 1):
        job = self.s.job_for(client, float(self.n))
        assert job is not None
        tensor = delta if kind is UpdateKind.DELTA else job.weights + delta
        self.n += 1
        update = Update(client, job.job_id, job.base_version, f"u{self.n}", samples, 1.0, kind,
                        tensor.float())  # fmt: skip
        return self.s.on_update(update, float(self.n)), job


def _clipped(delta: torch.Tensor, c: float) -> torch.Tensor:
    d = delta.double()
    return d * min(1.0, c / float(torch.linalg.vector_norm(d)))


def _noise(seed: int, std: float, draws: int) -> list[torch.Tensor]:
    """The draws a strategy with dp_seed = seed makes, in order (one per release)."""
    key = NoiseKey.insecure(seed)
    return [torch.from_numpy(draw_values(key, 0, i, D, std)) for i in range(draws)]


def _deltas(rng: torch.Generator, scales: list[float]) -> list[torch.Tensor]:
    return [torch.randn(D, generator=rng) * s for s in scales]


@pytest.mark.parametrize("kind", [UpdateKind.DELTA, UpdateKind.WEIGHTS])
@pytest.mark.parametrize("weighting", [False, True])
def test_fedbuff_publishes_the_clipped_sum_plus_one_noise_draw(kind, weighting) -> None:
    """x + lr / M (sum_i w_i min(1, C/|u_i|) u_i + N(0, (z C)^2)) per buffer, in float64, for
    updates below and above the clipping norm, with and without staleness weights."""
    rng = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
    x0 = torch.randn(D, generator=rng)
    C, z, lr, seed = 0.7, 0.9, 0.8, int(torch.randint(1 << 30, ()))
    s = _strategy("fedbuff", x0, buffer_size=3, server_lr=lr, staleness_weighting=weighting,
                  dp_clip_norm=C, dp_noise_multiplier=z, dp_seed=seed)  # fmt: skip
    clients = Clients(s, "abcd")
    noise = _noise(seed, z * C, 2)
    expect = x0.double()
    sent = []
    # Buffer 1: a (small, not clipped), b, c. Buffer 2: d (stale by one), a, b.
    for client, scale in zip("abcdab", [0.001, 1.0, 3.0, 0.5, 2.0, 0.002], strict=True):
        delta = torch.randn(D, generator=rng) * scale
        outcome, job = clients.send(client, delta, kind)
        stale = s.version - job.base_version if outcome.status.name == "APPLIED" else None
        sent.append((delta, job.base_version))
        if len(sent) == 3:
            v = s.version - 1  # the version the buffer was applied to
            total = sum(
                _clipped(d, C) * ((1 / math.sqrt(1 + v - b)) if weighting else 1.0) for d, b in sent
            )
            expect = expect + lr / 3 * (total + noise[s.version - 1])
            sent = []
            assert stale is not None
            torch.testing.assert_close(s.global_model().double(), expect, rtol=0, atol=2e-6)
    assert s.version == 2


def test_fedasync_mixes_in_each_clipped_update_with_its_own_noise() -> None:
    """x <- (1 - a) x + a (base + f u + N(0, (z C)^2)): one release per update, fresh and stale
    jobs, DELTA and WEIGHTS."""
    rng = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
    x0 = torch.randn(D, generator=rng)
    C, z, alpha, seed = 1.3, 0.6, 0.5, 11
    s = _strategy("fedasync", x0, alpha=alpha, staleness="constant", dp_clip_norm=C,
                  dp_noise_multiplier=z, dp_seed=seed)  # fmt: skip
    clients = Clients(s, "abcd")
    noise = _noise(seed, z * C, 5)
    # b, c and d train from version 0 while a publishes: stale jobs.
    held = {client: s.job_for(client, 0.0) for client in "bcd"}
    x = x0.double()
    for i, kind in enumerate([UpdateKind.DELTA, UpdateKind.WEIGHTS]):
        delta = torch.randn(D, generator=rng) * 2.0
        clients.send("a", delta, kind)
        x = (1 - alpha) * x + alpha * (x + _clipped(delta, C) + noise[i])
        torch.testing.assert_close(s.global_model().double(), x, rtol=0, atol=2e-6)
    base = x0.double()
    # Stale WEIGHTS and DELTA, clipped (norm about 64 > C), and a stale WEIGHTS under C.
    for i, (client, kind, scale) in enumerate(
        [("b", UpdateKind.WEIGHTS, 2.0), ("c", UpdateKind.DELTA, 2.0),
         ("d", UpdateKind.WEIGHTS, 0.01)]
    ):  # fmt: skip
        job = held[client]
        delta = torch.randn(D, generator=rng) * scale
        assert (float(delta.norm()) > C) == (scale > 1)
        tensor = (job.weights + delta) if kind is UpdateKind.WEIGHTS else delta
        s.on_update(Update(client, job.job_id, 0, f"{client}1", 1, 1.0, kind, tensor.float()),
                    9.0 + i)  # fmt: skip
        x = (1 - alpha) * x + alpha * (base + _clipped(delta, C) + noise[2 + i])
        torch.testing.assert_close(s.global_model().double(), x, rtol=0, atol=2e-6)


@pytest.mark.parametrize("mode", ["sync", "k_async"])
def test_fedavg_weighs_every_client_alike_and_noises_the_sum(mode) -> None:
    """Under DP FedAvg's mean ignores num_samples (a weight would be a sensitivity):
    x + (sum_i f_i u_i + N(0, (z C)^2)) / n."""
    rng = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
    x0 = torch.randn(D, generator=rng)
    C, z, seed = 0.5, 1.1, 5
    extra = {"k": 3} if mode == "k_async" else {"participation": 1.0, "min_clients": 3}
    s = _strategy("fedavg", x0, mode=mode, dp_clip_norm=C, dp_noise_multiplier=z,
                  dp_seed=seed, **extra)  # fmt: skip
    clients = Clients(s, "abc")
    noise = _noise(seed, z * C, 1)
    deltas = _deltas(rng, [0.01, 1.0, 4.0])
    for client, delta, samples in zip("abc", deltas, [5, 500, 50], strict=True):
        clients.send(client, delta, UpdateKind.WEIGHTS if client == "b" else UpdateKind.DELTA,
                     samples)  # fmt: skip
    assert s.version == 1
    expect = x0.double() + (sum(_clipped(d, C) for d in deltas) + noise[0]) / 3
    torch.testing.assert_close(s.global_model().double(), expect, rtol=0, atol=2e-6)


def test_the_noise_has_std_z_times_c_scaled_as_the_aggregate() -> None:
    """Zero updates, many releases: every version moves by (lr / M) N(0, (z C)^2) alone, so the
    steps' sample std over D x releases values estimates (lr / M) z C (within 3 %)."""
    x0 = torch.zeros(D)
    C, z, lr, m = 2.0, 0.8, 0.5, 2
    s = _strategy(
        "fedbuff", x0, buffer_size=m, server_lr=lr, dp_clip_norm=C, dp_noise_multiplier=z
    )  # fmt: skip (dp_seed unset: drawn from the OS)
    clients = Clients(s, "ab")
    steps = []
    for _ in range(20):
        before = s.global_model().clone()
        clients.send("a", torch.zeros(D))
        clients.send("b", torch.zeros(D))
        steps.append((s.global_model() - before).double())
    values = torch.cat(steps).numpy()
    sd = lr / m * z * C
    assert abs(values.mean()) < 4 * sd / math.sqrt(values.size)
    assert values.std(ddof=1) == pytest.approx(sd, rel=0.03)
    # Two servers without dp_seed draw different noise.
    other = _strategy("fedbuff", x0, buffer_size=1, dp_clip_norm=C, dp_noise_multiplier=z)
    Clients(other, "a").send("a", torch.zeros(D))
    mine = _strategy("fedbuff", x0, buffer_size=1, dp_clip_norm=C, dp_noise_multiplier=z)
    Clients(mine, "a").send("a", torch.zeros(D))
    assert not torch.equal(other.global_model(), mine.global_model())


def _rdp_epsilon(multipliers: list[float], delta: float) -> float:
    """dp-accounting composing one Gaussian event per release, each as it is."""
    acc = dpa.rdp.RdpAccountant()
    for m in multipliers:
        acc.compose(dpa.GaussianDpEvent(m))
    return acc.get_epsilon(delta)


def test_the_accountant_composes_what_each_client_released_as_dp_accounting_does() -> None:
    """A hand-set FedBuff run (M = 2, staleness weights): each client's releases as Gaussian
    events of noise z / s (s: the weights of its contributions to that version); the run's
    epsilon is the worst client's, as dp-accounting composes it event by event."""
    z, delta = 1.3, 1e-6
    s = _strategy("fedbuff", torch.zeros(D), buffer_size=2, staleness_weighting=True,
                  dp_clip_norm=1.0, dp_noise_multiplier=z, dp_delta=delta,
                  dp_accountant="rdp")  # fmt: skip
    clients = Clients(s, "abc")
    held = s.job_for("c", 0.0)
    for client in "ab":  # v1 = {a: 1, b: 1}
        clients.send(client, torch.randn(D))
    clients.send("a", torch.randn(D))  # a fresh; waits
    clients.send("a", torch.randn(D))  # a twice in v2: s = 2
    clients.send("b", torch.randn(D))  # waits
    stale = s.version - held.base_version  # c's job is from v0: weight 1 / sqrt(1 + 2)
    s.on_update(Update("c", held.job_id, 0, "c1", 1, 1.0, UpdateKind.DELTA, torch.randn(D)), 9.0)
    assert s.version == 3 and stale == 2
    w = 1 / math.sqrt(3)
    events = {"a": [z / 1, z / 2], "b": [z / 1, z / 1], "c": [z / w]}
    acct = s.privacy.accountant
    for client, multipliers in events.items():
        # mu^2 of the Gaussian mechanisms' composition: the sum of 1 / multiplier^2.
        assert acct.spent[client] == pytest.approx(sum(m**-2 for m in multipliers), rel=1e-12)
        assert acct.epsilon_of(acct.spent[client]) == pytest.approx(
            _rdp_epsilon(multipliers, delta), rel=1e-9
        )
    assert acct.epsilon() == pytest.approx(_rdp_epsilon(events["a"], delta), rel=1e-9)
    assert acct.releases == 3
    # Sync FedAvg, T rounds of everyone once (Flower's fixed-clipping setting): T events of z.
    f = _strategy("fedavg", torch.zeros(D), participation=1.0, min_clients=3,
                  dp_clip_norm=0.3, dp_noise_multiplier=z, dp_delta=delta,
                  dp_accountant="rdp")  # fmt: skip
    clients = Clients(f, "abc")
    for _ in range(7):
        for client in "abc":
            clients.send(client, torch.randn(D))
    assert f.version == 7
    assert f.privacy.accountant.epsilon() == pytest.approx(_rdp_epsilon([z] * 7, delta), 1e-9)


def test_the_budget_stops_publishing_and_loses_nothing_acknowledged() -> None:
    """dp_target_epsilon between the epsilon of 4 and of 5 releases: FedBuff publishes 4
    versions; the update that would make the 5th is refused (FAILED_PRECONDITION) with the
    model and the acknowledged buffered update untouched; then jobs and updates are refused."""
    z, delta = 2.0, 1e-5
    four, five = _rdp_epsilon([z] * 4, delta), _rdp_epsilon([z] * 5, delta)
    s = _strategy("fedbuff", torch.zeros(D), buffer_size=2, dp_clip_norm=1.0,
                  dp_noise_multiplier=z, dp_delta=delta, dp_target_epsilon=(four + five) / 2,
                  dp_seed=1, dp_accountant="rdp")  # fmt: skip
    clients = Clients(s, "ab")
    for _ in range(4):
        clients.send("a", torch.randn(D))
        clients.send("b", torch.randn(D))
    assert s.version == 4
    assert s.privacy.accountant.epsilon() == pytest.approx(four, rel=1e-9)
    waiting = torch.randn(D)
    outcome, _ = clients.send("a", waiting)
    assert outcome.status.name == "BUFFERED"
    before = s.state_dict()
    with pytest.raises(PrivacyBudgetSpent, match="dp_target_epsilon") as refused:
        clients.send("b", torch.randn(D))
    assert refused.value.code == "FAILED_PRECONDITION"
    assert s.version == 4 and torch.equal(s.global_model(), before["model"])
    after = s.state_dict()
    assert after["extra"]["weights"] == [1.0]  # a's update is still in the buffer
    torch.testing.assert_close(after["extra"]["sum"], _clipped(waiting, 1.0))
    with pytest.raises(PrivacyBudgetSpent, match="budget is spent"):
        s.job_for("a", 99.0)
    with pytest.raises(PrivacyBudgetSpent):
        s.on_update(Update("b", 1, 4, "late", 1, 1.0, UpdateKind.DELTA, torch.zeros(D)), 99.0)


def test_a_sync_round_closed_by_its_deadline_stops_at_the_budget_too() -> None:
    z, delta = 1.0, 1e-5
    one, two = _rdp_epsilon([z], delta), _rdp_epsilon([z, z], delta)
    f = _strategy(
        "fedavg",
        torch.zeros(D),
        participation=1.0,
        min_clients=1,
        round_timeout=5.0,
        dp_clip_norm=1.0,
        dp_noise_multiplier=z,
        dp_target_epsilon=(one + two) / 2,
    )
    clients = Clients(f, "ab")
    clients.send("a", torch.randn(D))
    f.on_timer(100.0)  # the deadline closes round 1 with a alone
    assert f.version == 1
    clients.send("a", torch.randn(D))
    f.on_timer(200.0)  # round 2 would be a's second release: refused, nothing published
    assert f.version == 1 and f.privacy.exhausted and f.next_deadline() is None


def test_the_accountant_survives_a_restart_and_the_noise_key_does_not() -> None:
    """state_dict -> load_state_dict: the resumed strategy reports the same epsilon, but its
    noise comes from a fresh key (the key is never part of the state): the same update on the
    same state publishes a differently noised version, each draw of std z C."""
    z = 0.7
    config = {"buffer_size": 1, "dp_clip_norm": 1.0, "dp_noise_multiplier": z}
    s = _strategy("fedbuff", torch.zeros(D), **config)  # dp_seed unset: from the OS
    clients = Clients(s, "ab")
    for client in "abab":
        clients.send(client, torch.randn(D))
    state = s.state_dict()
    resumed = _strategy("fedbuff", torch.zeros(D), **config)
    resumed.load_state_dict(state)
    assert resumed.privacy.accountant.epsilon() == s.privacy.accountant.epsilon() > 0
    assert resumed.privacy.accountant.spent == pytest.approx({"a": 2 / z**2, "b": 2 / z**2})
    before = s.global_model().double()
    delta = torch.randn(D) * 1e-3  # not clipped
    clients.send("a", delta)
    job = resumed.job_for("a", 50.0)
    resumed.on_update(Update("a", job.job_id, job.base_version, "x", 1, 1.0, UpdateKind.DELTA,
                             delta), 51.0)  # fmt: skip
    ours = s.global_model().double() - before - delta.double()
    theirs = resumed.global_model().double() - before - delta.double()
    assert not torch.allclose(ours, theirs)
    # Each is one draw of N(0, (z C)^2) (z C = 0.7; float32 rounding of the model aside).
    for noise in (ours, theirs):
        assert abs(float(noise.std()) - z) < 5 * z / math.sqrt(2 * D)
    # A state saved without DP cannot be resumed with it: epsilon would restart at 0.
    plain = _strategy("fedbuff", torch.zeros(D), buffer_size=1)
    with pytest.raises(ValueError, match="privacy accountant"):
        _strategy("fedbuff", torch.zeros(D), **config).load_state_dict(plain.state_dict())


def test_a_refused_release_never_reuses_its_noise() -> None:
    """A release refused after its noise was drawn (the model would overflow) spent that draw:
    the refusal, which everyone sees, depended on it, so the next published version gets the
    next draw of the stream, never the refused one's."""
    big = torch.zeros(D)
    config = {"buffer_size": 1, "dp_clip_norm": 1.0, "dp_noise_multiplier": 100.0, "dp_seed": 4,
              "server_lr": 1e38}  # fmt: skip
    s = _strategy("fedbuff", big, **config)
    clients = Clients(s, "a")
    with pytest.raises(Exception, match="non-finite|float32"):
        clients.send("a", torch.full((D,), 10.0))
    assert s.version == 0
    s.config.server_lr = 1e-3  # the same strategy, now with a step that fits
    clients.send("a", torch.zeros(D))
    noise = _noise(4, 100.0, 2)
    expect = big.double() + 1e-3 * noise[1]  # draw 1: draw 0 went to the refused release
    torch.testing.assert_close(s.global_model().double(), expect, rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    ("name", "config", "message"),
    [
        ("fedhist", {"dp_clip_norm": 1.0}, "fedhist does not support differential privacy"),
        ("orthofl", {"dp_noise_multiplier": 1.0}, "orthofl does not support"),
        ("feden", {"dp_clip_norm": 1.0}, "feden does not support"),
        ("fedbuff", {"dp_clip_norm": 1.0, "aggregator": "median"}, "not a sum"),
        ("fedasync", {"dp_noise_multiplier": 1.0}, "without dp_clip_norm"),
        ("fedavg", {"dp_clip_norm": -1.0}, "dp_clip_norm must be"),
        ("fedavg", {"dp_clip_norm": 1.0, "dp_target_epsilon": 1.0}, "needs dp_noise_multiplier"),
        ("fedbuff", {"dp_clip_norm": 1.0, "dp_delta": 1.0}, "dp_delta must be in"),
        ("fedasync", {"dp_clip_norm": 1.0, "update_filter": "centered_clip"}, "update_filter"),
    ],
)
def test_keys_that_cannot_give_a_guarantee_are_refused(name, config, message) -> None:
    with pytest.raises(ValueError, match=message):
        make_strategy(name, layout=LAYOUT, initial=torch.zeros(D), config=config)


def test_a_model_with_batchnorm_statistics_is_refused() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    layout = ModelLayout.from_module(model)
    with pytest.raises(ValueError, match="float buffer"):
        make_strategy("fedbuff", layout=layout, initial=torch.zeros(layout.numel),
                      initial_buffers=torch.ones(layout.buffer_numel),
                      config={"dp_clip_norm": 1.0})  # fmt: skip


def test_epsilon_grows_with_releases_and_falls_with_noise() -> None:
    """Sanity of the closed form against dp-accounting over a grid (no amplification)."""
    from aggsrv.strategies.dp_accounting import gaussian_epsilon

    for z in (0.5, 1.0, 4.0):
        eps = [gaussian_epsilon(z, float(t), 1e-5) for t in (1, 10, 100)]
        assert eps == sorted(eps)
        for t, e in zip((1, 10, 100), eps, strict=True):
            assert e == pytest.approx(_rdp_epsilon([z] * t, 1e-5), rel=1e-9)
    assert gaussian_epsilon(0.0, 1.0, 1e-5) == math.inf
    assert gaussian_epsilon(1.0, 0.0, 1e-5) == 0.0
    assert np.isfinite(gaussian_epsilon(1.0, 3.5, 1e-5))


def test_client_side_clipping_asks_the_client_and_clips_what_it_did_not_clip() -> None:
    """dp_clipping = "client": every job's recipe carries clip_norm; a delta far above C is
    not refused (a refusal would reveal its norm by the version that then does not appear) but
    clipped, and only its client is told (Outcome.clipped); one a hair above C (float32
    rounding of a clipped delta) is folded in scaled to C exactly, not counted as clipped."""
    C = 0.8
    x0 = torch.randn(D)
    s = _strategy("fedbuff", x0, buffer_size=1, dp_clip_norm=C, dp_clipping="client",
                  dp_noise_multiplier=0.0)  # fmt: skip
    s.on_register("a", 0.0)
    job = s.job_for("a", 0.0)
    assert job.recipe.clip_norm == C
    unclipped = torch.randn(D) * (3 + torch.rand(()))
    outcome = s.on_update(
        Update("a", job.job_id, 0, "u1", 1, 1.0, UpdateKind.DELTA, unclipped), 1.0
    )
    assert outcome.status.name == "APPLIED" and outcome.clipped and s.version == 1
    expect = x0.double() + _clipped(unclipped, C)
    torch.testing.assert_close(s.global_model().double(), expect, rtol=0, atol=1e-6)
    assert s.privacy.clipped == 1
    job = s.job_for("a", 2.0)
    hair = unclipped / float(unclipped.double().norm()) * C * (1 + 5e-4)
    outcome = s.on_update(Update("a", job.job_id, 1, "u2", 1, 1.0, UpdateKind.DELTA, hair), 2.0)
    assert not outcome.clipped and s.privacy.clipped == 1
    torch.testing.assert_close(s.global_model().double(), expect + _clipped(hair, C),
                               rtol=0, atol=1e-6)  # fmt: skip
    # Server-side clipping asks nothing of the client.
    server = _strategy("fedbuff", x0, dp_clip_norm=C)
    server.on_register("a", 0.0)
    assert server.job_for("a", 0.0).recipe.clip_norm is None


@pytest.mark.parametrize("kind", [UpdateKind.DELTA, UpdateKind.WEIGHTS])
def test_the_client_library_clips_to_the_recipes_norm(kind) -> None:
    from aggsrv.client.clipping import clip_update

    rng = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
    base = torch.randn(D, generator=rng) * 3
    delta = torch.randn(D, generator=rng)
    tensor = delta if kind is UpdateKind.DELTA else base + delta
    C = 0.25
    out = clip_update(tensor, kind, base, C)
    sent = out.double() if kind is UpdateKind.DELTA else out.double() - base.double()
    torch.testing.assert_close(sent, _clipped(delta, C), rtol=0, atol=2e-6)
    assert float(torch.linalg.vector_norm(sent)) <= C * (1 + 1e-5)
    small = tensor if kind is UpdateKind.DELTA else base + delta * 1e-3
    assert clip_update(small, kind, base, 100.0) is small  # within the bound: untouched


def test_a_recipes_clip_norm_travels_the_wire() -> None:
    from aggsrv.protocol import recipe_from_pb, recipe_to_pb
    from aggsrv.values import Recipe

    clipped = Recipe(local_epochs=2.0, clip_norm=0.37)
    assert recipe_to_pb(clipped).clip_norm == 0.37
    assert recipe_from_pb(recipe_to_pb(clipped)) == clipped
    plain = Recipe()
    assert not recipe_to_pb(plain).HasField("clip_norm")
    assert recipe_from_pb(recipe_to_pb(plain)).clip_norm is None
    with pytest.raises(ValueError, match="clip_norm"):
        Recipe(clip_norm=0.0)


def test_adaptive_clipping_replays_the_papers_rule_step_by_step() -> None:
    """Andrew et al. 2021 on FedBuff (M = 4), against a hand-run of the rule with the same
    generator: per release the update noise has std z_u C with 1/z^2 = 1/z_u^2 + 1/s_b^2,
    then the count of unclipped updates gets N(0, s_b^2) on its centred sum, and
    C <- C exp(-lr (share - quantile))."""
    rng = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
    x0 = torch.randn(D, generator=rng)
    C0, z, lr, q, sb, seed, m = 1.0, 0.5, 0.3, 0.5, 0.6, 21, 4
    s = _strategy("fedbuff", x0, buffer_size=m, dp_clip_norm=C0, dp_noise_multiplier=z,
                  dp_seed=seed, dp_adaptive_quantile=q, dp_adaptive_lr=lr,
                  dp_adaptive_count_stddev=sb, dp_accountant="rdp")  # fmt: skip
    clients = Clients(s, "abcd")
    key = NoiseKey.insecure(seed)
    z_u = (z**-2 - sb**-2) ** -0.5  # the count's sensitivity is 1 (zero-out neighbours)
    x, c = x0.double(), C0
    for release in range(3):
        deltas = [torch.randn(D, generator=rng) * scale for scale in (0.01, 0.02, 0.5, 3.0)]
        for client, d in zip("abcd", deltas, strict=True):
            clients.send(client, d)
        below = sum(float(d.double().norm()) <= c for d in deltas)
        noise = torch.from_numpy(draw_values(key, 0, release, D, z_u * c))
        x = x + (sum(_clipped(d, c) for d in deltas) + noise) / m
        count_noise = float(draw_values(key, 0, release, 1, sb, PURPOSE_COUNT)[0])
        share = (below - m / 2 + count_noise) / m + 0.5
        c *= math.exp(-lr * (share - q))
        torch.testing.assert_close(s.global_model().double(), x, rtol=0, atol=5e-6)
        assert s.privacy.clip_norm == pytest.approx(c, rel=1e-12)
    # Each release costs every contributor one Gaussian mechanism of multiplier z.
    assert s.privacy.accountant.epsilon() == pytest.approx(_rdp_epsilon([z] * 3, 1e-5), 1e-9)
    # A restart goes on with the C it had moved to, and the same draws.
    clients.send("a", torch.randn(D, generator=rng))  # one contribution pending
    resumed = make_strategy("fedbuff", layout=LAYOUT, initial=x0, config=s.config)
    resumed.load_state_dict(s.state_dict())
    assert resumed.privacy.clip_norm == s.privacy.clip_norm
    assert (resumed.privacy.pending_count, resumed.privacy.pending_below) == (1, 0)
    rest = [torch.randn(D, generator=rng) for _ in "bcd"]
    for strategy in (s, resumed):
        for client, d in zip("bcd", rest, strict=True):
            job = strategy.job_for(client, 90.0)
            strategy.on_update(Update(client, job.job_id, job.base_version, f"r{client}", 1, 1.0,
                                      UpdateKind.DELTA, d), 91.0)  # fmt: skip
    assert torch.equal(resumed.global_model(), s.global_model())
    assert resumed.privacy.clip_norm == s.privacy.clip_norm


def test_adaptive_clipping_finds_the_quantile_of_the_norms() -> None:
    """No noise: with update norms spread evenly over [1, 3], C moves from far below (0.1)
    and from far above (30) to within 10 % of the target quantile of the norms."""
    for start, q, want in ((0.1, 0.5, 2.0), (30.0, 0.5, 2.0), (0.1, 0.9, 2.8)):
        s = _strategy("fedbuff", torch.zeros(D), buffer_size=10, dp_clip_norm=start,
                      dp_adaptive_quantile=q, dp_adaptive_lr=0.2)  # fmt: skip
        clients = Clients(s, "abcdefghij")
        rng = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
        seen = []
        for _ in range(200):
            for client in "abcdefghij":
                d = torch.randn(D, generator=rng)
                norm = 1.0 + 2.0 * float(torch.rand((), generator=rng))
                clients.send(client, d / d.norm() * norm)
            seen.append(s.privacy.clip_norm)  # one release per 10 updates
        # C jitters around the quantile (the share moves in steps of 1/10): its recent mean.
        assert float(np.mean(seen[-60:])) == pytest.approx(want, rel=0.08), (start, q)


def test_adaptive_clipping_that_cannot_afford_the_count_keeps_c() -> None:
    """FedAsync: one contribution per release gives s_b = 1/20, too little beside z = 1
    (s_b <= z): the release costs Gaussian(z) on the update alone and C stays."""
    s = _strategy("fedasync", torch.zeros(D), dp_clip_norm=0.5, dp_noise_multiplier=1.0,
                  dp_adaptive_quantile=0.5)  # fmt: skip
    clients = Clients(s, "a")
    for _ in range(3):
        clients.send("a", torch.randn(D))
    assert s.privacy.clip_norm == 0.5 and s.privacy.last_noise_std == pytest.approx(0.5)
    with pytest.raises(ValueError, match="dp_clipping = 'server'"):
        _strategy("fedbuff", torch.zeros(D), dp_clip_norm=1.0, dp_adaptive_quantile=0.5,
                  dp_clipping="client")  # fmt: skip


def _ca2fl_sums(arrivals, deltas, clients, k, c, zero=None):
    """CA2FL's released sums K v per flush, in float64 (the strategy's docstring), with the
    deltas clipped to c; ``zero``: that client's deltas replaced by zeros (its zero-out
    neighbour). ``arrivals``: client per arrival, in order; N = len(clients) registered."""
    cache = {}
    sums, acc, count = [], None, 0
    for i, client in enumerate(arrivals):
        if count == 0:
            acc = sum((h for h in cache.values()), torch.zeros(D, dtype=torch.float64))
            acc = acc * k / len(clients)
        d = torch.zeros(D, dtype=torch.float64) if client == zero else _clipped(deltas[i], c)
        acc = acc + d - cache.get(client, torch.zeros(D, dtype=torch.float64))
        cache[client] = d
        count += 1
        if count == k:
            sums.append(acc)
            count = 0
    return sums


def test_ca2fl_with_dp_clips_its_cache_and_charges_every_cached_client() -> None:
    """CA2FL (K = 2, N = 3): the model against the float64 reference with the noise; each
    flush charges a client K/N without an arrival, 1 + |1 - K/N| with one after its first, 1 on
    its first; and those are bounds: zeroing one client's deltas moves each released sum by at
    most its charge times C."""
    rng = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
    x0 = torch.randn(D, generator=rng)
    C, z, lr, seed, k = 0.9, 0.7, 0.5, 8, 2
    s = _strategy("ca2fl", x0, buffer_size=k, server_lr=lr, dp_clip_norm=C,
                  dp_noise_multiplier=z, dp_seed=seed)  # fmt: skip
    clients = Clients(s, "abc")
    arrivals = ["a", "b", "a", "c", "a", "a"]
    deltas = [torch.randn(D, generator=rng) * scale for scale in (0.01, 1, 2, 0.02, 3, 1)]
    for client, d in zip(arrivals, deltas, strict=True):
        clients.send(client, d)
    assert s.version == 3
    noise = _noise(seed, z * C, 3)
    sums = _ca2fl_sums(arrivals, deltas, "abc", k, C)
    x = x0.double()
    for total, e in zip(sums, noise, strict=True):
        x = x + lr / k * (total + e)
    torch.testing.assert_close(s.global_model().double(), x, rtol=0, atol=5e-6)
    charges = [{"a": 1, "b": 1}, {"a": 4 / 3, "c": 1, "b": 2 / 3}, {"a": 4 / 3, "b": 2 / 3,
                                                                    "c": 2 / 3}]  # fmt: skip
    spent = s.privacy.accountant.spent
    for client in "abc":
        assert spent[client] == pytest.approx(sum(r.get(client, 0) ** 2 for r in charges) / z**2)
        gone = _ca2fl_sums(arrivals, deltas, "abc", k, C, zero=client)
        for r, (with_it, without) in enumerate(zip(sums, gone, strict=True)):
            moved = float(torch.linalg.vector_norm(with_it - without))
            assert moved <= charges[r].get(client, 0) * C * (1 + 1e-9), (client, r, moved)
    with pytest.raises(ValueError, match="ca2fl does not support adaptive"):
        _strategy("ca2fl", x0, dp_clip_norm=1.0, dp_adaptive_quantile=0.5)


def test_a_resumed_server_may_change_the_noise_and_the_accountant_follows() -> None:
    """3 releases at z = 1, then a restart with z = 2 and 2 more: epsilon is dp-accounting's
    for the five releases as they were, and a sync FedAvg whose budget is spent tells every
    client, sampled or not."""
    config = {"buffer_size": 1, "dp_clip_norm": 1.0, "dp_noise_multiplier": 1.0,
              "dp_accountant": "rdp"}  # fmt: skip
    s = _strategy("fedbuff", torch.zeros(D), **config)
    clients = Clients(s, "a")
    for _ in range(3):
        clients.send("a", torch.randn(D))
    resumed = _strategy("fedbuff", torch.zeros(D), **{**config, "dp_noise_multiplier": 2.0})
    resumed.load_state_dict(s.state_dict())
    again = Clients(resumed, "")
    again.n = 10
    for _ in range(2):
        again.send("a", torch.randn(D))
    want = _rdp_epsilon([1.0, 1.0, 1.0, 2.0, 2.0], 1e-5)
    assert resumed.privacy.accountant.epsilon() == pytest.approx(want, rel=1e-9)
    # Sync FedAvg sampling one of three clients a round; the budget allows one release each.
    one, two = _rdp_epsilon([1.0], 1e-5), _rdp_epsilon([1.0, 1.0], 1e-5)
    f = _strategy("fedavg", torch.zeros(D), participation=1, min_clients=1, min_available=3,
                  dp_clip_norm=1.0, dp_noise_multiplier=1.0, dp_accountant="rdp",
                  dp_target_epsilon=(one + two) / 2)  # fmt: skip
    fc = Clients(f, "abc")
    spent = set()
    with pytest.raises(PrivacyBudgetSpent):
        for _ in range(20):  # until a client is sampled a second time
            (picked,) = f.participants
            fc.send(picked, torch.randn(D))
            spent.add(picked)
    assert f.version == len(spent) and f.privacy.exhausted
    for client in "abc":  # sampled or not, every client hears it
        with pytest.raises(PrivacyBudgetSpent, match="budget is spent"):
            f.job_for(client, 50.0)


def test_adaptive_clipping_moves_c_alike_on_every_shard() -> None:
    """Two shards (threads with a summing barrier), each seeding its noise from the OS: the
    count's noise is rank 0's draw on every shard, so C moves the same everywhere."""
    from thread_shards import reducers, run_shards

    from aggsrv.sharding import ShardLayout, ShardMap

    whole = ModelLayout.from_named_shapes([("w", (67,))])
    shards, shard_map = 2, ShardMap.even(67, 2, align=8)
    config = {"buffer_size": 2, "dp_clip_norm": 1.0, "dp_noise_multiplier": 0.5,
              "dp_adaptive_quantile": 0.5, "dp_adaptive_count_stddev": 1.0}  # fmt: skip
    sums = reducers(shards)
    gen = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
    deltas = [torch.randn(67, generator=gen) * 0.3 for _ in range(10)]
    seen: list = [None] * shards

    def shard(r: int) -> None:
        layout = ShardLayout(whole, shard_map, r)
        s = make_strategy("fedbuff", layout=layout, initial=torch.zeros(layout.numel),
                          config=config, reducer=sums[r])  # fmt: skip
        s.on_register("a", 0.0)
        cs = []
        for n, d in enumerate(deltas):
            job = s.job_for("a", float(n))
            s.on_update(
                Update(
                    "a",
                    job.job_id,
                    job.base_version,
                    f"u{n}",
                    1,
                    1.0,
                    UpdateKind.DELTA,
                    layout.local(d).contiguous(),
                ),
                float(n),
            )
            cs.append(s.privacy.clip_norm)
        seen[r] = cs

    run_shards(shard, shards)
    assert seen[0] == seen[1] and len(set(seen[0])) > 2, seen


@pytest.mark.parametrize("split", ["equal", "size"])
@pytest.mark.parametrize("name", ["fedbuff", "fedasync", "ca2fl"])
def test_per_layer_clipping_bounds_each_tensor_and_the_whole(split, name) -> None:
    """dp_clip_layers: each layout tensor's delta is clipped to its own bound (C / sqrt(L), or
    C sqrt(n_l / D)), so the whole delta stays within C; the model against the float64
    reference with the noise, for DELTA and WEIGHTS updates."""
    rng = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
    x0 = torch.randn(D, generator=rng)
    C, z, seed = 0.9, 0.4, 13
    sizes = [37 * 27, 13]
    bounds = ([C / math.sqrt(2)] * 2 if split == "equal"
              else [C * math.sqrt(n / D) for n in sizes])  # fmt: skip
    extra = {"buffer_size": 1} if name != "fedasync" else {"alpha": 1.0, "staleness": "constant"}
    s = _strategy(name, x0, dp_clip_norm=C, dp_noise_multiplier=z, dp_seed=seed,
                  dp_clip_layers=split, **extra)  # fmt: skip
    clients = Clients(s, "ab")
    noise = _noise(seed, z * C, 4)
    x = x0.double()
    cache = torch.zeros(D, dtype=torch.float64)  # CA2FL: a's cached delta (K = 1, N = 2)
    for i, kind in enumerate([UpdateKind.DELTA, UpdateKind.WEIGHTS] * 2):
        delta = torch.randn(D, generator=rng) * torch.tensor([3.0] * sizes[0] + [0.01] * 13)
        clients.send("a", delta, kind)
        parts = torch.split(delta.double(), sizes)
        clipped = torch.cat([p * min(1.0, b / float(p.norm())) for p, b in
                             zip(parts, bounds, strict=True)])  # fmt: skip
        assert float(clipped.norm()) <= C * (1 + 1e-12)
        if name == "ca2fl":  # x + lr (K/N h_bar + (u - h) + noise) with K = 1
            x = x + (cache / 2 + clipped - cache + noise[i])
            cache = clipped
        else:
            x = x + clipped + noise[i]
        torch.testing.assert_close(s.global_model().double(), x, rtol=0, atol=5e-6)
    with pytest.raises(ValueError, match="per-layer clipping"):
        _strategy(name, x0, dp_clip_norm=C, dp_clip_layers=split, dp_clipping="client")
