"""FedEN (docs/algorithms/feden.md): the elastic-net client step against float64 hand oracles, the
spec's reductions (lambda = 0 is FedAvg with partial work; alpha = 0 centred at the start is
FedProx with mu = lambda), exact zeros of the prox step, the recipe on the wire, config errors,
state round trip, aggregation against sum p_i y_i, and a short simulated run on digits."""

from __future__ import annotations

import copy
import secrets

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from aggsrv.client import train
from aggsrv.client.train import ELASTIC_CENTRE, ELASTIC_SOLVER
from aggsrv.layout import ModelLayout
from aggsrv.protocol import recipe_from_pb, recipe_to_pb
from aggsrv.strategies.fedavg import FedAvg
from aggsrv.strategies.feden import CENTRES, SOLVERS, FedEN, FedENConfig
from aggsrv.values import Recipe, Status, Update, UpdateKind

IN, OUT = 4, 3


def tiny(gen: torch.Generator) -> tuple[nn.Module, list[tuple[torch.Tensor, torch.Tensor]]]:
    """nn.Linear(4, 3) (flat layout: weight 3x4, then bias 3) and five random batches of 6."""
    model = nn.Linear(IN, OUT)
    batches = [
        (torch.randn(6, IN, generator=gen), torch.randint(0, OUT, (6,), generator=gen))
        for _ in range(5)
    ]
    return model, batches


def elastic(steps: int, lam: float, alpha: float, centre: str, solver: str, **kw: float) -> Recipe:
    extra = {"elastic_centre": float(CENTRES.index(centre))}
    extra["elastic_solver"] = float(SOLVERS.index(solver))
    return Recipe(
        local_epochs=None,
        local_steps=steps,
        learning_rate=kw.pop("lr", 0.1),
        batch_size=6,
        elastic_lambda=lam,
        elastic_alpha=alpha,
        extra=extra,
        **kw,
    )


def oracle64(
    start: torch.Tensor, batches: list, recipe: Recipe, centre: str, solver: str
) -> torch.Tensor:
    """The spec's steps (1.5) written out in float64 on the flat vector, CE gradient by autograd."""
    w = start.double().clone()
    a = w.clone() if centre == "global" else torch.zeros_like(w)
    lr, lam, alpha = recipe.learning_rate, recipe.elastic_lambda, recipe.elastic_alpha
    for x, y in batches[: recipe.local_steps]:
        leaf = w.clone().requires_grad_(True)
        weight, bias = leaf[: IN * OUT].view(OUT, IN), leaf[IN * OUT :]
        F.cross_entropy(x.double() @ weight.T + bias, y).backward()
        g = leaf.grad
        if solver == "subgradient":
            w = w - lr * (g + lam * (1 - alpha) * (w - a) + lam * alpha * torch.sign(w - a))
        else:
            z = w - lr * g - a
            shrunk = torch.sign(z) * torch.clamp(z.abs() - lr * lam * alpha, min=0.0)
            w = a + shrunk / (1 + lr * lam * (1 - alpha))
    return w


# ------------------------------------------------------------------------------ client steps


@pytest.mark.parametrize("steps", [1, 4])
@pytest.mark.parametrize("centre", CENTRES)
@pytest.mark.parametrize("solver", SOLVERS)
@pytest.mark.parametrize(("lam", "alpha"), [(0.05, 0.5), (0.2, 1.0), (0.3, 0.0)])
def test_client_step_matches_float64_oracle(
    steps: int, centre: str, solver: str, lam: float, alpha: float, gen: torch.Generator
) -> None:
    model, batches = tiny(gen)
    start = torch.randn(IN * OUT + OUT, generator=gen)
    recipe = elastic(steps, lam, alpha, centre, solver)
    res = train(model, batches, recipe, start)
    want = oracle64(start, batches, recipe, centre, solver)
    torch.testing.assert_close(res.weights.double(), want, rtol=1e-5, atol=1e-6)
    # The penalty acts (but not in a first subgradient step at a = start, where w - a = 0).
    plain = elastic(steps, 0.0, alpha, centre, solver)
    free = train(copy.deepcopy(model), batches, plain, start)
    acts = centre == "zero" or solver == "prox" or steps > 1
    assert ((free.weights - res.weights).abs().max() > 1e-4) == acts


def test_subgradient_of_zero_is_zero(gen: torch.Generator) -> None:
    """With no data gradient, coordinates sitting exactly on the centre stay there (sgn(0) = 0)."""
    model, batches = tiny(gen)
    start = torch.randn(IN * OUT + OUT, generator=gen)
    start[::3] = 0.0
    recipe = elastic(1, 0.5, 0.6, "zero", "subgradient")
    res = train(model, batches, recipe, start, loss_fn=lambda out, y: 0.0 * out.sum())
    w = start.double()
    want = w - 0.1 * (0.5 * 0.4 * w + 0.5 * 0.6 * torch.sign(w))
    assert torch.equal(res.weights[::3], torch.zeros_like(res.weights[::3]))
    torch.testing.assert_close(res.weights.double(), want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("centre", CENTRES)
def test_prox_makes_exact_zeros_inside_the_threshold(centre: str, gen: torch.Generator) -> None:
    model, batches = tiny(gen)
    start = torch.randn(IN * OUT + OUT, generator=gen) * 0.05
    alpha, lr = 0.75, 0.1
    a = start.double() if centre == "global" else torch.zeros(start.numel(), dtype=torch.float64)
    plain = train(copy.deepcopy(model), batches, elastic(1, 0.0, 0.0, centre, "prox"), start)
    v = plain.weights.double() - a  # v - a after the data step alone (bit-identical step)
    # The threshold lr * lam * alpha at the median |v - a|: about half the entries inside.
    lam = float(v.abs().median()) / (lr * alpha)
    res = train(model, batches, elastic(1, lam, alpha, centre, "prox", lr=lr), start)
    inside = v.abs() <= lr * lam * alpha - 1e-6
    outside = v.abs() > lr * lam * alpha + 1e-6
    assert inside.any() and outside.any()
    diff = res.weights.double() - a
    assert torch.all(diff[inside] == 0) and torch.all(diff[outside] != 0)
    want = a + torch.sign(v) * (v.abs() - lr * lam * alpha).clamp(min=0) / (1 + lr * lam / 4)
    torch.testing.assert_close(res.weights.double(), want, rtol=1e-5, atol=1e-7)
    if centre == "zero":
        assert not torch.signbit(res.weights[res.weights == 0]).any()  # +0.0, never -0.0


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_alpha_zero_at_the_start_is_fedprox_bit_exactly(momentum: float, gen: torch.Generator):
    model, batches = tiny(gen)
    start = torch.randn(IN * OUT + OUT, generator=gen)
    en = elastic(5, 0.3, 0.0, "global", "subgradient", momentum=momentum)
    prox = Recipe(
        local_epochs=None, local_steps=5, learning_rate=0.1, batch_size=6, momentum=momentum,
        proximal_mu=0.3,
    )  # fmt: skip
    a = train(copy.deepcopy(model), batches, en, start)
    b = train(copy.deepcopy(model), batches, prox, start)
    assert torch.equal(a.weights, b.weights)


def test_alpha_zero_at_zero_is_weight_decay(gen: torch.Generator) -> None:
    model, batches = tiny(gen)
    start = torch.randn(IN * OUT + OUT, generator=gen)
    en = elastic(5, 0.3, 0.0, "zero", "subgradient")
    wd = Recipe(local_epochs=None, local_steps=5, learning_rate=0.1, batch_size=6, weight_decay=0.3)
    a = train(copy.deepcopy(model), batches, en, start)
    b = train(copy.deepcopy(model), batches, wd, start)
    torch.testing.assert_close(a.weights, b.weights, rtol=1e-6, atol=1e-7)


def test_lambda_zero_is_plain_sgd_bit_exactly(gen: torch.Generator) -> None:
    model, batches = tiny(gen)
    start = torch.randn(IN * OUT + OUT, generator=gen)
    plain = Recipe(local_epochs=None, local_steps=5, learning_rate=0.1, batch_size=6)
    b = train(copy.deepcopy(model), batches, plain, start)
    for centre in CENTRES:
        for solver in SOLVERS:
            a = train(copy.deepcopy(model), batches, elastic(5, 0.0, 0.5, centre, solver), start)
            assert torch.equal(a.weights, b.weights)


def test_client_refuses_bad_elastic_extras(gen: torch.Generator) -> None:
    model, batches = tiny(gen)
    start = torch.randn(IN * OUT + OUT, generator=gen)
    before = ModelLayout.from_module(model).flatten(model)
    for key in ("elastic_centre", "elastic_solver"):
        bad = Recipe(local_epochs=None, local_steps=1, elastic_lambda=0.1, extra={key: 2.0})
        with pytest.raises(ValueError, match=rf"recipe.extra\['{key}'\] must be"):
            train(model, batches, bad, start)
    bias = Recipe(
        local_epochs=None, local_steps=1, elastic_lambda=0.1, extra={"elastic_exclude_biases": 3}
    )
    with pytest.raises(ValueError, match="elastic_exclude_biases"):
        train(model, batches, bias, start)
    assert torch.equal(ModelLayout.from_module(model).flatten(model), before)  # untouched
    assert (ELASTIC_CENTRE, ELASTIC_SOLVER) == ("elastic_centre", "elastic_solver")


# ------------------------------------------------------------------------------ strategy

LAYOUT = ModelLayout.from_named_shapes([("fc.weight", (4, 7)), ("fc.bias", (4,)), ("out.w", (5,))])
D = LAYOUT.numel


def run_round(s, gen: torch.Generator, sizes: dict[str, int], partial: set[str]):
    """Register the clients, report a random result for each; return the float64 client weights."""
    for c in sizes:
        s.on_register(c, 0.0)
    ys = {}
    for i, (c, n) in enumerate(sizes.items()):
        job = s.job_for(c, 0.0)
        y = job.weights + 0.1 * torch.randn(D, generator=gen)
        work = job.recipe.work_target / 2 if c in partial else job.recipe.work_target
        kind = UpdateKind.WEIGHTS if i % 2 == 0 else UpdateKind.DELTA
        tensor = y.clone() if kind is UpdateKind.WEIGHTS else y - job.weights
        upd = Update(c, job.job_id, job.base_version, f"u{c}", n, work, kind, tensor)
        s.on_update(upd, 1.0)
        ys[c] = y.double()
    return ys


def test_lambda_zero_feden_equals_fedavg_with_partial_work_bit_exactly(gen: torch.Generator):
    seed = secrets.randbits(31)
    initial = torch.randn(D, generator=gen)
    sizes = {"a": 5, "b": 7, "c": 3}
    models = []
    cfgs = [
        (FedEN, {"lam": 0.0, "weighting": "samples", "participation": 1.0, "min_available": 3}),
        (FedAvg, {"partial_work": "include", "min_available": 3}),
    ]
    for cls, cfg in cfgs:
        s = cls(LAYOUT, initial, {**cfg, "local_epochs": 2.0})
        run_round(s, torch.Generator().manual_seed(seed), sizes, partial={"b"})
        assert s.version == 1
        models.append(s.global_model())
    assert torch.equal(models[0], models[1])
    # Uniform weighting with equal power-of-two sizes is bit-identical to sample weighting.
    models = []
    for weighting in ("uniform", "samples"):
        s = FedEN(LAYOUT, initial, {**cfgs[0][1], "weighting": weighting})
        run_round(s, torch.Generator().manual_seed(seed), dict.fromkeys("abc", 8), {"c"})
        models.append(s.global_model())
    assert torch.equal(models[0], models[1])


@pytest.mark.parametrize("weighting", ["uniform", "samples"])
def test_aggregate_is_the_mean_of_client_models(weighting: str, gen: torch.Generator) -> None:
    """Eq. 5 with eta_g = 1: w = sum p_i y_i, stragglers included, vs float64 on the CPU."""
    s = FedEN(LAYOUT, torch.randn(D, generator=gen), {"participation": 1.0, "min_available": 4,
                                                       "weighting": weighting})  # fmt: skip
    sizes = {"a": 5, "b": 9, "c": 2, "d": 0}
    ys = run_round(s, gen, sizes, partial={"a", "c"})
    assert s.version == 1
    if weighting == "uniform":
        p = {c: (1.0 if n else 0.0) / 3 for c, n in sizes.items()}  # no samples: weight 0
    else:
        p = {c: n / 16 for c, n in sizes.items()}
    want = sum(p[c] * ys[c] for c in sizes)
    got = s.global_model().double()
    assert ((got - want).norm() / want.norm()).item() < 1e-6


def test_recipe_carries_the_elastic_net_and_survives_the_wire(gen: torch.Generator) -> None:
    for centre in CENTRES:
        for solver in SOLVERS:
            cfg = {"lam": 0.02, "alpha": 0.25, "centre": centre, "solver": solver}
            s = FedEN(LAYOUT, torch.randn(D, generator=gen), cfg)
            s.on_register("a", 0.0)
            r = s.job_for("a", 0.0).recipe
            assert (r.elastic_lambda, r.elastic_alpha, r.proximal_mu) == (0.02, 0.25, 0.0)
            assert dict(r.extra) == {
                "elastic_centre": float(CENTRES.index(centre)),
                "elastic_solver": float(SOLVERS.index(solver)),
            }
            assert (r.local_epochs, r.batch_size, r.learning_rate) == (10.0, 10, 0.01)
            msg = recipe_to_pb(r)
            assert msg.elastic_net.anchor == (1 if centre == "zero" else 2)
            assert msg.elastic_net.solver == (1 if solver == "subgradient" else 2)
            assert "elastic_centre" not in msg.extra
            assert recipe_from_pb(msg) == r
    fractional = FedENConfig(local_epochs=2.5, centre="global").elastic_recipe()
    assert recipe_from_pb(recipe_to_pb(fractional)) == fractional
    no_bias = FedENConfig(exclude_biases=True).elastic_recipe()
    assert no_bias.extra["elastic_exclude_biases"] == 1.0
    assert recipe_to_pb(no_bias).elastic_net.exclude_biases
    assert recipe_from_pb(recipe_to_pb(no_bias)) == no_bias
    assert FedENConfig(local_steps=7).recipe().local_steps == 7
    d = FedENConfig()
    assert (d.lam, d.alpha, d.centre, d.solver, d.weighting, d.partial_work) == (
        1e-3, 0.5, "zero", "subgradient", "uniform", "include",
    )  # fmt: skip
    assert (d.participation, FedEN.name) == (0.1, "feden")


@pytest.mark.parametrize(
    ("cfg", "message"),
    [
        ({"lam": -0.1}, "lam .* must be finite and >= 0"),
        ({"lam": float("nan")}, "lam .* must be finite and >= 0"),
        ({"lam": float("inf")}, "lam .* must be finite and >= 0"),
        ({"alpha": 1.5}, r"alpha .* must be in \[0, 1\]"),
        ({"centre": "start"}, "centre must be one of"),
        ({"solver": "adam"}, "solver must be one of"),
        ({"weighting": "steps"}, "weighting must be one of"),
        ({"partial_work": "keep"}, "partial_work must be one of"),
        ({"lambda": 0.1}, "unknown FedENConfig key 'lambda'"),
        ({"local_epochs": 2.0, "local_steps": 3}, "not both"),
    ],
)
def test_bad_configs_are_refused_with_a_reason(cfg: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        FedENConfig.from_dict(cfg)


def test_state_dict_round_trip_continues_bit_identically(gen: torch.Generator) -> None:
    cfg = {"participation": 1.0, "min_available": 3, "local_epochs": 2.0}
    s = FedEN(LAYOUT, torch.randn(D, generator=gen), cfg)
    run_round(s, gen, {"a": 4, "b": 6, "c": 5}, partial={"c"})
    # Mid-round: two of three reported.
    jobs = {c: s.job_for(c, 2.0) for c in "abc"}
    for c in "ab":
        y = jobs[c].weights + 0.1 * torch.randn(D, generator=gen)
        s.on_update(Update(c, jobs[c].job_id, 1, f"v{c}", 5, 1.0, UpdateKind.WEIGHTS, y), 3.0)
    state = s.state_dict()
    t = FedEN(LAYOUT, torch.zeros(D), cfg)
    t.load_state_dict(state)
    y = jobs["c"].weights + 0.1 * torch.randn(D, generator=gen)
    outs = [
        x.on_update(Update("c", jobs["c"].job_id, 1, "vc", 5, 2.0, UpdateKind.WEIGHTS, y), 4.0)
        for x in (s, t)
    ]
    assert outs[0] == outs[1] and outs[0].status is Status.APPLIED and s.version == 2
    assert torch.equal(s.global_model(), t.global_model())
    assert t.job_for("a", 5.0).recipe == s.job_for("a", 5.0).recipe


def test_simulated_run_learns_on_digits(tmp_path) -> None:
    import aggsrv.sim

    res = aggsrv.sim.run(
        {
            "strategy": "aggsrv.strategies.feden:FedEN",
            "transport": "inproc",
            "budget": "3r",
            "out": str(tmp_path),
            "profile": "partial_work:units=2",
            "strategy_config": {"local_epochs": 2.0, "participation": 1.0, "solver": "prox"},
        },
        progress=False,
    )
    acc = [m["test_accuracy"] for m in res.metrics]
    assert res.summary["versions"] == 3 and res.summary["updates_rejected"] == 0
    assert acc[-1] > 0.6 and acc[-1] > acc[0] + 0.3
    assert (tmp_path / "summary.json").exists()
