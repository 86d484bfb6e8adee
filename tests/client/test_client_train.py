"""aggsrv.client.train against independent oracles: torch.optim.SGD on an unbound copy of the
model fed the same batches, and FedProx as the hand-written loss + mu/2 * |w - w0|^2.

On CPU the comparisons are bit-exact (torch.equal): the flat step performs the same float
operations in the same order as torch.optim.SGD's single-tensor path (``g.add(w, alpha=wd)``,
``m.mul_(momentum).add_(g)``, ``w.add_(g, alpha=-lr)``; the proximal gradient as autograd forms
it, ``mu * (w - w0)`` rounded before it is added), and every one of them is elementwise, so
running it once over the flat buffer instead of once per tensor changes no rounding. The CUDA
test allows 1e-5 relative: torch.optim.SGD takes its foreach path there, cuDNN picks kernels.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from aggsrv.client import TrainResult, train
from aggsrv.layout import ModelLayout
from aggsrv.values import Recipe

Batch = tuple[torch.Tensor, torch.Tensor]


# ------------------------------------------------------------------------------------ fixtures


def mlp(seed: int) -> nn.Module:
    """A small MLP with odd sizes, so flat segments start at unaligned offsets."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(13, 37), nn.ReLU(), nn.Linear(37, 29), nn.Tanh(), nn.Linear(29, 5)
    )


def cnn(seed: int) -> nn.Module:
    """A small CNN with two BatchNorm layers (running statistics are float buffers)."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(3, 6, 3),
        nn.BatchNorm2d(6),
        nn.ReLU(),
        nn.Conv2d(6, 5, 3),
        nn.BatchNorm2d(5),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(5 * 4 * 4, 7),
    )


MODELS: dict[str, tuple[Callable[[int], nn.Module], tuple[int, ...], int]] = {
    "mlp": (mlp, (13,), 5),
    "cnn": (cnn, (3, 8, 8), 7),
}


def make_data(kind: str, n: int, seed: int) -> TensorDataset:
    """Fresh random inputs and labels for a model kind."""
    _, shape, classes = MODELS[kind]
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, *shape, generator=g), torch.randint(0, classes, (n,)))


def batch_list(kind: str, sizes: Sequence[int], seed: int) -> list[Batch]:
    """A fixed list of batches (a list is a valid loader: sized, re-iterable, same order)."""
    data = make_data(kind, sum(sizes), seed)
    out, at = [], 0
    for s in sizes:
        out.append((data.tensors[0][at : at + s], data.tensors[1][at : at + s]))
        at += s
    return out


def shuffled(data: TensorDataset, batch_size: int, seed: int) -> DataLoader:
    """A shuffling DataLoader whose order is fixed by a seeded generator."""
    return DataLoader(
        data, batch_size=batch_size, shuffle=True, generator=torch.Generator().manual_seed(seed)
    )


def take(loader: Iterable[Any], n: int) -> list[Any]:
    """The first n batches train() draws: pass after pass, a fresh iter(loader) each pass."""
    out: list[Any] = []
    while len(out) < n:
        for batch in loader:
            out.append(batch)
            if len(out) == n:
                break
    return out


def start_for(model: nn.Module, seed: int) -> torch.Tensor:
    """Random start weights (the job's), not the model's own initialisation."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(ModelLayout.from_module(model).numel, generator=g) * 0.3


def oracle(
    model: nn.Module,
    start: torch.Tensor,
    batches: Sequence[Batch],
    recipe: Recipe,
    loss_fn: Callable[..., torch.Tensor] = F.cross_entropy,
) -> tuple[torch.Tensor, torch.Tensor | None, float]:
    """torch.optim.SGD on an unbound copy; FedProx as an explicit mu/2 * |w - w0|^2 loss term.

    Returns the final flat weights, the flat float buffers (or None) and the example-weighted
    mean loss of the data term.
    """
    ref = copy.deepcopy(model)
    layout = ModelLayout.from_module(ref)
    layout.unflatten(start, ref)
    anchor = [p.detach().clone() for p in ref.parameters()]
    opt = torch.optim.SGD(
        ref.parameters(),
        lr=recipe.learning_rate,
        momentum=recipe.momentum,
        weight_decay=recipe.weight_decay,
    )
    ref.train()
    total, count = 0.0, 0
    for x, y in batches:
        opt.zero_grad()
        data_loss = loss_fn(ref(x), y)
        loss = data_loss
        if recipe.proximal_mu:
            prox = sum(((p - a) ** 2).sum() for p, a in zip(ref.parameters(), anchor, strict=True))
            loss = data_loss + recipe.proximal_mu / 2 * prox
        loss.backward()
        opt.step()
        total += data_loss.item() * len(y)
        count += len(y)
    buffers = layout.flatten_buffers(ref) if layout.buffer_specs else None
    return layout.flatten(ref), buffers, total / count


def run(
    kind: str, recipe: Recipe, loader: Iterable[Any], seed: int = 0, **kwargs: Any
) -> tuple[nn.Module, torch.Tensor, TrainResult]:
    """A fresh model of ``kind``, random start weights, and train()'s result on it."""
    model = MODELS[kind][0](seed)
    start = start_for(model, seed + 1)
    return model, start, train(copy.deepcopy(model), loader, recipe, start, **kwargs)


# ----------------------------------------------------------------------------- plain SGD oracle


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
@pytest.mark.parametrize(
    ("momentum", "weight_decay"), [(0.0, 0.0), (0.9, 0.0), (0.0, 5e-3), (0.7, 1e-2)]
)
def test_plain_sgd_equals_torch_optim_sgd_bit_exactly(
    kind: str, momentum: float, weight_decay: float
) -> None:
    batches = batch_list(kind, [8, 8, 8, 5], seed=11)  # a short last batch, as in real loaders
    recipe = Recipe(
        local_epochs=2,
        learning_rate=0.07,
        batch_size=8,
        momentum=momentum,
        weight_decay=weight_decay,
    )
    model, start, res = run(kind, recipe, batches, seed=3)
    want, want_buffers, want_loss = oracle(model, start, take(batches, 8), recipe)
    assert torch.equal(res.weights, want)
    assert not torch.equal(res.weights, start)
    assert res.weights.dtype == torch.float32 and res.weights.shape == start.shape
    assert torch.equal(res.delta, res.weights - start)
    assert (res.steps, res.epochs, res.examples, res.complete) == (8, 2.0, 58, True)
    assert res.work_done(recipe) == 2.0
    assert res.mean_loss == pytest.approx(want_loss, rel=1e-12)
    assert math.isfinite(res.seconds) and res.seconds >= 0
    if want_buffers is None:
        assert res.buffers is None
    else:
        assert res.buffers is not None and torch.equal(res.buffers, want_buffers)


def test_trained_model_holds_the_final_weights() -> None:
    batches = batch_list("cnn", [6, 6, 6], seed=5)
    model = cnn(1)
    start = start_for(model, 2)
    recipe = Recipe(
        local_epochs=None, local_steps=4, learning_rate=0.05, batch_size=6, momentum=0.9
    )
    res = train(model, batches, recipe, start)
    layout = ModelLayout.from_module(model)
    assert torch.equal(layout.flatten(model), res.weights)
    assert res.buffers is not None and torch.equal(layout.flatten_buffers(model), res.buffers)


# ----------------------------------------------------------------------------- FedProx oracle


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
@pytest.mark.parametrize(
    ("mu", "momentum", "weight_decay"), [(0.1, 0.0, 0.0), (0.5, 0.9, 0.0), (0.05, 0.6, 2e-3)]
)
def test_fedprox_equals_handwritten_proximal_loss(
    kind: str, mu: float, momentum: float, weight_decay: float
) -> None:
    batches = batch_list(kind, [7, 7, 7], seed=21)
    recipe = Recipe(
        local_epochs=3,
        learning_rate=0.1,
        batch_size=7,
        momentum=momentum,
        weight_decay=weight_decay,
        proximal_mu=mu,
    )
    model, start, res = run(kind, recipe, batches, seed=8)
    want, _, want_loss = oracle(model, start, take(batches, 9), recipe)
    assert torch.equal(res.weights, want)
    assert torch.equal(res.delta, res.weights - start)
    # mean_loss reports the data term only, not the proximal penalty.
    assert res.mean_loss == pytest.approx(want_loss, rel=1e-12)
    # The proximal pull is real: without it the weights end elsewhere, farther from start.
    plain = Recipe(**{**recipe.to_dict(), "proximal_mu": 0.0})
    _, _, free = run(kind, plain, batches, seed=8)
    assert not torch.equal(free.weights, res.weights)
    assert res.delta.norm() < free.delta.norm()


# ----------------------------------------------------------------------------- work accounting


@pytest.mark.parametrize("steps", [1, 3, 7, 10])
def test_local_steps_cycle_the_loader(steps: int) -> None:
    batches = batch_list("mlp", [9, 9, 9], seed=31)
    recipe = Recipe(
        local_epochs=None, local_steps=steps, learning_rate=0.05, batch_size=9, momentum=0.5
    )
    model, start, res = run("mlp", recipe, batches, seed=4)
    seq = [batches[i % 3] for i in range(steps)]
    want, _, _ = oracle(model, start, seq, recipe)
    assert torch.equal(res.weights, want)
    assert (res.steps, res.examples, res.complete) == (steps, 9 * steps, True)
    assert res.epochs == pytest.approx(steps / 3)
    assert res.work_done(recipe) == float(steps)


def test_local_steps_reshuffle_each_pass_of_a_seeded_loader() -> None:
    data = make_data("cnn", 50, seed=41)
    recipe = Recipe(
        local_epochs=None, local_steps=17, learning_rate=0.05, batch_size=8
    )  # 7 batches a pass
    model, start, res = run("cnn", recipe, shuffled(data, 8, seed=9), seed=2)
    seq = take(shuffled(data, 8, seed=9), 17)
    assert not torch.equal(seq[0][0], seq[7][0])  # the second pass is a new permutation
    want, want_buffers, _ = oracle(model, start, seq, recipe)
    assert torch.equal(res.weights, want)
    assert res.buffers is not None and torch.equal(res.buffers, want_buffers)
    assert (res.steps, res.complete, res.num_samples) == (17, True, 50)
    assert res.examples == sum(len(y) for _, y in seq)
    assert res.epochs == pytest.approx(17 / 7)


@pytest.mark.parametrize(
    ("epochs", "per_epoch", "want_steps"),
    [(1.5, 4, 6), (0.3, 10, 3), (0.1 * 3, 10, 3), (2.25, 4, 9), (0.01, 10, 1), (1.7, 3, 6)],
)
def test_fractional_epochs_stop_after_ceil_of_the_fraction(
    epochs: float, per_epoch: int, want_steps: int
) -> None:
    data = make_data("mlp", 6 * per_epoch, seed=51)
    recipe = Recipe(local_epochs=epochs, learning_rate=0.05, batch_size=6)
    model, start, res = run("mlp", recipe, shuffled(data, 6, seed=3), seed=6)
    want, _, _ = oracle(model, start, take(shuffled(data, 6, seed=3), want_steps), recipe)
    assert torch.equal(res.weights, want)
    assert (res.steps, res.examples, res.complete) == (want_steps, 6 * want_steps, True)
    # Complete work reports the recipe's epochs exactly: the server compares against them.
    assert res.epochs == epochs and res.work_done(recipe) == recipe.work_target


def test_max_steps_gives_partial_work_with_correct_counts() -> None:
    batches = batch_list("cnn", [5, 5, 5, 5], seed=61)
    recipe = Recipe(local_epochs=2, learning_rate=0.05, batch_size=5, momentum=0.9)
    model, start, res = run("cnn", recipe, batches, seed=7, max_steps=3)
    want, want_buffers, _ = oracle(model, start, batches[:3], recipe)
    assert torch.equal(res.weights, want)
    assert res.buffers is not None and torch.equal(res.buffers, want_buffers)
    assert (res.steps, res.examples, res.complete) == (3, 15, False)
    assert res.epochs == 0.75 and res.work_done(recipe) == 0.75
    assert torch.equal(res.delta, res.weights - start)

    _, _, res = run("cnn", recipe, batches, seed=7, max_steps=6)
    assert (res.steps, res.epochs, res.complete) == (6, 1.5, False)

    _, _, res = run("cnn", recipe, batches, seed=7, max_steps=100)  # more than the recipe needs
    assert (res.steps, res.epochs, res.complete) == (8, 2.0, True)


def test_partial_work_of_a_fractional_recipe_reads_below_the_target() -> None:
    batches = batch_list("mlp", [4] * 4, seed=62)
    recipe = Recipe(local_epochs=1.5, learning_rate=0.05, batch_size=4)  # 6 steps
    _, _, res = run("mlp", recipe, batches, seed=1, max_steps=5)
    assert (res.steps, res.epochs, res.complete) == (5, 1.25, False)
    assert res.work_done(recipe) < recipe.work_target


def test_zero_steps_return_the_start_weights() -> None:
    batches = batch_list("mlp", [4, 4], seed=63)
    recipe = Recipe(local_epochs=None, local_steps=5, learning_rate=0.05, batch_size=4)
    _, start, res = run("mlp", recipe, batches, seed=2, max_steps=0)
    assert torch.equal(res.weights, start) and not res.delta.any()
    assert (res.steps, res.examples, res.epochs, res.complete) == (0, 0, 0.0, False)
    assert math.isnan(res.mean_loss)


def test_stop_callable_ends_early_and_is_checked_before_each_step() -> None:
    batches = batch_list("mlp", [6, 6, 6], seed=71)
    recipe = Recipe(
        local_epochs=None, local_steps=8, learning_rate=0.05, batch_size=6, weight_decay=1e-3
    )
    calls: list[int] = []

    def deadline() -> bool:
        calls.append(1)
        return len(calls) > 5  # the 6th check says stop: 5 steps done

    model, start, res = run("mlp", recipe, batches, seed=5, stop=deadline)
    want, _, _ = oracle(model, start, take(batches, 5), recipe)
    assert torch.equal(res.weights, want)
    assert (res.steps, res.examples, res.complete, len(calls)) == (5, 30, False, 6)
    assert res.work_done(recipe) == 5.0 and res.epochs == pytest.approx(5 / 3)

    _, _, res = run("mlp", recipe, batches, seed=5, stop=lambda: False)
    assert (res.steps, res.complete) == (8, True)
    _, _, res = run("mlp", recipe, batches, seed=5, stop=lambda: True)
    assert (res.steps, res.complete) == (0, False)


class Unsized:
    """An iterable without len(), like a DataLoader over an IterableDataset."""

    def __init__(self, batches: list[Batch]) -> None:
        self.batches = batches

    def __iter__(self) -> Iterator[Batch]:
        return iter(self.batches)


def test_loader_without_len_runs_whole_epochs_and_steps() -> None:
    batches = batch_list("mlp", [5, 5, 3], seed=81)
    recipe = Recipe(local_epochs=2, learning_rate=0.05, batch_size=5)
    model, start, res = run("mlp", recipe, Unsized(batches), seed=3)
    want, _, _ = oracle(model, start, batches * 2, recipe)
    assert torch.equal(res.weights, want)
    assert (res.steps, res.epochs, res.complete, res.num_samples) == (6, 2.0, True, 13)

    steps = Recipe(local_epochs=None, local_steps=4, learning_rate=0.05, batch_size=5)
    _, _, res = run("mlp", steps, Unsized(batches), seed=3)
    assert (res.steps, res.complete, res.epochs) == (4, True, pytest.approx(4 / 3))

    with pytest.raises(ValueError, match="fractional local_epochs"):
        run("mlp", Recipe(local_epochs=1.5, batch_size=5), Unsized(batches))


# ----------------------------------------------------------------------------- state and modes


def test_parameters_stay_bound_to_the_flat_views() -> None:
    batches = batch_list("cnn", [4, 4], seed=91)
    model = cnn(2)
    layout = ModelLayout.from_module(model)
    recipe = Recipe(
        local_epochs=None, local_steps=3, learning_rate=0.05, batch_size=4, momentum=0.9
    )
    res = train(model, batches, recipe, start_for(model, 3))
    params = list(model.parameters())
    base = params[0].untyped_storage().data_ptr()
    grad_base = params[0].grad.untyped_storage().data_ptr()
    for spec, p in zip(layout.specs, params, strict=True):
        assert p.untyped_storage().data_ptr() == base and p.storage_offset() == spec.offset
        assert p.grad.untyped_storage().data_ptr() == grad_base
        assert p.grad.storage_offset() == spec.offset
        assert not p.grad.any()  # zeroed in place after the last step
    flat = torch.empty(0).set_(params[0].untyped_storage(), 0, (layout.numel,))
    assert torch.equal(flat, res.weights)
    # The result is the caller's own tensor: the model's next job cannot overwrite it.
    assert res.weights.untyped_storage().data_ptr() != base
    kept = res.weights.clone()
    second = train(model, batches, recipe, res.weights)
    assert torch.equal(res.weights, kept)
    want, _, _ = oracle(cnn(2), kept, take(batches, 3), recipe)
    assert torch.equal(second.weights, want)


def test_a_broken_binding_fails_loudly() -> None:
    batches = batch_list("mlp", [4, 4], seed=92)
    model = mlp(0)

    def rebinding_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        model.zero_grad(set_to_none=True)  # grads would go to fresh tensors, not the buffer
        return F.cross_entropy(out, y)

    recipe = Recipe(local_epochs=None, local_steps=2, learning_rate=0.05, batch_size=4)
    with pytest.raises(RuntimeError, match="no longer a view of the flat buffers"):
        train(model, batches, recipe, start_for(model, 1), loss_fn=rebinding_loss)


def test_batchnorm_buffers_are_returned_and_changed() -> None:
    batches = batch_list("cnn", [10, 10], seed=93)
    model = cnn(4)
    layout = ModelLayout.from_module(model)
    before = layout.flatten_buffers(model)
    recipe = Recipe(local_epochs=1, learning_rate=0.05, batch_size=10)
    res = train(model, batches, recipe, start_for(model, 5))
    assert res.buffers is not None and res.buffers.shape == (layout.buffer_numel,)
    assert res.buffers.dtype == torch.float32
    assert not torch.equal(res.buffers, before)
    # running_var moved from its initial 1 towards the batch variances, running_mean off 0.
    mean = layout.unflatten_buffers(res.buffers)
    assert mean is not None and mean["1.running_mean"].abs().max() > 0
    num_batches = dict(model.named_buffers())["1.num_batches_tracked"]
    assert int(num_batches) == 2  # integer buffers stay outside the flat section but advance


def test_start_buffers_are_loaded_before_training() -> None:
    """The job's statistics replace the model's own; the first BatchNorm layer's running mean
    after one step is the momentum mix of them and the batch mean (checked by hand)."""
    batches = batch_list("cnn", [10], seed=95)
    model = cnn(6)
    layout = ModelLayout.from_module(model)
    g = torch.Generator().manual_seed(7)
    job_buffers = torch.rand(layout.buffer_numel, generator=g) + 0.5
    start = start_for(model, 8)
    recipe = Recipe(local_epochs=None, local_steps=1, learning_rate=0.05, batch_size=10)
    res = train(model, batches, recipe, start, start_buffers=job_buffers, max_steps=0)
    assert torch.equal(res.buffers, job_buffers)  # no step: exactly what the job sent
    res = train(model, batches, recipe, start, start_buffers=job_buffers)
    with torch.no_grad():
        conv = torch.nn.functional.conv2d(batches[0][0], start[: 6 * 27].view(6, 3, 3, 3),
                                          start[6 * 27 : 6 * 28])  # fmt: skip
    batch_mean = conv.mean(dim=(0, 2, 3))
    want = 0.9 * job_buffers[:6] + 0.1 * batch_mean
    torch.testing.assert_close(res.buffers[:6], want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="start_buffers"):
        train(model, batches, recipe, start, start_buffers=job_buffers[:-1])
    mlp_model = mlp(1)
    with pytest.raises(ValueError, match="no float buffers"):
        train(mlp_model, batch_list("mlp", [4], seed=1), recipe, start_for(mlp_model, 1),
              start_buffers=job_buffers)  # fmt: skip


def test_mlp_without_buffers_returns_none() -> None:
    recipe = Recipe(local_epochs=None, local_steps=1, learning_rate=0.05, batch_size=4)
    _, _, res = run("mlp", recipe, batch_list("mlp", [4], seed=94))
    assert res.buffers is None


def test_train_mode_during_training_and_previous_mode_restored() -> None:
    model = cnn(0)
    seen: list[bool] = []
    model[1].register_forward_hook(lambda m, i, o: seen.append(m.training))
    recipe = Recipe(local_epochs=None, local_steps=2, learning_rate=0.05, batch_size=4)
    batches = batch_list("cnn", [4, 4], seed=95)
    model.eval()
    train(model, batches, recipe, start_for(model, 1))
    assert seen == [True, True] and not model.training
    model.train()
    train(model, batches, recipe, start_for(model, 1))
    assert model.training


def test_two_runs_are_bitwise_identical() -> None:
    data = make_data("cnn", 40, seed=96)
    recipe = Recipe(
        local_epochs=1.5, learning_rate=0.05, batch_size=8, momentum=0.9, proximal_mu=0.1
    )
    results = [run("cnn", recipe, shuffled(data, 8, seed=12), seed=9)[2] for _ in range(2)]
    a, b = results
    assert torch.equal(a.weights, b.weights) and torch.equal(a.delta, b.delta)
    assert a.buffers is not None and b.buffers is not None and torch.equal(a.buffers, b.buffers)
    assert (a.steps, a.examples, a.mean_loss) == (b.steps, b.examples, b.mean_loss)


def test_progress_callback_sees_every_step() -> None:
    seen: list[tuple[int, int | None, float]] = []
    recipe = Recipe(local_epochs=None, local_steps=4, learning_rate=0.05, batch_size=4)
    batches = batch_list("mlp", [4, 4, 4], seed=97)
    _, _, res = run(
        "mlp",
        recipe,
        batches,
        max_steps=3,
        progress=lambda s, total, loss: seen.append((s, total, loss.item())),
    )
    assert [(s, t) for s, t, _ in seen] == [(1, 3), (2, 3), (3, 3)]
    assert res.mean_loss == pytest.approx(sum(v for *_, v in seen) / 3, rel=1e-6)


def test_num_samples_is_the_dataset_length_and_examples_count_the_batches() -> None:
    data = make_data("mlp", 23, seed=98)
    recipe = Recipe(local_epochs=2, learning_rate=0.05, batch_size=5)
    _, _, res = run("mlp", recipe, shuffled(data, 5, seed=1))
    assert (res.num_samples, res.examples, res.steps) == (23, 46, 10)


# ----------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("solver", [0.0, 1.0], ids=["subgradient", "prox"])
def test_elastic_net_can_leave_biases_unpenalised(solver: float) -> None:
    """With elastic_exclude_biases the bias entries take exactly the plain SGD step, the
    weight entries exactly the penalised one (docs/algorithms/feden.md G14)."""
    model = mlp(0)
    layout = ModelLayout.from_module(model)
    start = start_for(model, 1)
    batches = batch_list("mlp", [4], seed=1)

    def run(**extra) -> torch.Tensor:
        recipe = Recipe(local_epochs=None, local_steps=1, learning_rate=0.1,
                        elastic_lambda=0.5 if extra else 0.0, elastic_alpha=0.5,
                        extra={"elastic_solver": solver, **extra})  # fmt: skip
        return train(model, batches, recipe, start, layout=layout).weights.clone()

    plain = run()
    penalised = run(elastic_exclude_biases=0.0)
    excluded = run(elastic_exclude_biases=1.0)
    bias = torch.zeros(layout.numel, dtype=torch.bool)
    offs = layout.offsets.tolist()
    for i, name in enumerate(layout.names):
        if name.endswith("bias"):
            bias[offs[i] : offs[i + 1]] = True
    assert bias.any() and (~bias).any()
    assert torch.equal(excluded[bias], plain[bias])
    assert torch.equal(excluded[~bias], penalised[~bias])
    assert not torch.equal(penalised[bias], plain[bias])  # the option did something
    with pytest.raises(ValueError, match="elastic_exclude_biases"):
        run(elastic_exclude_biases=2.0)


def test_bad_arguments_are_refused_with_a_reason() -> None:
    model = mlp(0)
    batches = batch_list("mlp", [4], seed=1)
    recipe = Recipe(local_epochs=None, local_steps=1, batch_size=4)
    start = start_for(model, 1)
    with pytest.raises(ValueError, match=r"start must be a flat floating \[\d+\] tensor"):
        train(model, batches, recipe, start[:-1])
    with pytest.raises(ValueError, match="basis"):
        train(model, batches, recipe, start, basis=torch.zeros(3))
    with pytest.raises(ValueError, match="no batches"):
        train(model, [], recipe, start)
    with pytest.raises(ValueError, match="max_steps"):
        train(model, batches, recipe, start, max_steps=-1)


# ----------------------------------------------------------------------------- CUDA


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_training_matches_the_oracle() -> None:
    batches = batch_list("cnn", [8, 8, 8], seed=99)
    recipe = Recipe(
        local_epochs=2, learning_rate=0.05, batch_size=8, momentum=0.9, proximal_mu=0.05
    )
    model, start, res = run("cnn", recipe, batches, seed=2, device="cuda")
    assert res.weights.is_cuda and res.delta.is_cuda
    on_cuda = [(x.cuda(), y.cuda()) for x, y in take(batches, 6)]
    want, want_buffers, _ = oracle(model.cuda(), start.cuda(), on_cuda, recipe)
    # Not bit-exact: torch.optim.SGD takes its foreach path on CUDA, and cuDNN picks kernels.
    torch.testing.assert_close(res.weights, want, rtol=1e-5, atol=1e-6)
    assert res.buffers is not None
    torch.testing.assert_close(res.buffers, want_buffers, rtol=1e-5, atol=1e-6)
    assert torch.equal(res.delta, res.weights - start.cuda())
