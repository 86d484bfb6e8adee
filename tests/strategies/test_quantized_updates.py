"""Updates that reach a strategy as the wire's quantized codes (``Update.quantized``): FedAsync
folds a DELTA's codes into the next version in one pass, against a float64 oracle of the decoded
values (its staging tensor is never read: it holds NaN here); every other strategy, and FedAsync
where something reads the delta first, decodes them and reaches the bits it reaches from the
decoded float32 tensor; bad codes, scales and shapes are refused with a clear error."""

from __future__ import annotations

import math

import pytest
import torch

from aggsrv.layout import ModelLayout
from aggsrv.strategies import make_strategy
from aggsrv.transport.quantized import Quantization, quantize, quantized_values
from aggsrv.values import QuantizedValues, Status, Update, UpdateKind

F64 = torch.float64
LAYOUT = ModelLayout.from_named_shapes([("fc.weight", (41, 23)), ("fc.bias", (30,))])
D = LAYOUT.numel  # 973: odd, and a ragged last block for every block size below


_uid = iter(range(10**9))


def codes_of(
    delta: torch.Tensor, q: Quantization, block: int
) -> tuple[QuantizedValues, torch.Tensor]:
    """The wire's codes of ``delta`` (over bytes of their own) and the float32 values they decode
    to, by the transport's encoder."""
    wire, decoded = quantize(delta, q, block)
    kept = quantized_values(bytearray(wire), q, delta.numel(), block, "update")
    assert kept is not None
    return kept, decoded


def update(job, delta: torch.Tensor, quantized: QuantizedValues | None = None, kind=None) -> Update:
    kind = kind or UpdateKind.DELTA
    work = job.recipe.work_target
    uid = f"u{next(_uid)}"
    return Update(job.client_id, job.job_id, job.base_version, uid, 5, work, kind, delta,
                  quantized=quantized)  # fmt: skip


def nan_staging() -> torch.Tensor:
    """A staging buffer nobody may read: any value taken from it poisons the model."""
    return torch.full((D,), math.nan)


@pytest.mark.parametrize("q", [Quantization.INT8, Quantization.INT4])
@pytest.mark.parametrize("block", [128, 7, 1000])
def test_fedasync_folds_the_codes_into_the_next_version(q, block, gen) -> None:
    x0 = torch.randn(D, generator=gen)
    s = make_strategy("fedasync", {"alpha": 0.6}, layout=LAYOUT, initial=x0)
    for c in "ab":
        s.on_register(c, 0.0)
    stale = s.job_for("b", 0.0)  # its base is x0: stale by one once a's update lands
    job = s.job_for("a", 0.0)
    assert s.folds_quantized_updates(UpdateKind.DELTA)
    assert not s.folds_quantized_updates(UpdateKind.WEIGHTS)

    kept, sent = codes_of(torch.randn(D, generator=gen) * 0.01, q, block)
    out = s.on_update(update(job, nan_staging(), kept), 1.0)
    assert (out.status, out.version) == (Status.APPLIED, 1)
    a = s.mixing_weight(0)
    # x + a * delta, each element in float64 and rounded once.
    want = (x0.to(F64) + a * sent.to(F64)).float()
    assert torch.equal(s.global_model(), want)

    # A stale job: lerp(x, base, a) first (float32, as FedAsync's float path), then the codes.
    x1 = s.global_model().clone()
    kept, sent = codes_of(torch.randn(D, generator=gen) * 0.01, q, block)
    late = update(stale, nan_staging(), kept)
    out = s.on_update(late, 2.0)
    assert (out.status, out.version, out.staleness) == (Status.APPLIED, 2, 1)
    a = s.mixing_weight(1)
    want = (torch.lerp(x1, x0, a).to(F64) + a * sent.to(F64)).float()
    assert torch.equal(s.global_model(), want)
    # The same update again is a DUPLICATE and changes nothing.
    again = s.on_update(late, 3.0)
    assert (again.status, again.original, s.version) == (Status.DUPLICATE, Status.APPLIED, 2)
    assert torch.equal(s.global_model(), want)


@pytest.mark.parametrize(
    ("q", "block"),
    [(Quantization.INT8, 128), (Quantization.INT4, 7), (Quantization.INT8, 5),
     (Quantization.INT4, 64)],
)  # fmt: skip
def test_fedbuff_adds_the_codes_into_its_running_sum(q, block, gen, monkeypatch) -> None:
    """x + lr / M * sum_i w_i delta_i per buffer of M, the sum in float64 in arrival order, bit
    for bit; chunks of the flush and of its check are cut on whole blocks (and bytes), here
    several chunks of a small D."""
    from aggsrv.strategies import fedbuff

    whole = QuantizedValues.chunk_elements  # chunks of about 64 values: many in D
    monkeypatch.setattr(QuantizedValues, "chunk_elements", lambda self, about: whole(self, 64))
    x0 = torch.randn(D, generator=gen)
    m, lr = 3, 0.8
    s = make_strategy("fedbuff", {"buffer_size": m, "server_lr": lr, "staleness_weighting": True},
                      layout=LAYOUT, initial=x0)  # fmt: skip
    assert s.folds_quantized_updates(UpdateKind.DELTA)
    assert isinstance(s, fedbuff.FedBuff)
    for c in "abcd":
        s.on_register(c, 0.0)
    model = x0.clone()
    total = torch.zeros(D, dtype=F64)
    buffered = 0
    for t, c in enumerate("abcdabcab"):
        job = s.outstanding_job(c) or s.job_for(c, float(t))
        staleness = s.version - job.base_version
        kept, sent = codes_of(torch.randn(D, generator=gen) * 0.01, q, block)
        out = s.on_update(update(job, nan_staging(), kept), t + 0.5)
        total = total + (1 / math.sqrt(1 + staleness)) * sent.to(F64)
        assert kept._squared  # the fold noted its norm: no second read of the codes
        assert kept.norm == pytest.approx(float(sent.double().norm()), rel=1e-6)
        buffered += 1
        if buffered == m:
            assert out.status is Status.APPLIED
            model = torch.add(model, total, alpha=lr / m).float()
            assert torch.equal(s.global_model(), model)
            total.zero_()
            buffered = 0
        else:
            assert out.status is Status.BUFFERED
    assert s.version == 3


def test_a_span_of_codes_starts_on_a_whole_block_and_byte() -> None:
    v = _values(codes=torch.zeros(5, dtype=torch.uint8), bits=4)  # 10 values, blocks of 5
    assert v.chunk_elements(7) == 10 and v.chunk_elements(25) == 20
    codes, scales = v.span(0, 10)
    assert (codes.numel(), scales.numel()) == (5, 2)
    with pytest.raises(ValueError, match="do not start on a chunk of 10"):
        v.span(5, 10)


def _run(name: str, config: dict, x0: torch.Tensor, deltas, quantized: bool):
    s = make_strategy(name, config, layout=LAYOUT, initial=x0.clone())
    for c in "abc":
        s.on_register(c, 0.0)
    outcomes = []
    for t, (c, (kept, sent)) in enumerate(deltas):
        job = s.outstanding_job(c) or s.job_for(c, float(t))
        if quantized:
            outcomes.append(s.on_update(update(job, nan_staging(), kept), t + 0.5))
        else:
            outcomes.append(s.on_update(update(job, sent.clone()), t + 0.5))
    return s, outcomes


@pytest.mark.parametrize(
    ("name", "config"),
    [
        ("fedbuff", {"buffer_size": 2, "aggregator": "median"}),  # a rule keeps rows
        ("fedbuff", {"buffer_size": 2, "max_update_norm": 1e6}),
        ("ca2fl", {"buffer_size": 2}),
        ("mifa", {"learning_rate": 0.1, "epoch_timeout": None, "detect": False}),
        ("fedasync", {"max_update_norm": 1e6}),  # a norm bound reads the delta first
        ("fedasync", {"update_filter": "norm"}),
        (
            "fedasync",
            {
                "dp_clip_norm": 0.2,
                "dp_noise_multiplier": 0.5,
                "dp_seed": 11,
                "dp_insecure_seed": True,
            },
        ),  # fmt: skip
    ],
    ids=[
        "fedbuff-median",
        "fedbuff-norm-bound",
        "ca2fl",
        "mifa",
        "fedasync-norm-bound",
        "fedasync-filter",
        "fedasync-dp",
    ],  # fmt: skip
)
def test_a_strategy_that_does_not_fold_codes_decodes_them_first(name, config, gen) -> None:
    x0 = torch.randn(D, generator=gen)
    deltas = [
        (c, codes_of(torch.randn(D, generator=gen) * 0.01, Quantization.INT8, 128))
        for c in "abcabcab"
    ]
    probe = make_strategy(name, config, layout=LAYOUT, initial=x0.clone())
    assert not probe.folds_quantized_updates(UpdateKind.DELTA)
    from_codes, got = _run(name, config, x0, deltas, quantized=True)
    from_floats, want = _run(name, config, x0, deltas, quantized=False)
    assert [(o.status, o.version) for o in got] == [(o.status, o.version) for o in want]
    assert from_codes.version > 0
    assert torch.equal(from_codes.global_model(), from_floats.global_model())


def test_a_weights_update_as_codes_is_decoded_and_applied(gen) -> None:
    x0 = torch.randn(D, generator=gen)
    s = make_strategy("fedasync", {"alpha": 0.5}, layout=LAYOUT, initial=x0)
    s.on_register("a", 0.0)
    job = s.job_for("a", 0.0)
    kept, sent = codes_of(x0 + torch.randn(D, generator=gen) * 0.01, Quantization.INT8, 128)
    out = s.on_update(update(job, nan_staging(), kept, UpdateKind.WEIGHTS), 1.0)
    assert out.status is Status.APPLIED
    assert torch.equal(s.global_model(), torch.lerp(x0, sent, 0.5))


def _values(**change) -> QuantizedValues:
    args = {"codes": torch.zeros(10, dtype=torch.int8), "scales": torch.ones(2), "block": 5,
            "bits": 8, "numel": 10} | change  # fmt: skip
    return QuantizedValues(**args)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"scales": torch.tensor([1.0, math.nan])}, "scales must be finite"),
        ({"scales": torch.tensor([1.0, -0.5])}, "not negative"),
        ({"scales": torch.tensor([1.0, 3e38 / 100])}, "at most"),
        ({"scales": torch.ones(3)}, r"scales of 10 8-bit values in blocks of 5 must be"),
        ({"codes": torch.zeros(9, dtype=torch.int8)}, r"codes of 10 .* \[10\]"),
        ({"codes": torch.zeros(10, dtype=torch.uint8)}, "torch.int8"),
        ({"bits": 4}, r"torch.uint8 \[5\]"),
        ({"bits": 2}, "bits must be 8 or 4"),
        ({"block": 0}, "block must be an integer >= 1"),
        (
            {"bits": 4, "numel": 9, "codes": torch.tensor([0, 0, 0, 0, 0x10], dtype=torch.uint8)},
            "padding nibble after the last of 9",
        ),
        ({"codes": torch.zeros(20, dtype=torch.int8)[::2]}, "contiguous"),
    ],
)
def test_quantized_values_refuse_what_would_not_decode_finite(change, message) -> None:
    with pytest.raises(ValueError, match=message):
        _values(**change)


def test_an_update_refuses_codes_of_another_size() -> None:
    with pytest.raises(ValueError, match="quantized values of 10 elements need a CPU tensor"):
        Update("a", 1, 0, "u", 1, 1.0, UpdateKind.DELTA, torch.zeros(11), quantized=_values())
    with pytest.raises(TypeError, match="QuantizedValues or None"):
        Update("a", 1, 0, "u", 1, 1.0, UpdateKind.DELTA, torch.zeros(10), quantized=b"codes")


def test_largest_code_at_the_largest_scale_decodes_finite() -> None:
    """The bound on scales holds for every code, even -128, which the wire refuses."""
    limit = torch.tensor([torch.finfo(torch.float32).max / 128], dtype=torch.float32)
    for code in (-128, 127):
        v = _values(codes=torch.full((1,), code, dtype=torch.int8), scales=limit, numel=1)
        out = v.decode(torch.empty(1))
        assert math.isfinite(float(out[0]))
