"""aggsrv's aggregators on Flower's own strategies (aggsrv.integrations.flower.robust): the
replies a Flower FedAvg/FedAdam would average, combined by a robust rule instead."""

from __future__ import annotations

import numpy as np
import pytest
import torch

flwr = pytest.importorskip("flwr")

from flwr.app import (  # noqa: E402
    Array,
    ArrayRecord,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.serverapp.strategy import FedAdam, FedAvg, FedMedian, Krum  # noqa: E402

from aggsrv.integrations.flower.robust import robust  # noqa: E402

pytestmark = pytest.mark.usefixtures("flower_identity")

SHAPES = {"conv.weight": (4, 3, 3), "conv.bias": (4,), "fc.weight": (5, 7)}
D = 36 + 4 + 35


def _reply(values: np.ndarray, n: int, node: int, extra: dict | None = None) -> Message:
    arrays, start = {}, 0
    for name, shape in SHAPES.items():
        size = int(np.prod(shape))
        arrays[name] = Array(values[start : start + size].reshape(shape).astype(np.float32))
        start += size
    arrays.update(extra or {})
    msg = Message(
        content=RecordDict(), dst_node_id=node, message_type=MessageType.TRAIN, group_id="1"
    )
    content = RecordDict(
        {"arrays": ArrayRecord(array_dict=arrays), "metrics": MetricRecord({"num-examples": n})}
    )
    return Message(content, reply_to=msg)


def _replies(X: np.ndarray, counts: list[int], extra: dict | None = None) -> list[Message]:
    return [_reply(X[k], counts[k], 100 + k, extra) for k in range(X.shape[0])]


def _flat(record: ArrayRecord) -> np.ndarray:
    return np.concatenate([record[name].numpy().reshape(-1) for name in SHAPES]).astype(np.float64)


def _planted(rng: np.random.Generator, honest: int, bad: int) -> np.ndarray:
    centre = rng.normal(size=D)
    X = centre + 0.1 * rng.normal(size=(honest + bad, D))
    X[honest:] = 1e3 * rng.normal(size=(bad, D))
    return X.astype(np.float32)


def test_median_of_the_replies_ignores_planted_rows() -> None:
    rng = np.random.default_rng(11)
    X = _planted(rng, 9, 4)
    strategy = robust(FedAvg, "median")
    arrays, metrics = strategy.aggregate_train(1, _replies(X, [10] * 13))
    np.testing.assert_allclose(_flat(arrays), np.median(X.astype(np.float64), axis=0), rtol=1e-6)
    assert list(arrays) == list(SHAPES)
    assert arrays["conv.weight"].shape == SHAPES["conv.weight"]
    assert "num-examples" not in metrics  # Flower's metric aggregation drops the weighting key
    # Flower's own FedMedian gives the same arrays on the same replies.
    theirs, _ = FedMedian().aggregate_train(1, _replies(X, [10] * 13))
    np.testing.assert_allclose(_flat(arrays), _flat(theirs), rtol=1e-6, atol=1e-7)


def test_mean_reproduces_flowers_weighted_mean() -> None:
    rng = np.random.default_rng(12)
    X = rng.normal(size=(5, D)).astype(np.float32)
    counts = [3, 50, 7, 1, 20]
    ours, _ = robust(FedAvg, "mean").aggregate_train(1, _replies(X, counts))
    theirs, _ = FedAvg().aggregate_train(1, _replies(X, counts))
    want = (np.array(counts, float)[:, None] * X).sum(0) / sum(counts)
    np.testing.assert_allclose(_flat(ours), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(_flat(ours), _flat(theirs), rtol=1e-5, atol=1e-6)


def test_krum_picks_an_honest_reply_where_flowers_krum_does() -> None:
    rng = np.random.default_rng(13)
    X = _planted(rng, 8, 2)
    ours_strategy = robust(FedAvg, "krum:f=2")
    ours, _ = ours_strategy.aggregate_train(1, _replies(X, [4] * 10))
    theirs, _ = Krum(num_malicious_nodes=2).aggregate_train(1, _replies(X, [4] * 10))
    (chosen,) = ours_strategy.last_info.selected
    assert chosen < 8
    np.testing.assert_array_equal(_flat(ours), X[chosen].astype(np.float64))
    np.testing.assert_array_equal(_flat(ours), _flat(theirs))


def test_fedadam_steps_on_the_robust_aggregate() -> None:
    rng = np.random.default_rng(14)
    X = _planted(rng, 7, 2)
    initial = rng.normal(size=D).astype(np.float32)
    kwargs = {"eta": 0.1, "tau": 1e-3}
    ours = robust(FedAdam, "median", **kwargs)
    reference = FedAdam(**kwargs)
    # FedAdam keeps the arrays it sent (configure_train does that); both start from the same.
    sent = _replies(initial[None], [1])[0].content["arrays"]
    for s in (ours, reference):
        s.current_arrays = {name: array.numpy() for name, array in sent.items()}
    got, _ = ours.aggregate_train(1, _replies(X, [2] * 9))
    # The same step on the median, fed to plain FedAdam as one reply.
    med = np.median(X.astype(np.float64), axis=0).astype(np.float32)
    want, _ = reference.aggregate_train(1, _replies(med[None], [1]))
    np.testing.assert_allclose(_flat(got), _flat(want), rtol=1e-5, atol=1e-6)
    assert not np.allclose(_flat(got), initial)  # it did step


def test_centered_clipping_starts_at_the_median_then_at_the_last_aggregate() -> None:
    rng = np.random.default_rng(15)
    X = _planted(rng, 9, 2)
    strategy = robust(FedAvg, "centered_clipping:tau=0.5")
    first, _ = strategy.aggregate_train(1, _replies(X, [1] * 11))
    v = np.median(X.astype(np.float64), axis=0)
    d = np.linalg.norm(X - v, axis=1)
    v = v + ((X - v) * np.minimum(1.0, 0.5 / d)[:, None]).mean(0)
    np.testing.assert_allclose(_flat(first), v, rtol=1e-5, atol=1e-5)
    second, _ = strategy.aggregate_train(2, _replies(X, [1] * 11))
    d = np.linalg.norm(X - v, axis=1)
    v = v + ((X - v) * np.minimum(1.0, 0.5 / d)[:, None]).mean(0)
    np.testing.assert_allclose(_flat(second), v, rtol=1e-5, atol=1e-5)


def test_arrays_outside_the_parameters_come_back() -> None:
    rng = np.random.default_rng(16)
    X = rng.normal(size=(3, D)).astype(np.float32)
    extra = {"bn.num_batches_tracked": Array(np.array(7, dtype=np.int64))}
    arrays, _ = robust(FedAvg, "median").aggregate_train(1, _replies(X, [1, 1, 1], extra))
    assert int(arrays["bn.num_batches_tracked"].numpy()) == 7


def test_strategies_that_combine_replies_themselves_are_refused() -> None:
    with pytest.raises(TypeError, match="Krum.aggregate_train combines the replies itself"):
        robust(Krum, "median")
    with pytest.raises(TypeError, match="built on FedAvg"):
        robust(dict, "median")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown rule"):
        robust(FedAvg, "medain")


def test_no_valid_reply_gives_nothing() -> None:
    assert robust(FedAvg, "median").aggregate_train(1, []) == (None, None)


def test_more_replies_than_last_round_grow_the_rows() -> None:
    rng = np.random.default_rng(17)
    strategy = robust(FedAvg, "median")
    for K in (3, 6, 2):
        X = rng.normal(size=(K, D)).astype(np.float32)
        arrays, _ = strategy.aggregate_train(1, _replies(X, [1] * K))
        np.testing.assert_allclose(
            _flat(arrays), np.median(X.astype(np.float64), axis=0), rtol=1e-6
        )
    assert torch.is_tensor(strategy._rows)
