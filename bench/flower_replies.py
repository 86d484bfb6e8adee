"""Flower train replies for the benchmarks against Flower's strategies (test_bench_flower.py,
test_bench_flower_robust.py): K ``Message``s of a ResNet-18-shaped model rescaled to D, made
one client at a time (no [K, D] source), each array encoded by Flower's own ``Array``
(``np.save`` bytes) as a ClientApp sends them.

Row k is a shared uniform centre plus the client's own uniform noise scaled by ``scales[k]``,
shifted by ``shift`` for the clients in ``outliers``; the "num-examples" metric is drawn in
[100, 1000).
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import pytest
import torch
from conftest import rescale_sizes, resnet18_sizes
from ingest_helpers import proc_status_kb, reset_peak_rss

pytest.importorskip("flwr")

from flwr.app import (  # noqa: E402
    Array,
    ArrayRecord,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.supercore.task_identity import TaskIdentity  # noqa: E402

WEIGHT_KEY = "num-examples"


@pytest.fixture(autouse=True)
def flower_quiet_and_identified(monkeypatch):
    """Messages need a run identity (a real ServerApp sets it); Flower's INFO logs per
    aggregate_train call would flood the output. Autouse where a module imports it."""
    monkeypatch.setattr(TaskIdentity, "_run_id", 1)
    monkeypatch.setattr(TaskIdentity, "_task_id", 1)
    monkeypatch.setattr(TaskIdentity, "_node_id", 0)
    logger = logging.getLogger("flwr")
    level = logger.level
    logger.setLevel(logging.WARNING)
    yield
    logger.setLevel(level)


def make_replies(
    D: int,
    scales: np.ndarray,
    outliers: Iterable[int],
    seed: int,
    shift: float,
    rng: np.random.Generator,
) -> list[Message]:
    """len(scales) train replies (module docstring); ``rng`` draws the sample counts."""
    gen = torch.Generator().manual_seed(seed)
    sizes = rescale_sizes(resnet18_sizes(), D)
    names = [f"layer{i:02d}" for i in range(len(sizes))]
    bad = set(outliers)
    centre = torch.empty(D).uniform_(-1.0, 1.0, generator=gen)
    row = torch.empty(D)
    replies = []
    for k, scale in enumerate(scales):
        row.uniform_(-1.0, 1.0, generator=gen).mul_(float(scale)).add_(centre)
        if k in bad:
            row.add_(shift)
        values = row.numpy()
        arrays, start = {}, 0
        for name, n in zip(names, sizes.tolist(), strict=True):
            arrays[name] = Array(values[start : start + n])
            start += n
        node = 1000 + k
        msg = Message(
            content=RecordDict(), dst_node_id=node, message_type=MessageType.TRAIN, group_id="1"
        )
        TaskIdentity.node_id = node
        content = RecordDict(
            {
                "arrays": ArrayRecord(array_dict=arrays, keep_input=True),
                "metrics": MetricRecord({WEIGHT_KEY: int(rng.integers(100, 1000))}),
            }
        )
        replies.append(Message(content, reply_to=msg))
    TaskIdentity.node_id = 0
    return replies


def peak_over_current_mb(fn: Callable[[], Any]) -> tuple[Any, float]:
    """fn()'s result and the peak RSS during it above the RSS before it (MB; nan if /proc
    refuses the reset)."""
    pid = os.getpid()
    before = proc_status_kb(pid)["VmRSS"]
    ok = reset_peak_rss(pid)
    out = fn()
    peak = proc_status_kb(pid)["VmHWM"]
    return out, ((peak - before) / 1e3 if ok else math.nan)
