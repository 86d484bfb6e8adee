"""The ClientApp side of the Flower adapter with the real `flwr` package: a job decodes to the
recipe, weights and basis the aggsrv strategy issued; the per-step helpers equal float64
oracles of Fed-OGD's projection and FedEN's elastic-net subgradient; a job trained with aggsrv's
loop and answered with `reply` is folded in by the strategy as FedAsync's formula says."""

from __future__ import annotations

import random

import pytest
import torch

flwr = pytest.importorskip("flwr")

from flwr.app import ArrayRecord, ConfigRecord  # noqa: E402
from flwr.supercore.task_identity import TaskIdentity  # noqa: E402

from aggsrv.integrations.flower import AggsrvStrategy  # noqa: E402
from aggsrv.integrations.flower.arrays import record_to_flat  # noqa: E402
from aggsrv.integrations.flower.client import (  # noqa: E402
    add_elastic_net_gradient_,
    job_from_message,
    project_gradients_,
    reply,
    train_job,
)
from aggsrv.layout import ModelLayout  # noqa: E402

pytestmark = pytest.mark.usefixtures("flower_identity")


class Grid:
    def __init__(self, nodes):
        self.nodes = nodes

    def get_node_ids(self):
        return list(self.nodes)


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 5), torch.nn.BatchNorm1d(5), torch.nn.ReLU(), torch.nn.Linear(5, 3)
    )


def _trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize(
    ("name", "config"),
    [
        ("fedasync", {"alpha": 0.5}),
        ("fedprox", {"mu": 0.3}),
        ("feden", {"participation": 1.0, "lam": 0.01, "alpha": 0.4}),
        ("fedhist", {"buffer_size": 2}),
    ],
)
def test_job_decodes_to_what_the_strategy_issued(name, config) -> None:
    model = _model(random.randrange(1 << 20))
    adapter = AggsrvStrategy(name, config, seed=1)
    arrays = ArrayRecord(torch_state_dict=_trainable_state(model))
    (msg, *_) = list(adapter.configure_train(1, arrays, ConfigRecord({"lr-note": 1}), Grid([5])))
    job = job_from_message(msg)
    issued = adapter._jobs[5]
    assert job.job_id == issued.job_id and job.base_version == issued.base_version
    assert job.recipe.to_dict() == issued.recipe.to_dict()
    assert torch.equal(job.weights, issued.weights)
    assert job.config["lr-note"] == 1  # the ServerApp's own config travels too


def test_project_gradients_matches_the_float64_projection() -> None:
    model = _model(random.randrange(1 << 20))
    layout = ModelLayout.from_module(model)
    gen = torch.Generator().manual_seed(random.randrange(1 << 20))
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen)
    g = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).double()
    basis = torch.randn(layout.numel, generator=gen)
    from aggsrv.integrations.flower.client import FlowerJob
    from aggsrv.values import ProjectionMode, Recipe

    job = FlowerJob(1, 0, Recipe(projection=ProjectionMode.LAYERWISE), layout,
                    torch.zeros(layout.numel), {"basis": basis}, {})  # fmt: skip
    assert project_gradients_(model, job)
    got = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).double()
    want = g.clone()
    b = basis.double()
    offs = layout.offsets.tolist()
    for i in range(len(offs) - 1):
        seg = slice(offs[i], offs[i + 1])
        bb = float(b[seg] @ b[seg])
        if bb > 0:
            want[seg] -= float(g[seg] @ b[seg]) / bb * b[seg]
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    # Each segment of the projected gradient is orthogonal to the basis.
    for i in range(len(offs) - 1):
        seg = slice(offs[i], offs[i + 1])
        assert abs(float(got[seg] @ b[seg])) <= 1e-4 * float(b[seg].norm() * got[seg].norm())


@pytest.mark.parametrize("centre", [0.0, 1.0])
def test_elastic_net_gradient_matches_the_formula(centre) -> None:
    model = _model(random.randrange(1 << 20))
    layout = ModelLayout.from_module(model)
    gen = torch.Generator().manual_seed(random.randrange(1 << 20))
    start = torch.randn(layout.numel, generator=gen)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen)
    g0 = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).double()
    w = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).double()
    from aggsrv.integrations.flower.client import FlowerJob
    from aggsrv.values import Recipe

    lam, alpha = 0.03, 0.7
    recipe = Recipe(elastic_lambda=lam, elastic_alpha=alpha, extra={"elastic_centre": centre})
    job = FlowerJob(1, 0, recipe, layout, start, {}, {})
    assert add_elastic_net_gradient_(model, job)
    z = w - start.double() if centre == 1.0 else w
    want = g0 + lam * (1 - alpha) * z + lam * alpha * torch.sign(z)
    got = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).double()
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-7)


def test_trained_job_and_reply_fold_in_as_fedasync_says() -> None:
    seed = random.randrange(1 << 20)
    model = _model(seed)
    alpha = 0.5
    adapter = AggsrvStrategy("fedasync", {"alpha": alpha, "learning_rate": 0.1}, seed=2)
    arrays = ArrayRecord(torch_state_dict=_trainable_state(model))
    (msg,) = list(adapter.configure_train(1, arrays, ConfigRecord(), Grid([9])))
    job = job_from_message(msg)
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.randn(40, 6, generator=gen), torch.randint(0, 3, (40,), generator=gen)
    loader = [(x[i : i + 8], y[i : i + 8]) for i in range(0, 40, 8)]
    result = train_job(model, loader, job)
    final = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    assert not torch.equal(final, job.weights) and result.complete
    TaskIdentity.node_id = 9
    answer = reply(msg, model, num_examples=40, metrics={"loss": 0.5})
    out, metrics = adapter.aggregate_train(1, [answer])
    got = record_to_flat(out, job.layout)
    want = (1 - alpha) * job.weights.double() + alpha * final.double()  # s = 0: weight alpha
    assert torch.allclose(got.double(), want, rtol=1e-6, atol=1e-6)
    assert metrics["num-examples"] == 40 and metrics["loss"] == 0.5
    assert adapter.outcomes == [(9, "APPLIED", 1)]
