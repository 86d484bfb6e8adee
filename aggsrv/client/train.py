"""The local-training loop a client runs for one job: a recipe's SGD over flat parameter buffers.

:func:`train` loads the job's start weights into a torch model, binds its parameters and
gradients to two flat ``[D]`` buffers (:meth:`aggsrv.layout.ModelLayout.bind_flat`) and runs the
recipe's work (``local_epochs`` or ``local_steps``) over a DataLoader. Each step is a handful of
vector operations over the whole flat buffer, never a per-parameter Python loop:

* ``g`` = the gradient of the batch loss, accumulated into the flat gradient buffer by autograd;
* FedProx (Li et al. 2020): ``g += mu * (w - start)``, the gradient of ``mu/2 * |w - start|^2``;
* FedEN's elastic net ``lambda * ((1-alpha)/2 * |w - a|^2 + alpha * |w - a|_1)``
  (docs/algorithms/feden.md 1.6, 1.7), once per step and not scaled by the batch: the subgradient
  solver (default) adds ``lambda*(1-alpha) * (w - a) + lambda*alpha * sign(w - a)`` to ``g``
  (sign(0) = 0); the prox solver instead follows the update with the exact prox of ``lr * penalty``,
  ``w = a + S(w - a, lr*lambda*alpha) / (1 + lr*lambda*(1-alpha))`` with the soft threshold
  ``S(z, t) = sign(z) * max(|z| - t, 0)``, which leaves exact zeros in ``w - a`` (+0.0, never
  -0.0). ``recipe.extra`` picks the variant (absent keys mean 0): ``elastic_centre`` 0 is
  ``a = 0`` (Eq. 9 literally, the default), 1 is ``a = start`` (the job's weights, FedProx-like);
  ``elastic_solver`` 0 is subgradient, 1 is prox;
* weight decay: ``g += wd * w``;
* Fed-OGD (``recipe.projection`` WHOLE or LAYERWISE with a job ``basis`` b):
  ``g -= c * b`` in place with ``c = <g,b>/|b|^2`` over the whole vector (WHOLE) or per tensor
  of the layout (LAYERWISE), clamped to ``c <= 0`` when ``recipe.only_conflicting`` (Eq. 4: only
  a conflicting gradient changes); no basis, or an all-zero basis, leaves plain SGD;
* momentum (``torch.optim.SGD`` semantics, dampening 0, no Nesterov): ``m = momentum*m + g``,
  ``g = m``;
* ``w -= lr * g``, then the flat gradient buffer is zeroed in place.

With ``recipe.extra["elastic_exclude_biases"] = 1`` the elastic net leaves biases (tensors whose
name ends in "bias") and normalisation-layer parameters unpenalised (docs/algorithms/feden.md G14).
The module depends on ``aggsrv.layout``, ``aggsrv.kernels`` and torch only (the layers:
``client`` never imports the strategies); a recipe is read by attribute, so any object with
:class:`Recipe`'s fields works.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from aggsrv import kernels
from aggsrv.layout import ModelLayout

if TYPE_CHECKING:
    from aggsrv.values import Recipe

__all__ = ["ProgressFn", "TrainResult", "train"]

logger = logging.getLogger(__name__)

# recipe.extra keys of FedEN's elastic net (docs/algorithms/feden.md 1.5-1.7); absent means 0.
ELASTIC_CENTRE = "elastic_centre"  # 0: a = 0 (Eq. 9), 1: a = the job's start weights
ELASTIC_SOLVER = "elastic_solver"  # 0: subgradient step, 1: proximal (soft-threshold) step
ELASTIC_EXCLUDE_BIASES = "elastic_exclude_biases"  # 1: biases and norm parameters unpenalised

# Called after every step with (steps done, steps planned or None when the loader has no len(),
# the batch loss as a detached 0-d tensor: calling .item() on it waits for the device).
ProgressFn = Callable[[int, "int | None", torch.Tensor], None]

# frac * batches carries float error (0.1 * 3 * 10 = 3.0000000000000004): without the slack a
# fractional epoch would take one batch more than intended.
_FRACTION_SLACK = 1e-9
_END = object()


@dataclass(frozen=True, eq=False)
class TrainResult:
    """What one job's local training did: final weights, delta, and the work it measured.

    ``weights``/``delta`` are fresh flat ``[D]`` float32 tensors on the training device, owned by
    the caller; ``delta`` is ``weights - start`` in float32. ``epochs`` counts completed epochs
    (fractional when stopped early, exactly the recipe's ``local_epochs`` when complete);
    ``num_samples`` is the dataset's length (examples of one pass when it has none);
    ``mean_loss`` is the example-weighted mean batch loss (NaN after zero steps); ``buffers`` is
    the flat float-buffer section (BatchNorm statistics) or None when the layout has none.
    """

    weights: torch.Tensor
    delta: torch.Tensor
    steps: int
    epochs: float
    examples: int
    num_samples: int
    mean_loss: float
    seconds: float
    complete: bool
    buffers: torch.Tensor | None = None

    @property
    def payload_bytes(self) -> int:
        """float32 bytes of what an update carries: the delta and the float buffers."""
        return 4 * (self.delta.numel() + (0 if self.buffers is None else self.buffers.numel()))

    def work_done(self, recipe: Recipe) -> float:
        """The work to report to the server: epochs if the recipe counts epochs, else steps."""
        return self.epochs if recipe.local_epochs is not None else float(self.steps)


class _FlatSGD:
    """One recipe step over the flat buffers: penalty gradients, direction, momentum, update."""

    def __init__(
        self,
        weights: torch.Tensor,
        grads: torch.Tensor,
        start: torch.Tensor,
        recipe: Any,
        basis: torch.Tensor | None = None,
        offsets: torch.Tensor | None = None,
        unpenalised: torch.Tensor | None = None,
    ) -> None:
        """Keep the bound buffers and allocate the state the recipe needs, once per job.

        ``unpenalised`` (int64 indices on the buffers' device) are left out of the elastic net.

        ``basis`` (on the buffers' device and dtype) turns on Fed-OGD's projection, per segment
        of ``offsets`` (layerwise) or over the whole vector (None); an all-zero basis is dropped
        once here, so such a job runs plain SGD without a projection pass per step.
        """
        projection = getattr(recipe.projection, "value", recipe.projection)
        if projection == "NONE" or basis is None or not bool(basis.any()):
            basis = None
        self.basis = basis
        self.offsets = offsets if projection == "LAYERWISE" else None
        self.only_conflicting = bool(recipe.only_conflicting)
        self.w = weights
        self.g = grads
        self.start = start
        self.lr = float(recipe.learning_rate)
        self.weight_decay = float(recipe.weight_decay)
        self.mu = float(recipe.proximal_mu)
        self.momentum = float(recipe.momentum)
        self.buf = torch.zeros_like(weights) if self.momentum != 0 else None
        self.scratch = torch.empty_like(weights) if self.mu != 0 else None
        # FedEN's elastic net: l1 = lambda*alpha, l2 = lambda*(1-alpha), centre None means a = 0.
        lam, alpha = float(recipe.elastic_lambda), float(recipe.elastic_alpha)
        at_start, self.prox, exclude = _elastic_options(recipe)
        self.unpenalised = unpenalised if exclude and unpenalised is not None else None
        self.l1 = lam * alpha
        self.l2 = lam * (1.0 - alpha)
        self.centre = start if at_start else None
        self.elastic = lam > 0
        self.escratch = torch.empty_like(weights) if self.elastic else None
        self._first = True

    def _gradient(self, g: torch.Tensor) -> None:
        """Add the penalty gradients to the loss gradient in place (the elastic net goes here)."""
        if self.scratch is not None:
            # Two roundings, (w - start) then * mu, as autograd does for mu/2 * |w - start|^2;
            # a fused add_(alpha=mu) would differ from that oracle in the last bit.
            torch.sub(self.w, self.start, out=self.scratch).mul_(self.mu)
            g.add_(self.scratch)
        if self.elastic and not self.prox:
            self._elastic_subgradient(g)
        if self.weight_decay != 0:
            g.add_(self.w, alpha=self.weight_decay)  # torch.optim.SGD's exact operation

    def _elastic_subgradient(self, g: torch.Tensor) -> None:
        """``g += l2 * (w - a) + l1 * sign(w - a)``: two passes over one scratch buffer."""
        s, c = self.escratch, self.centre
        assert s is not None
        if self.l2 != 0:
            # Rounded as FedProx's term: with alpha = 0 and a = start this is FedProx(mu=lambda).
            if c is None:
                torch.mul(self.w, self.l2, out=s)
            else:
                torch.sub(self.w, c, out=s).mul_(self.l2)
            if self.unpenalised is not None:
                s[self.unpenalised] = 0.0
            g.add_(s)
        if self.l1 != 0:
            if c is None:
                torch.sign(self.w, out=s)
            else:
                torch.sub(self.w, c, out=s).sign_()
            if self.unpenalised is not None:
                s[self.unpenalised] = 0.0
            g.add_(s, alpha=self.l1)  # l1 * (-1 | 0 | 1) is exact

    def _elastic_prox(self) -> None:
        """``w = a + S(w - a, lr*l1) / (1 + lr*l2)``: the exact prox of ``lr * penalty``."""
        s, c, w = self.escratch, self.centre, self.w
        assert s is not None
        kept = None if self.unpenalised is None else w[self.unpenalised]  # a copy (indexing)
        z = w if c is None else torch.sub(w, c, out=s)
        if self.l1 != 0:
            # softshrink: z - t above t, z + t below -t, else z * 0 (a signed zero).
            torch.ops.aten.softshrink.out(z, self.lr * self.l1, out=z)
        if self.l2 != 0:
            z.div_(1.0 + self.lr * self.l2)
        if c is None:
            w.add_(0.0)  # -0.0 + 0.0 = +0.0: exact zeros are +0.0 on the wire
        else:
            torch.add(c, z, out=w)  # c + (-0.0) == c bitwise
        if kept is not None:
            w[self.unpenalised] = kept  # unpenalised entries keep their SGD step exactly

    def _direction(self, g: torch.Tensor) -> torch.Tensor:
        """The direction momentum and the update act on: Fed-OGD's projection of ``g`` against
        the job's basis, in place (no copy of the gradient); ``g`` itself without a basis."""
        if self.basis is not None:
            kernels.project_out(
                g, self.basis, self.offsets, only_conflicting=self.only_conflicting, out=g
            )
        return g

    @torch.no_grad()
    def step(self) -> None:
        """Apply one SGD step from the accumulated flat gradient, then zero it."""
        g = self.g
        self._gradient(g)
        d = self._direction(g)
        if self.buf is not None:
            if self._first:
                self.buf.copy_(d)  # torch.optim.SGD starts the buffer as a copy of the gradient
            else:
                self.buf.mul_(self.momentum).add_(d)
            d = self.buf
        self._first = False
        self.w.add_(d, alpha=-self.lr)
        if self.elastic and self.prox:
            self._elastic_prox()  # after the data step (and its momentum): proximal SGD
        g.zero_()  # in place: the parameters' .grad stay views of this buffer


class _Passes:
    """Iterates a loader pass after pass, counting completed passes and batches in the current."""

    def __init__(self, loader: Iterable[Any], limit: int | None, pass_len: int | None) -> None:
        """Stop after ``limit`` passes (None: cycle forever); ``pass_len`` is len(loader)."""
        self.loader = loader
        self.limit = limit
        self.pass_len = pass_len
        self.done = 0
        self.in_pass = 0
        self._it: Any = None

    def next(self) -> Any:
        """The next batch, opening a new pass when one ends; ``_END`` after ``limit`` passes."""
        while True:
            if self._it is None:
                if self.limit is not None and self.done >= self.limit:
                    return _END
                self._it = iter(self.loader)
            try:
                batch = next(self._it)
            except StopIteration:
                if self.in_pass == 0:
                    raise ValueError("the loader yielded no batches in a pass") from None
                if self.pass_len is None:
                    self.pass_len = self.in_pass
                self.done += 1
                self.in_pass = 0
                self._it = None
                continue
            self.in_pass += 1
            return batch

    @property
    def epochs(self) -> float:
        """Completed passes, plus the fraction of the current one when the pass length is known."""
        if self.pass_len:
            return self.done + self.in_pass / self.pass_len
        return float(self.done)


def _sized(obj: Any) -> int | None:
    """``len(obj)``, or None for iterables without one (an IterableDataset's loader)."""
    try:
        return len(obj)
    except TypeError:
        return None


def _to(obj: Any, device: torch.device) -> Any:
    """Move the tensors of a (nested) batch to ``device``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, Mapping):
        return {k: _to(v, device) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_to(v, device) for v in obj)
    return obj


def _count(targets: Any) -> int:
    """Number of examples in a batch, read from its targets."""
    if isinstance(targets, torch.Tensor):
        return int(targets.shape[0]) if targets.dim() > 0 else 1
    return len(targets)


def _check_recipe(recipe: Any) -> None:
    """Refuse the recipe terms this loop does not implement yet, before touching the model."""
    projection = getattr(recipe.projection, "value", recipe.projection)
    if projection not in ("NONE", "WHOLE", "LAYERWISE"):
        raise ValueError(
            f"recipe.projection must be NONE, WHOLE or LAYERWISE, got {recipe.projection!r}"
        )
    _elastic_options(recipe)


def _elastic_options(recipe: Any) -> tuple[bool, bool, bool]:
    """(centre at the start weights, prox solver, exclude biases) from ``recipe.extra``, or a
    clear error."""
    extra = getattr(recipe, "extra", None) or {}
    choice = {}
    for key, meaning in (
        (ELASTIC_CENTRE, "0 (zero) or 1 (start)"),
        (ELASTIC_SOLVER, "0 or 1"),
        (ELASTIC_EXCLUDE_BIASES, "0 or 1"),
    ):
        value = float(extra.get(key, 0.0))
        if value not in (0.0, 1.0):
            raise ValueError(f"recipe.extra[{key!r}] must be {meaning}, got {value}")
        choice[key] = value == 1.0
    return choice[ELASTIC_CENTRE], choice[ELASTIC_SOLVER], choice[ELASTIC_EXCLUDE_BIASES]


def _unpenalised_indices(layout: ModelLayout) -> torch.Tensor:
    """Flat indices of biases (names ending in "bias") and normalisation-layer parameters."""
    offs = layout.offsets.tolist()
    norm = layout.is_norm.tolist()
    spans = [
        torch.arange(offs[i], offs[i + 1], dtype=torch.int64)
        for i, name in enumerate(layout.names)
        if name.endswith("bias") or norm[i]
    ]
    return torch.cat(spans) if spans else torch.empty(0, dtype=torch.int64)


def _check_flat(name: str, t: Any, dim: int) -> torch.Tensor:
    """A flat ``[D]`` floating tensor, or a ValueError that says what arrived."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 1 or t.numel() != dim or not t.is_floating_point():
        raise ValueError(
            f"{name} must be a flat floating [{dim}] tensor for this model's layout, "
            f"got {t.dtype} {tuple(t.shape)}"
        )
    return t


def _check_bound(
    model: nn.Module, layout: ModelLayout, flat_p: torch.Tensor, flat_g: torch.Tensor
) -> None:
    """Fail loudly if a parameter or its grad stopped being a view of the flat buffers."""
    named = dict(model.named_parameters())
    size = flat_p.element_size()
    for spec in layout.specs:
        if spec.numel == 0:
            continue
        p = named.get(spec.name)
        at = spec.offset * size
        if (
            p is None
            or p.data_ptr() != flat_p.data_ptr() + at
            or p.grad is None
            or p.grad.data_ptr() != flat_g.data_ptr() + at
        ):
            # A replaced .data or .grad takes the parameter out of the flat step: its updates
            # would be lost without a word.
            raise RuntimeError(
                f"parameter {spec.name!r} is no longer a view of the flat buffers: something "
                "replaced its .data or .grad during training (zero_grad(set_to_none=True), "
                "module.to(...), backward(create_graph=True)); zero grads in place instead"
            )


def train(
    model: nn.Module,
    loader: Iterable[Any],
    recipe: Recipe,
    start: torch.Tensor,
    *,
    loss_fn: Callable[..., torch.Tensor] = torch.nn.functional.cross_entropy,
    layout: ModelLayout | None = None,
    basis: torch.Tensor | None = None,
    start_buffers: torch.Tensor | None = None,
    device: torch.device | str | None = None,
    max_steps: int | None = None,
    stop: Callable[[], bool] | None = None,
    progress: ProgressFn | None = None,
) -> TrainResult:
    """Run ``recipe`` on ``model`` from the flat weights ``start`` over ``loader``'s batches.

    Batches are ``(inputs, targets)`` pairs; the loss is ``loss_fn(model(inputs), targets)``.
    ``local_epochs`` may be fractional (the last epoch stops after ceil(frac * len(loader))
    batches); ``local_steps`` cycles the loader, each new pass from a fresh ``iter(loader)``.
    ``max_steps`` caps the steps and ``stop()`` (checked before each step, e.g. a deadline) ends
    early; then ``complete`` is False and the result counts the work actually done.

    The model is moved to ``device`` (default: its own), put in train mode (its previous mode is
    restored) and left bound to the flat buffers holding the final weights. Runs are bitwise
    repeatable for the same model, batch order and recipe where the model's own kernels are
    deterministic (on CUDA see ``torch.use_deterministic_algorithms``). ``basis`` is the job's
    Fed-OGD basis, used when ``recipe.projection`` is not NONE (module docstring);
    ``elastic_exclude_biases`` leaves biases and normalisation parameters unpenalised.
    ``start_buffers`` (the job's flat float buffers, e.g. BatchNorm running statistics) are
    loaded into the model first; without them the model keeps its own. The result's
    ``buffers`` are the model's float buffers after training.
    """
    _check_recipe(recipe)
    if layout is None:
        layout = ModelLayout.from_module(model)
    dim = layout.numel
    if dim == 0:
        raise ValueError("the model has no trainable parameters")
    _check_flat("start", start, dim)
    if basis is not None:
        _check_flat("basis", basis, dim)
    if start_buffers is not None:
        if not layout.buffer_numel:
            raise ValueError("start_buffers given but the model has no float buffers")
        _check_flat("start_buffers", start_buffers, layout.buffer_numel)
    if max_steps is not None and max_steps < 0:
        raise ValueError(f"max_steps must be >= 0, got {max_steps}")

    batches_per_epoch = _sized(loader)
    if batches_per_epoch == 0:
        raise ValueError("the loader has no batches")
    loader_batch = getattr(loader, "batch_size", None)
    if loader_batch is not None and loader_batch != recipe.batch_size:
        logger.warning(
            "loader batch_size %s differs from the recipe's batch_size %s",
            loader_batch,
            recipe.batch_size,
        )

    # The recipe's whole work in steps (None: full passes of a loader without len()) and the
    # number of loader passes it spans.
    total: int | None
    if recipe.local_steps is not None:
        total, passes = int(recipe.local_steps), None
    else:
        epochs = float(recipe.local_epochs)
        full = math.floor(epochs)
        frac = epochs - full
        if batches_per_epoch is None:
            if frac > _FRACTION_SLACK:
                raise ValueError(
                    f"fractional local_epochs ({epochs}) need a loader with len() to know "
                    "where the last epoch ends"
                )
            total, passes = None, full
        else:
            tail = max(0, math.ceil(frac * batches_per_epoch - _FRACTION_SLACK))
            total = full * batches_per_epoch + tail
            passes = full + (1 if tail else 0)
    limit = total if max_steps is None else (max_steps if total is None else min(total, max_steps))

    if device is None:
        device = next(p for p in model.parameters() if p.requires_grad).device
    device = torch.device(device)
    was_training = model.training
    model.to(device)  # buffers (BatchNorm statistics) too; must precede bind_flat
    if start_buffers is not None:
        with torch.no_grad():
            layout.unflatten_buffers(start_buffers.to(device), model)
    flat_p, flat_g = layout.bind_flat(model)
    flat_p.copy_(start)
    start_w = start.to(device=flat_p.device, dtype=flat_p.dtype)
    basis_w = None if basis is None else basis.to(device=flat_p.device, dtype=flat_p.dtype)
    unpenalised = None
    if recipe.elastic_lambda > 0 and _elastic_options(recipe)[2]:
        unpenalised = _unpenalised_indices(layout).to(flat_p.device)
    sgd = _FlatSGD(flat_p, flat_g, start_w, recipe, basis_w, layout.offsets, unpenalised)
    stream = _Passes(loader, passes, batches_per_epoch)
    loss_sum = torch.zeros((), dtype=torch.float64, device=flat_p.device)
    steps = examples = first_pass = 0
    exhausted = False
    logger.debug("training %d parameters on %s: %s steps planned of %s", dim, device, limit, total)

    t0 = time.perf_counter()
    model.train()
    try:
        while limit is None or steps < limit:
            if stop is not None and stop():
                break
            batch = stream.next()
            if batch is _END:
                exhausted = True
                break
            try:
                inputs, targets = batch
            except (TypeError, ValueError):
                raise TypeError(
                    f"batches must be (inputs, targets) pairs, got {type(batch).__name__}"
                ) from None
            inputs, targets = _to(inputs, device), _to(targets, device)
            with torch.enable_grad():
                loss = loss_fn(model(inputs), targets)
                loss.backward()
            sgd.step()
            n = _count(targets)
            steps += 1
            examples += n
            if stream.done == 0:
                first_pass += n
            loss = loss.detach()
            loss_sum += loss.double() * n
            if steps == 1:
                _check_bound(model, layout, flat_p, flat_g)
            if progress is not None:
                progress(steps, limit, loss)
        _check_bound(model, layout, flat_p, flat_g)
    finally:
        model.train(was_training)

    complete = exhausted if total is None else steps >= total
    weights = flat_p.detach().to(torch.float32, copy=True)
    delta = weights - start.to(device=weights.device, dtype=torch.float32)
    buffers = (
        layout.flatten_buffers(model, dtype=torch.float32, device=weights.device)
        if layout.buffer_specs
        else None
    )
    if complete and recipe.local_epochs is not None:
        done_epochs = float(recipe.local_epochs)  # what the server compares work_done against
    else:
        done_epochs = stream.epochs
        target = recipe.local_epochs
        if not complete and target is not None and done_epochs >= target:
            # Partial work must read as partial (FedAvg drops work_done < work_target).
            done_epochs = math.nextafter(float(target), 0.0)
    dataset = getattr(loader, "dataset", None)
    num_samples = _sized(dataset) if dataset is not None else None
    if num_samples is None:
        num_samples = first_pass if stream.done else examples  # examples seen: a lower bound
    mean_loss = (loss_sum / examples).item() if examples else math.nan
    seconds = time.perf_counter() - t0
    logger.debug(
        "trained %d steps (%d examples, %.4g epochs, complete=%s) in %.3fs, mean loss %.6g",
        steps,
        examples,
        done_epochs,
        complete,
        seconds,
        mean_loss,
    )
    return TrainResult(
        weights=weights,
        delta=delta,
        steps=steps,
        epochs=done_epochs,
        examples=examples,
        num_samples=int(num_samples),
        mean_loss=mean_loss,
        seconds=seconds,
        complete=complete,
        buffers=buffers,
    )
