"""The simulator's models: the papers' exact parameter counts, shapes, errors, user models."""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch
from torch import nn

from aggsrv.layout import ModelLayout
from aggsrv.sim.models import MODELS, build_model

MNIST = (1, 28, 28)
DIGITS = (1, 8, 8)  # scikit-learn's digits, the simulator's embedded default
CIFAR = (3, 32, 32)
# Conv nets whose two 5x5 convolutions cannot fit in 8x8.
TOO_SMALL_FOR_DIGITS = {"lenet5", "lenet5_orthofl"}


def count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    ("name", "expected", "spec"),
    [
        ("lenet5", 61_706, "docs/algorithms/fedhist.md 2: LeNet-5, FMNIST, conv1 padding 2"),
        ("lenet5_orthofl", 44_190, "docs/algorithms/orthofl.md 2.1: LeNet5, no biases, avg pool"),
        ("cnn_fedavg", 1_663_370, "docs/algorithms/feden.md section 2: McMahan et al.'s MNIST CNN"),
        ("mlp_feddgic", 118_282, "docs/algorithms/feddgic.md 2.2: 784-128-128-10"),
    ],
)
def test_paper_parameter_counts(name: str, expected: int, spec: str) -> None:
    assert count(build_model(name, MNIST, 10)) == expected, spec


def test_lenet5_counts_on_cifar_and_without_padding() -> None:
    # docs/algorithms/fedhist.md: 62,006 on CIFAR-10, 69,656 on CIFAR-100, 44,426
    # on FMNIST without padding.
    assert count(build_model("lenet5", CIFAR, 10)) == 62_006
    assert count(build_model("lenet5", CIFAR, 100)) == 69_656
    assert count(build_model("lenet5", MNIST, 10, conv1_padding=0)) == 44_426


def test_orthofl_lenet5_has_no_biases_and_average_pooling() -> None:
    model = build_model("lenet5_orthofl", MNIST, 10)
    assert not any(name.endswith("bias") for name, _ in model.named_parameters())
    assert any(isinstance(m, nn.AvgPool2d) for m in model.modules())


def test_orthofl_lenet5_with_batch_norm_adds_statistics_only_where_asked() -> None:
    plain = build_model("lenet5_orthofl", MNIST, 10)
    torch.manual_seed(3)
    bn = build_model("lenet5_orthofl", MNIST, 10, batch_norm=True)
    layout = ModelLayout.from_module(bn)
    assert count(bn) == 44_190 + 2 * (6 + 16) and layout.buffer_numel == 2 * (6 + 16)
    assert ModelLayout.from_module(plain).buffer_numel == 0
    # The BatchNorm layers normalise each conv output: in train mode a batch's conv1
    # activations come out of bn1 with mean 0 per channel.
    x = torch.randn(8, *MNIST)
    bn.train()
    out = bn.bn1(bn.conv1(x))
    torch.testing.assert_close(out.mean(dim=(0, 2, 3)), torch.zeros(6), rtol=0, atol=1e-5)


def test_mlp_layers_and_options() -> None:
    assert count(build_model("mlp", MNIST, 10)) == 784 * 200 + 200 + 200 * 10 + 10
    model = build_model("mlp", DIGITS, 10, hidden=(32, 16), activation="tanh")
    names = [name for name, _ in model.named_parameters()]
    assert names == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias", "fc3.weight", "fc3.bias"]
    assert count(model) == 64 * 32 + 32 + 32 * 16 + 16 + 16 * 10 + 10
    assert count(build_model("logreg", DIGITS, 10)) == 64 * 10 + 10


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("shape", [MNIST, DIGITS, CIFAR], ids=["1x28x28", "1x8x8", "3x32x32"])
def test_forward_shape(name: str, shape: tuple[int, int, int]) -> None:
    if shape == DIGITS and name in TOO_SMALL_FOR_DIGITS:
        pytest.skip("too small for two 5x5 convolutions (tested below)")
    model = build_model(name, shape, 7)
    out = model(torch.randn(3, *shape))
    assert out.shape == (3, 7)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize(
    ("name", "shape", "smallest"),
    [
        ("lenet5", DIGITS, 12),
        ("lenet5_orthofl", DIGITS, 16),
        ("lenet5_orthofl", (1, 28, 15), 16),
        ("cnn_fedavg", (1, 3, 3), 4),
        ("small_cnn_bn", (1, 1, 1), 2),
    ],
)
def test_too_small_input_is_a_clear_error(name: str, shape: tuple, smallest: int) -> None:
    with pytest.raises(ValueError, match=rf"too small for {name}.*needs H and W >= {smallest}"):
        build_model(name, shape, 10)
    side = (shape[0], smallest, smallest)
    assert build_model(name, side, 10)(torch.randn(2, *side)).shape == (2, 10)


def test_batchnorm_model_has_buffers_that_train_mode_updates() -> None:
    model = build_model("small_cnn_bn", DIGITS, 10)
    buffers = dict(model.named_buffers())
    assert {"bn1.running_mean", "bn1.running_var", "bn1.num_batches_tracked"} <= set(buffers)
    model.train()
    model(torch.randn(4, *DIGITS))
    assert int(buffers["bn1.num_batches_tracked"]) == 1
    assert not torch.equal(buffers["bn1.running_mean"], torch.zeros(8))


@pytest.mark.parametrize("name", sorted(MODELS))
def test_initialisation_is_deterministic_given_the_seed(name: str) -> None:
    def weights(seed: int) -> list[torch.Tensor]:
        torch.manual_seed(seed)
        return [t.clone() for t in build_model(name, MNIST, 10).state_dict().values()]

    a, b, c = weights(5), weights(5), weights(6)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(torch.equal(x, y) for x, y in zip(a, c, strict=True))


@pytest.fixture
def user_module(tmp_path, monkeypatch) -> str:
    """A throwaway module on sys.path holding user model factories."""
    (tmp_path / "my_sim_models.py").write_text(
        textwrap.dedent(
            """
            from torch import nn

            def tiny(input_shape, num_classes, width=4):
                c, h, w = input_shape
                hidden = nn.Linear(c * h * w, width)
                return nn.Sequential(nn.Flatten(), hidden, nn.ReLU(), nn.Linear(width, num_classes))

            class Factories:
                @staticmethod
                def nested(input_shape, num_classes):
                    return tiny(input_shape, num_classes, width=2)

            def not_a_model(input_shape, num_classes):
                return 42

            value = 3
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_sim_models"
    sys.modules.pop("my_sim_models", None)


def test_user_model(user_module: str) -> None:
    model = build_model(f"{user_module}:tiny", DIGITS, 10, width=5)
    assert count(model) == 64 * 5 + 5 + 5 * 10 + 10
    assert model(torch.randn(2, *DIGITS)).shape == (2, 10)
    nested = build_model(f"{user_module}:Factories.nested", DIGITS, 3)
    assert nested(torch.randn(2, *DIGITS)).shape == (2, 3)


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("no_such_module_xyz:make", "cannot import module 'no_such_module_xyz'"),
        ("{mod}:missing", "has no attribute 'missing'"),
        ("{mod}:value", "does not name a callable"),
        ("{mod}:not_a_model", "returned int, not a torch.nn.Module"),
        ("{mod}:", "is 'module:callable'"),
    ],
)
def test_user_model_errors(user_module: str, name: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_model(name.format(mod=user_module), DIGITS, 10)


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        (("resnet", MNIST, 10), {}, r"unknown model 'resnet'; known: cnn_fedavg, lenet5"),
        (("mlp", MNIST, 10), {"depth": 3}, r"does not take \['depth'\]; it takes: hidden"),
        (("lenet5", MNIST, 10), {"hidden": 3}, r"it takes: conv1_padding"),
        (("logreg", MNIST, 10), {"x": 1}, r"it takes: no options"),
        (("mlp", (28, 28), 10), {}, r"input_shape must be three positive ints"),
        (("mlp", (1, 0, 28), 10), {}, r"input_shape must be three positive ints"),
        (("mlp", MNIST, 0), {}, r"num_classes must be a positive int"),
        (("mlp", MNIST, 10), {"hidden": 0}, r"hidden widths must be positive"),
        (("mlp", MNIST, 10), {"activation": "gelu"}, r"activation must be one of"),
        (("lenet5", MNIST, 10), {"conv1_padding": -1}, r"conv1_padding must be"),
        (("small_cnn_bn", MNIST, 10), {"width": 0}, r"width must be a positive int"),
        (("lenet5_orthofl", MNIST, 10), {"batch_norm": 1}, r"batch_norm must be true or false"),
    ],
)
def test_bad_arguments(args: tuple, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_model(*args, **kwargs)
