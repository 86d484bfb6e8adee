"""The papers' networks, built by name for any ``(C, H, W)`` input.

``build_model(name, input_shape, num_classes, **kwargs)`` returns a fresh ``torch.nn.Module``
whose forward maps ``[B, C, H, W]`` to logits ``[B, num_classes]``. ``MODELS`` maps each name to
its builder; a name of the form ``"package.module:callable"`` calls a user factory as
``callable(input_shape=..., num_classes=..., **kwargs)`` instead.

Parameter counts on 1x28x28 inputs with 10 classes (they pin the architectures down):

* ``lenet5``: 61,706. FedHist's LeNet-5 (docs/algorithms/fedhist.md section 2, "model"): conv 5x5 6
  (padding 2 on inputs smaller than 32x32) - ReLU - maxpool 2 - conv 5x5 16 - ReLU - maxpool 2 - fc
  120 - fc 84 - fc C, with biases. 62,006 on 3x32x32 (CIFAR-10, no padding), as the spec says.
* ``lenet5_orthofl``: 44,190. ORTHOFL's LeNet5 (docs/algorithms/orthofl.md section 2.1, "Model
  details"): the same shape with average pooling, no padding and no biases anywhere. With
  ``batch_norm=True`` a BatchNorm after each convolution: 44,234 parameters and 44 running
  statistics (ORTHOFL's BatchNorm handling, spec G6, on the MNIST setting).
* ``cnn_fedavg``: 1,663,370. FedEN's MNIST CNN after McMahan et al. (docs/algorithms/feden.md
  section 2, "Models"): conv 5x5 32 (padding 2) - pool - conv 5x5 64 (padding 2) - pool - fc 512 -
  fc C.
* ``mlp_feddgic``: 118,282. FedDGIC's three fully connected layers (docs/algorithms/feddgic.md
  section 2.2, "MNIST model"): 784-128-128-10 with tanh (the softmax lives in the loss).

Also ``logreg`` (flatten + linear), ``mlp`` (one hidden ReLU layer of 200 units by default) and
``small_cnn_bn`` (two conv + BatchNorm blocks, for tests of BatchNorm buffers). Every model draws
its initial weights from torch's global generator, so ``torch.manual_seed`` makes them
reproducible.
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from aggsrv.imports import load_callable

__all__ = ["MODELS", "build_model"]

ModelBuilder = Callable[..., nn.Module]

_ACTIVATIONS: dict[str, type[nn.Module]] = {"relu": nn.ReLU, "tanh": nn.Tanh}


def _check_shape(input_shape: Sequence[int]) -> tuple[int, int, int]:
    """``input_shape`` as a validated ``(C, H, W)`` tuple of positive ints."""
    try:
        shape = tuple(input_shape)
    except TypeError:
        raise ValueError(f"input_shape must be (C, H, W), got {input_shape!r}") from None
    if len(shape) != 3 or not all(
        isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in shape
    ):
        raise ValueError(f"input_shape must be three positive ints (C, H, W), got {input_shape!r}")
    return shape  # type: ignore[return-value]


def _check_classes(num_classes: int) -> int:
    if not isinstance(num_classes, int) or isinstance(num_classes, bool) or num_classes < 1:
        raise ValueError(f"num_classes must be a positive int, got {num_classes!r}")
    return num_classes


@dataclass(frozen=True)
class _Stage:
    """One spatial step of a conv net: a convolution or a pooling window."""

    name: str
    kernel: int
    stride: int = 1
    padding: int = 0

    def out(self, size: int) -> int:
        return (size + 2 * self.padding - self.kernel) // self.stride + 1


def _spatial(model: str, stages: Sequence[_Stage], shape: tuple[int, int, int]) -> tuple[int, int]:
    """The (H, W) after ``stages``; a ValueError naming the smallest input that works if the
    feature map would vanish, so the flatten size is computed instead of hard-coded."""
    _, h, w = shape
    for stage in stages:
        h, w = stage.out(h), stage.out(w)
        if h < 1 or w < 1:
            # A handful of stages: a linear search for the smallest size that works is instant.
            smallest = next(s for s in range(1, 4096) if _passes(stages, s))
            raise ValueError(
                f"input {'x'.join(map(str, shape))} is too small for {model}: the feature map "
                f"after {stage.name} would be {max(h, 0)}x{max(w, 0)}; {model} needs H and W "
                f">= {smallest}"
            )
    return h, w


def _passes(stages: Sequence[_Stage], size: int) -> bool:
    for stage in stages:
        size = stage.out(size)
        if size < 1:
            return False
    return True


class LogReg(nn.Module):
    """Multinomial logistic regression: flatten, then one linear layer."""

    def __init__(self, shape: tuple[int, int, int], num_classes: int) -> None:
        super().__init__()
        c, h, w = shape
        self.fc = nn.Linear(c * h * w, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(x, 1))


class MLP(nn.Module):
    """Flatten, then ``fc1 .. fcN`` with an activation between consecutive layers."""

    def __init__(
        self,
        shape: tuple[int, int, int],
        num_classes: int,
        hidden: Sequence[int],
        activation: str,
    ) -> None:
        super().__init__()
        if activation not in _ACTIVATIONS:
            raise ValueError(
                f"activation must be one of {sorted(_ACTIVATIONS)}, got {activation!r}"
            )
        widths = [shape[0] * shape[1] * shape[2], *hidden, num_classes]
        # Registered as fc1, fc2, ... (parameters "fc1.weight", ...) so layerwise strategies
        # such as FedDGIC's per-module cosine see the paper's layers by name.
        self._names = [f"fc{i + 1}" for i in range(len(widths) - 1)]
        for name, (a, b) in zip(self._names, itertools.pairwise(widths), strict=True):
            self.add_module(name, nn.Linear(a, b))
        self.act = _ACTIVATIONS[activation]()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.flatten(x, 1)
        for name in self._names[:-1]:
            x = self.act(getattr(self, name)(x))
        return getattr(self, self._names[-1])(x)


class LeNet5(nn.Module):
    """LeNet-5: two 5x5 conv + pool blocks, then fc 120 - fc 84 - fc C, ReLU throughout."""

    def __init__(
        self,
        shape: tuple[int, int, int],
        num_classes: int,
        *,
        model: str,
        padding: int,
        pool: str,
        bias: bool,
        batch_norm: bool = False,
    ) -> None:
        super().__init__()
        stages = [
            _Stage("conv1", 5, padding=padding),
            _Stage("pool1", 2, stride=2),
            _Stage("conv2", 5),
            _Stage("pool2", 2, stride=2),
        ]
        h, w = _spatial(model, stages, shape)
        pool_cls = {"max": nn.MaxPool2d, "avg": nn.AvgPool2d}[pool]
        self.conv1 = nn.Conv2d(shape[0], 6, 5, padding=padding, bias=bias)
        self.conv2 = nn.Conv2d(6, 16, 5, bias=bias)
        self.pool = pool_cls(2, 2)
        self.fc1 = nn.Linear(16 * h * w, 120, bias=bias)
        self.fc2 = nn.Linear(120, 84, bias=bias)
        self.fc3 = nn.Linear(84, num_classes, bias=bias)
        self.bn1 = nn.BatchNorm2d(6) if batch_norm else nn.Identity()
        self.bn2 = nn.BatchNorm2d(16) if batch_norm else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(torch.relu(self.bn1(self.conv1(x))))
        x = self.pool(torch.relu(self.bn2(self.conv2(x))))
        x = torch.flatten(x, 1)
        x = torch.relu(self.fc1(x))
        x = torch.relu(self.fc2(x))
        return self.fc3(x)


class CNNFedAvg(nn.Module):
    """McMahan et al.'s MNIST "CNN": conv5x5 32 - pool - conv5x5 64 - pool - fc 512 - fc C."""

    def __init__(self, shape: tuple[int, int, int], num_classes: int) -> None:
        super().__init__()
        stages = [
            _Stage("conv1", 5, padding=2),
            _Stage("pool1", 2, stride=2),
            _Stage("conv2", 5, padding=2),
            _Stage("pool2", 2, stride=2),
        ]
        h, w = _spatial("cnn_fedavg", stages, shape)
        self.conv1 = nn.Conv2d(shape[0], 32, 5, padding=2)
        self.conv2 = nn.Conv2d(32, 64, 5, padding=2)
        self.pool = nn.MaxPool2d(2, 2)
        self.fc1 = nn.Linear(64 * h * w, 512)
        self.fc2 = nn.Linear(512, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(torch.relu(self.conv1(x)))
        x = self.pool(torch.relu(self.conv2(x)))
        x = torch.relu(self.fc1(torch.flatten(x, 1)))
        return self.fc2(x)


class SmallCNNBN(nn.Module):
    """Two 3x3 conv + BatchNorm + ReLU blocks, global average pooling and a linear head.

    Small and size-agnostic: it exists so tests exercise BatchNorm's running statistics and
    ``num_batches_tracked`` (non-trainable buffers) on any input of at least 2x2.
    """

    def __init__(self, shape: tuple[int, int, int], num_classes: int, width: int) -> None:
        super().__init__()
        _spatial("small_cnn_bn", [_Stage("conv1", 3, padding=1), _Stage("pool1", 2, 2)], shape)
        self.conv1 = nn.Conv2d(shape[0], width, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, 2 * width, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(2 * width)
        self.fc = nn.Linear(2 * width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.max_pool2d(torch.relu(self.bn1(self.conv1(x))), 2)
        x = torch.relu(self.bn2(self.conv2(x)))
        return self.fc(torch.flatten(torch.mean(x, dim=(2, 3), keepdim=True), 1))


def _hidden_widths(hidden: int | Sequence[int]) -> tuple[int, ...]:
    widths = (hidden,) if isinstance(hidden, int) else tuple(hidden)
    if not widths or not all(isinstance(v, int) and not isinstance(v, bool) for v in widths):
        raise ValueError(f"hidden must be a positive int or a sequence of them, got {hidden!r}")
    if min(widths) < 1:
        raise ValueError(f"hidden widths must be positive, got {hidden!r}")
    return widths


def logreg(input_shape: Sequence[int], num_classes: int) -> nn.Module:
    """Flatten + linear."""
    return LogReg(_check_shape(input_shape), _check_classes(num_classes))


def mlp(
    input_shape: Sequence[int],
    num_classes: int,
    *,
    hidden: int | Sequence[int] = 200,
    activation: str = "relu",
) -> nn.Module:
    """Flatten, hidden layer(s) of ``hidden`` units (200 by default), ``activation`` between."""
    return MLP(
        _check_shape(input_shape), _check_classes(num_classes), _hidden_widths(hidden), activation
    )


def mlp_feddgic(input_shape: Sequence[int], num_classes: int) -> nn.Module:
    """FedDGIC's MNIST MLP: 784-128-128-10 with tanh (Parallel-SGD's default;
    docs/algorithms/feddgic.md 2.2)."""
    return MLP(_check_shape(input_shape), _check_classes(num_classes), (128, 128), "tanh")


def lenet5(
    input_shape: Sequence[int], num_classes: int, *, conv1_padding: int | None = None
) -> nn.Module:
    """FedHist's LeNet-5 (max pooling, biases).

    ``conv1_padding=None`` pads by 2 when the input is smaller than 32x32: LeNet-5 was built
    for 32x32 inputs, and FedHist's counts (61,706 on 28x28 FMNIST, 62,006 on 32x32 CIFAR-10)
    need exactly that. Pass an int to force a padding.
    """
    shape = _check_shape(input_shape)
    if conv1_padding is None:
        conv1_padding = 2 if min(shape[1:]) < 32 else 0
    if not isinstance(conv1_padding, int) or conv1_padding < 0:
        raise ValueError(f"conv1_padding must be a non-negative int, got {conv1_padding!r}")
    return LeNet5(
        shape,
        _check_classes(num_classes),
        model="lenet5",
        padding=conv1_padding,
        pool="max",
        bias=True,
    )


def lenet5_orthofl(
    input_shape: Sequence[int], num_classes: int, *, batch_norm: bool = False
) -> nn.Module:
    """ORTHOFL's LeNet5: average pooling, no padding, no biases (44,190 parameters on 28x28);
    ``batch_norm`` adds a BatchNorm after each convolution (not in the paper's model)."""
    if not isinstance(batch_norm, bool):
        raise ValueError(f"batch_norm must be true or false, got {batch_norm!r}")
    return LeNet5(
        _check_shape(input_shape),
        _check_classes(num_classes),
        model="lenet5_orthofl",
        padding=0,
        pool="avg",
        bias=False,
        batch_norm=batch_norm,
    )


def cnn_fedavg(input_shape: Sequence[int], num_classes: int) -> nn.Module:
    """FedEN's MNIST CNN, McMahan et al.'s "CNN" (1,663,370 parameters on 28x28)."""
    return CNNFedAvg(_check_shape(input_shape), _check_classes(num_classes))


def small_cnn_bn(input_shape: Sequence[int], num_classes: int, *, width: int = 8) -> nn.Module:
    """A small CNN with BatchNorm; ``width`` channels in the first block, twice that after."""
    if not isinstance(width, int) or isinstance(width, bool) or width < 1:
        raise ValueError(f"width must be a positive int, got {width!r}")
    return SmallCNNBN(_check_shape(input_shape), _check_classes(num_classes), width)


MODELS: dict[str, ModelBuilder] = {
    "logreg": logreg,
    "mlp": mlp,
    "mlp_feddgic": mlp_feddgic,
    "lenet5": lenet5,
    "lenet5_orthofl": lenet5_orthofl,
    "cnn_fedavg": cnn_fedavg,
    "small_cnn_bn": small_cnn_bn,
}


def _load_user_factory(name: str) -> ModelBuilder:
    """Import ``"package.module:attr.path"`` and return the callable it names."""
    return load_callable(name, "model")


def _check_kwargs(name: str, builder: ModelBuilder, kwargs: dict[str, object]) -> None:
    """Reject keyword arguments the builder does not take, naming the ones it does."""
    params = inspect.signature(builder).parameters
    accepted = [p.name for p in params.values() if p.kind is inspect.Parameter.KEYWORD_ONLY]
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown:
        takes = ", ".join(accepted) if accepted else "no options"
        raise ValueError(f"model {name!r} does not take {unknown}; it takes: {takes}")


def build_model(
    name: str, input_shape: tuple[int, int, int], num_classes: int, **kwargs: object
) -> nn.Module:
    """A fresh model ``name`` for ``input_shape = (C, H, W)`` and ``num_classes`` outputs.

    ``name`` is a key of ``MODELS`` or ``"module:callable"``; ``kwargs`` are the model's
    options (e.g. ``hidden=`` for ``mlp``). Raises ValueError for an unknown name or option, a
    bad shape, or an input too small for a conv net.
    """
    if not isinstance(name, str):
        raise ValueError(f"model name must be a string, got {name!r}")
    if ":" in name:
        factory = _load_user_factory(name)
        model = factory(input_shape=tuple(input_shape), num_classes=num_classes, **kwargs)
        if not isinstance(model, nn.Module):
            raise ValueError(
                f"user model {name!r} returned {type(model).__name__}, not a torch.nn.Module"
            )
        return model
    try:
        builder = MODELS[name]
    except KeyError:
        raise ValueError(
            f"unknown model {name!r}; known: {', '.join(sorted(MODELS))}, or 'module:callable'"
        ) from None
    _check_kwargs(name, builder, kwargs)
    return builder(input_shape, num_classes, **kwargs)
