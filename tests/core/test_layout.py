"""Tests for aggsrv.layout: offsets, flags, hash, round trips, bind_flat and mismatch errors."""

from __future__ import annotations

import copy
import hashlib
import json
import re

import pytest
import torch
from torch import nn

from aggsrv.layout import LayoutMismatchError, ModelLayout, TensorSpec, bind_flat

_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bit pattern of a float tensor, so -0.0 and NaN payloads compare exactly."""
    return t.contiguous().view(_BITS[t.element_size()])


def tiny() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 2), nn.ReLU(), nn.Linear(2, 1))


class MLP(nn.Module):
    def __init__(self, d_in: int = 20, hidden: int = 16, d_out: int = 10) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


class CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4 * 6 * 6, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.bn(self.conv(x))).flatten(1))


def randomize(model: nn.Module) -> nn.Module:
    """Fresh random values everywhere, BatchNorm affine parameters included."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p))
    return model


# --------------------------------------------------------------------------------------- hash


def test_hash_matches_hand_computed_json_and_ignores_dtype() -> None:
    literal = '[["0.weight",[2,3]],["0.bias",[2]],["2.weight",[1,2]],["2.bias",[1]]]'
    expected = hashlib.sha256(literal.encode("utf-8")).hexdigest()
    model = tiny()
    layout = ModelLayout.from_module(model)
    assert layout.manifest_json() == literal
    assert layout.hash == expected
    assert ModelLayout.from_module(tiny().double()).hash == expected
    assert ModelLayout.from_module(tiny().to(torch.bfloat16)).hash == expected
    assert ModelLayout.from_named_shapes(json.loads(literal)).hash == expected
    scalar = ModelLayout.from_named_shapes([("s", ())])
    assert scalar.hash == hashlib.sha256(b'[["s",[]]]').hexdigest()


def test_layout_hash_is_the_canonical_utf8_json_documented_in_wire_md() -> None:
    """docs/wire.md's non-ASCII example: its bytes are its JSON in UTF-8 (no \\u escapes),
    hashlib over those bytes gives its hash, and the code computes exactly those bytes."""
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "wire.md").read_text("utf-8")
    block = next(b for b in doc.split("```text\n")[1:] if "\nbytes:" in b).split("```")[0]
    fields: dict[str, list[str]] = {}
    key = ""
    for line in block.splitlines():
        head, _, rest = line.partition(":")
        if line[:1] != " " and rest:
            key, line = head, rest
        fields.setdefault(key, []).append(line.strip())
    text = fields["JSON"][0]
    data = bytes.fromhex(" ".join(fields["bytes"]))
    digest = fields["hash"][0]
    assert data == text.encode("utf-8") and b"\\u" not in data and max(data) > 0x7F
    assert hashlib.sha256(data).hexdigest() == digest
    described = re.findall(r"(\S+) \[([0-9,]*)\]", fields["layout"][0])
    layout = ModelLayout.from_named_shapes(
        [(name, [int(d) for d in dims.split(",") if d]) for name, dims in described]
    )
    assert len(layout.names) == 3 and f"(D = {layout.numel})" in fields["layout"][0]
    assert layout.manifest_json().encode("utf-8") == data
    assert layout.hash == digest
    # Only layouts with non-ASCII names hash differently from the old \\uXXXX form.
    escaped = json.dumps(layout.manifest(), separators=(",", ":")).encode("ascii")
    assert hashlib.sha256(escaped).hexdigest() != digest
    ascii_layout = ModelLayout.from_named_shapes({"fc.weight": [2, 3], "fc.bias": [2]})
    old = json.dumps(ascii_layout.manifest(), separators=(",", ":")).encode("ascii")
    assert ascii_layout.hash == hashlib.sha256(old).hexdigest()


def test_layout_hash_escapes_only_quote_backslash_and_control_characters() -> None:
    name = 'q"b\\c\x01\n\x7f\u00e9\U0001f642'
    layout = ModelLayout.from_named_shapes([(name, [0, 12])])
    want = '[["q\\"b\\\\c\\u0001\\n\x7f\u00e9\U0001f642",[0,12]]]'.encode()
    assert layout.manifest_json().encode("utf-8") == want
    assert layout.hash == hashlib.sha256(want).hexdigest()
    with pytest.raises(ValueError, match="not valid Unicode"):
        ModelLayout.from_named_shapes([("bad\ud800", [1])])


def test_hash_changes_with_order_shape_and_name() -> None:
    base = [("a.weight", (4, 3)), ("a.bias", (4,)), ("b.weight", (2, 4))]
    h = ModelLayout.from_named_shapes(base).hash
    reordered = [base[1], base[0], base[2]]
    reshaped = [("a.weight", (3, 4)), *base[1:]]
    renamed = [("a.weight", (4, 3)), ("a.bias", (4,)), ("c.weight", (2, 4))]
    hashes = {ModelLayout.from_named_shapes(x).hash for x in (reordered, reshaped, renamed)}
    assert len(hashes) == 3 and h not in hashes


# ---------------------------------------------------------------------------- tables and flags


def test_offsets_are_cumulative_numels_and_modules_group_weight_and_bias() -> None:
    model = CNN()
    layout = ModelLayout.from_module(model)
    params = list(model.named_parameters())
    numels = [p.numel() for _, p in params]
    assert layout.names == tuple(n for n, _ in params)
    assert layout.shapes == tuple(tuple(p.shape) for _, p in params)
    assert layout.offsets.dtype == torch.int64 and layout.offsets.device.type == "cpu"
    assert layout.offsets.tolist() == [0, *torch.tensor(numels).cumsum(0).tolist()]
    assert layout.numel == sum(numels) == 36 + 4 + 4 + 4 + 1440 + 10
    assert len(layout) == 6
    assert layout.module_names == ("conv", "bn", "fc")
    assert layout.module_offsets.tolist() == [0, 40, 48, 1498]
    assert layout.spec("fc.weight") == TensorSpec("fc.weight", (10, 144), 48, 1440, "fc", False)


def test_is_norm_exactly_on_normalisation_parameters() -> None:
    model = nn.Sequential(
        nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.Flatten(), nn.LayerNorm(8), nn.Linear(8, 3)
    )
    layout = ModelLayout.from_module(model)
    expected = [n.startswith(("1.", "3.")) for n in layout.names]
    assert layout.is_norm.dtype == torch.bool
    assert layout.is_norm.tolist() == expected
    # From a state dict only BatchNorm is recognisable (by its running statistics) ...
    sd_layout = ModelLayout.from_state_dict(model.state_dict(), layout.names)
    assert sd_layout.is_norm.tolist() == [n.startswith("1.") for n in layout.names]
    # ... unless the norm layers are named explicitly (module or tensor names).
    explicit = ModelLayout.from_state_dict(
        model.state_dict(), layout.names, norm_names=["1", "3.weight", "3.bias"]
    )
    assert explicit.is_norm.tolist() == expected
    with pytest.raises(ValueError, match="norm_names"):
        ModelLayout.from_state_dict(model.state_dict(), layout.names, norm_names=["bn9"])


def test_buffer_section_holds_running_stats_not_num_batches_tracked() -> None:
    model = CNN()
    layout = ModelLayout.from_module(model)
    assert layout.buffer_names == ("bn.running_mean", "bn.running_var")
    assert layout.buffer_shapes == ((4,), (4,))
    assert layout.buffer_offsets.tolist() == [0, 4, 8]
    assert layout.buffer_numel == 8
    assert layout.int_buffer_names == ("bn.num_batches_tracked",)
    assert "bn.num_batches_tracked" not in layout.names


def test_frozen_parameters_go_to_the_buffer_section() -> None:
    model = MLP()
    model.fc1.weight.requires_grad_(False)
    layout = ModelLayout.from_module(model)
    assert layout.names == ("fc1.bias", "fc2.weight", "fc2.bias")
    assert layout.buffer_names == ("fc1.weight",)
    flat_b = layout.flatten_buffers(model)
    assert torch.equal(flat_b, model.fc1.weight.detach().reshape(-1))


def test_tied_weights_are_laid_out_once() -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(5, 3)
            self.out = nn.Linear(3, 5, bias=False)
            self.out.weight = self.emb.weight

    model = Tied()
    layout = ModelLayout.from_module(model)
    assert layout.names == ("emb.weight",)
    assert layout.buffer_names == ()
    assert ModelLayout.from_state_dict(model.state_dict(), layout.names) == layout


def test_from_state_dict_equals_from_module() -> None:
    model = randomize(CNN())
    model(torch.randn(3, 1, 8, 8))  # non-trivial running statistics
    a = ModelLayout.from_module(model)
    b = ModelLayout.from_state_dict(model.state_dict(), [n for n, _ in model.named_parameters()])
    assert a == b and hash(a) == hash(b) and a.hash == b.hash
    assert torch.equal(a.offsets, b.offsets) and torch.equal(a.module_offsets, b.module_offsets)
    assert torch.equal(a.is_norm, b.is_norm)
    assert a.int_buffer_names == b.int_buffer_names
    assert torch.equal(a.flatten(model), b.flatten(model.state_dict()))
    with pytest.raises(LayoutMismatchError, match="missing tensor 'nope'"):
        ModelLayout.from_state_dict(model.state_dict(), ["conv.weight", "nope"])
    with pytest.raises(LayoutMismatchError, match="bn.num_batches_tracked"):
        ModelLayout.from_state_dict(model.state_dict(), ["bn.num_batches_tracked"])


def test_json_round_trip() -> None:
    model = CNN()
    layout = ModelLayout.from_module(model)
    back = ModelLayout.from_json(layout.to_json())
    assert back == layout and back.hash == layout.hash
    assert torch.equal(back.is_norm, layout.is_norm)
    assert back.int_buffer_names == layout.int_buffer_names
    server = ModelLayout.from_json(layout.manifest_json())
    assert server.hash == layout.hash and server.buffer_numel == 0
    assert server != layout  # the buffers differ
    assert "hash=" in repr(layout)


# ---------------------------------------------------------------------- flatten and unflatten


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_flatten_unflatten_round_trip_is_bit_exact(dtype: torch.dtype) -> None:
    model = randomize(CNN()).to(dtype)
    with torch.no_grad():  # values a lossy path would mangle
        model.fc.bias[:4] = torch.tensor([-0.0, float("inf"), float("-inf"), 1e-40])
    layout = ModelLayout.from_module(model)
    flat = layout.flatten(model)
    assert flat.shape == (layout.numel,) and flat.dtype == dtype
    views = layout.unflatten(flat)
    assert views is not None and list(views) == list(layout.names)
    for name, p in model.named_parameters():
        assert torch.equal(views[name], p.detach())
        assert torch.equal(bits(views[name]), bits(p.detach()))
    # Into a second model and back out again.
    other = randomize(CNN()).to(dtype)
    layout.unflatten(flat, other)
    flat2 = layout.flatten(other)
    assert torch.equal(bits(flat2), bits(flat))
    # Upcasting is exact as well.
    wide = layout.flatten(model, dtype=torch.float64)
    assert torch.equal(wide, flat.double())


def test_unflatten_without_target_returns_views() -> None:
    layout = ModelLayout.from_module(MLP())
    flat = torch.randn(layout.numel)
    views = layout.unflatten(flat)
    assert views is not None
    w = views["fc1.weight"]
    assert w.shape == (16, 20) and w.data_ptr() == flat.data_ptr()
    assert views["fc2.bias"].data_ptr() == flat.data_ptr() + 4 * layout.spec("fc2.bias").offset
    flat[0] = 123.0
    assert w[0, 0].item() == 123.0


def test_unflatten_into_module_writes_in_place() -> None:
    model = randomize(MLP())
    layout = ModelLayout.from_module(model)
    ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}
    params = {n: p for n, p in model.named_parameters()}
    flat = torch.randn(layout.numel)
    layout.unflatten(flat, model)
    for spec in layout.specs:
        p = dict(model.named_parameters())[spec.name]
        assert p is params[spec.name] and p.data_ptr() == ptrs[spec.name]
        assert torch.equal(p.detach(), flat[spec.offset : spec.end].view(spec.shape))
    assert all(p.requires_grad for p in model.parameters())


def test_buffers_round_trip() -> None:
    model = randomize(CNN())
    model(torch.randn(5, 1, 8, 8))
    layout = ModelLayout.from_module(model)
    flat_b = layout.flatten_buffers(model)
    expected = torch.cat([model.bn.running_mean, model.bn.running_var])
    assert torch.equal(flat_b, expected)
    other = CNN()
    ptr = other.bn.running_var.data_ptr()
    layout.unflatten_buffers(flat_b, other)
    assert torch.equal(other.bn.running_mean, model.bn.running_mean)
    assert torch.equal(other.bn.running_var, model.bn.running_var)
    assert other.bn.running_var.data_ptr() == ptr
    views = layout.unflatten_buffers(flat_b)
    assert views is not None and torch.equal(views["bn.running_var"], model.bn.running_var)


def test_strided_out_and_non_contiguous_targets() -> None:
    model = randomize(MLP())
    layout = ModelLayout.from_module(model)
    storage = torch.full((2 * layout.numel,), float("nan"))
    out = storage[::2]
    result = layout.flatten(model, out=out)
    assert result is out
    assert torch.equal(out, layout.flatten(model))
    assert torch.isnan(storage[1::2]).all()  # the gaps are untouched
    # A mapping whose tensors are non-contiguous views is written through correctly.
    backing = {s.name: torch.zeros(tuple(reversed(s.shape))).t() for s in layout.specs}
    flat = torch.randn(layout.numel)
    layout.unflatten(flat, backing)
    assert not backing["fc1.weight"].is_contiguous()
    assert torch.equal(layout.flatten(backing), flat)
    # And a strided flat vector unflattens into a module.
    layout.unflatten(out, model)
    assert torch.equal(layout.flatten(model), out)


# ----------------------------------------------------------------------------------- bind_flat


def test_bind_flat_makes_parameters_views() -> None:
    model = randomize(CNN())
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    layout = ModelLayout.from_module(model)
    flat_p, flat_g = layout.bind_flat(model)
    assert flat_p.shape == flat_g.shape == (layout.numel,)
    assert torch.equal(flat_g, torch.zeros_like(flat_g))
    lo, hi = flat_p.data_ptr(), flat_p.data_ptr() + 4 * layout.numel
    glo = flat_g.data_ptr()
    for spec in layout.specs:
        p = model.get_parameter(spec.name)
        assert torch.equal(p.detach(), before[spec.name])
        assert lo <= p.data_ptr() < hi and p.data_ptr() == lo + 4 * spec.offset
        assert p.grad is not None and p.grad.data_ptr() == glo + 4 * spec.offset
    flat_p[layout.spec("fc.bias").offset] = 7.5
    assert model.fc.bias[0].item() == 7.5
    with torch.no_grad():
        model.conv.weight.mul_(2.0)
    seg = layout.spec("conv.weight")
    assert torch.equal(flat_p[seg.offset : seg.end], 2.0 * before["conv.weight"].reshape(-1))


def test_bind_flat_gradients_and_sgd_match_an_unbound_copy() -> None:
    torch.manual_seed(1234)
    model = randomize(CNN())
    ref = copy.deepcopy(model)
    flat_p, flat_g = bind_flat(model)
    layout = ModelLayout.from_module(model)
    x, y = torch.randn(6, 1, 8, 8), torch.randint(0, 10, (6,))
    loss_fn = nn.CrossEntropyLoss()

    loss_fn(model(x), y).backward()
    loss_fn(ref(x), y).backward()
    ref_grads = layout.flatten({n: p.grad for n, p in ref.named_parameters()})
    assert torch.count_nonzero(ref_grads) > 0
    assert torch.equal(flat_g, ref_grads)
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad._base is flat_g, name

    # A second backward accumulates into the same flat buffer.
    x2 = torch.randn(6, 1, 8, 8)
    loss_fn(model(x2), y).backward()
    loss_fn(ref(x2), y).backward()
    ref_grads = layout.flatten({n: p.grad for n, p in ref.named_parameters()})
    assert torch.equal(flat_g, ref_grads)
    assert all(p.grad._base is flat_g for p in model.parameters())

    # One fused update over D equals torch.optim.SGD on the copy, given the same gradients.
    lr = 0.05
    for name, p in ref.named_parameters():
        p.grad.copy_(flat_g[layout.spec(name).offset : layout.spec(name).end].view(p.shape))
    torch.optim.SGD(ref.parameters(), lr=lr).step()
    flat_p.add_(flat_g, alpha=-lr)
    assert torch.equal(flat_p, layout.flatten(ref))
    expected = layout.flatten(ref) - lr * flat_g
    flat_p -= lr * flat_g
    torch.testing.assert_close(flat_p, expected, rtol=0, atol=1e-6)


def test_bind_flat_survives_optimizer_with_zero_grad_set_to_none_false() -> None:
    model = randomize(MLP())
    flat_p, flat_g = bind_flat(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = torch.randn(4, 20), torch.randn(4, 10)
    for _ in range(2):
        opt.zero_grad(set_to_none=False)
        assert torch.equal(flat_g, torch.zeros_like(flat_g))
        nn.functional.mse_loss(model(x), y).backward()
        assert torch.count_nonzero(flat_g) > 0
        snapshot = flat_p.clone()
        opt.step()
        assert not torch.equal(flat_p, snapshot)  # the optimizer wrote through the views
        assert all(p.grad._base is flat_g for p in model.parameters())
    opt.zero_grad()  # set_to_none=True: documented to break the gradient binding
    assert all(p.grad is None for p in model.parameters())


def test_bind_flat_converts_dtype() -> None:
    model = randomize(MLP()).to(torch.bfloat16)
    values = ModelLayout.from_module(model).flatten(model)
    flat_p, flat_g = bind_flat(model, dtype=torch.float32)
    assert flat_p.dtype == flat_g.dtype == torch.float32
    assert model.fc1.weight.dtype == torch.float32 and model.fc1.weight.grad.dtype == torch.float32
    assert torch.equal(flat_p, values.float())


# -------------------------------------------------------------------------------------- errors


def test_mismatched_models_raise_with_the_tensor_name() -> None:
    layout = ModelLayout.from_module(MLP())
    with pytest.raises(
        LayoutMismatchError, match=r"fc1\.weight: expected \(16, 20\), got \(16, 21\)"
    ):
        layout.flatten(MLP(d_in=21))
    with pytest.raises(LayoutMismatchError, match=r"fc1\.weight: expected \(16, 20\)"):
        layout.unflatten(torch.zeros(layout.numel), MLP(d_in=21))
    with pytest.raises(LayoutMismatchError, match=r"fc1\.weight: expected"):
        layout.bind_flat(MLP(d_in=21))

    missing = MLP()
    missing.fc2.bias = None
    with pytest.raises(LayoutMismatchError, match="missing tensor 'fc2.bias'"):
        layout.flatten(missing)

    extra = MLP()
    extra.fc3 = nn.Linear(10, 2)
    with pytest.raises(LayoutMismatchError, match="unexpected tensor 'fc3.weight'"):
        layout.unflatten(torch.zeros(layout.numel), extra)

    sd = MLP().state_dict()
    del sd["fc2.weight"]
    with pytest.raises(LayoutMismatchError, match="missing tensor 'fc2.weight'"):
        layout.flatten(sd)
    sd = MLP().state_dict()
    sd["fc1.bias"] = torch.zeros(16, dtype=torch.int64)
    with pytest.raises(LayoutMismatchError, match="fc1.bias: expected a floating tensor"):
        layout.flatten(sd)


def test_bad_flat_vectors_raise() -> None:
    model = MLP()
    layout = ModelLayout.from_module(model)
    before = layout.flatten(model)
    with pytest.raises(LayoutMismatchError, match=rf"\({layout.numel + 1},\).*\({layout.numel},\)"):
        layout.unflatten(torch.zeros(layout.numel + 1), model)
    with pytest.raises(LayoutMismatchError, match="floating point"):
        layout.unflatten(torch.zeros(layout.numel, dtype=torch.int32), model)
    with pytest.raises(LayoutMismatchError, match="shape"):
        layout.unflatten(torch.zeros(1, layout.numel))
    with pytest.raises(LayoutMismatchError, match="out has shape"):
        layout.flatten(model, out=torch.empty(3))
    with pytest.raises(TypeError):
        layout.flatten([torch.zeros(3)])  # type: ignore[arg-type]
    assert torch.equal(layout.flatten(model), before)  # nothing was written
