"""BatchNorm running statistics through the Flower adapter, against the real `flwr` package.

Flower's idiom is ``ArrayRecord(model.state_dict())``: parameters, float buffers (running_mean,
running_var) and integer buffers (num_batches_tracked) in one record. The adapter must split it
as ``aggsrv serve`` splits a registering model, aggregate the statistics with the strategy's own
buffer rule (mean, latest, own: aggsrv/strategies/float_buffers.py) and so give the same global
weights and statistics as a real server fed the same updates; a job must load into the model
with a strict ``load_state_dict``; a reply that lacks its statistics or does not fit the model is
refused without changing anything.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
from torch import nn

flwr = pytest.importorskip("flwr")

from flower_helpers import NodeGrid, ServerReplay  # noqa: E402
from flwr.app import (  # noqa: E402
    Array,
    ArrayRecord,
    ConfigRecord,
    Message,
    MetricRecord,
    RecordDict,
)
from flwr.supercore.task_identity import TaskIdentity  # noqa: E402

from aggsrv.integrations.flower.arrays import (  # noqa: E402
    flat_to_record,
    layout_of,
    record_to_buffers,
    record_to_flat,
)
from aggsrv.integrations.flower.client import job_from_message, reply, train_job  # noqa: E402
from aggsrv.integrations.flower.strategy import LAYOUT, AggsrvStrategy  # noqa: E402
from aggsrv.layout import ModelLayout  # noqa: E402

pytestmark = pytest.mark.usefixtures("flower_identity")

NODES = [3, 8, 21, 34]


def _bn_model(seed: int) -> nn.Module:
    """Conv -> BatchNorm -> Linear (odd sizes: D = 3*3*3*5 + 5 + 5 + 5 + 7*20 + 7 = 297, B = 10)."""
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Conv2d(3, 5, 3),
        nn.BatchNorm2d(5),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(2),
        nn.Flatten(),
        nn.Linear(20, 7),
    )
    with torch.no_grad():  # statistics that are not the defaults (0 and 1)
        model[1].running_mean.uniform_(-1, 1)
        model[1].running_var.uniform_(0.5, 2)
        model[1].num_batches_tracked.fill_(17)
    return model


def test_state_dict_records_split_as_the_server_splits_a_model() -> None:
    model = _bn_model(random.randrange(1 << 30))
    record = ArrayRecord(model.state_dict())
    layout = layout_of(record)
    assert layout == ModelLayout.from_module(model)  # tensors, buffers, norm flags, outside
    assert layout.buffer_names == ("1.running_mean", "1.running_var")
    assert layout.int_buffer_names == ("1.num_batches_tracked",)
    assert layout.is_norm.tolist() == [False, False, True, True, False, False]
    flat, buffers = record_to_flat(record, layout), record_to_buffers(record, layout)
    assert torch.equal(flat, layout.flatten(model))
    assert torch.equal(buffers, layout.flatten_buffers(model))
    outside = {"1.num_batches_tracked": record["1.num_batches_tracked"]}
    back = flat_to_record(flat, layout, buffers, outside)
    fresh = _bn_model(0)
    fresh.load_state_dict(back.to_torch_state_dict())  # strict: every entry is there
    for (name, want), got in zip(
        model.state_dict().items(), fresh.state_dict().values(), strict=True
    ):
        assert torch.equal(want, got), name
    # A parameters-only record still lays out (no buffers), and an explicit trainable list wins.
    params_only = ArrayRecord({n: p.detach() for n, p in model.named_parameters()})
    assert layout_of(params_only).buffer_numel == 0
    frozen = layout_of(record, trainable=["0.weight", "0.bias", "5.weight", "5.bias"])
    assert frozen.buffer_names == ("1.weight", "1.bias", "1.running_mean", "1.running_var")
    with pytest.raises(ValueError, match="no array '1.running_mean'"):
        record_to_buffers(params_only, layout)


def _positive_buffers(layout: ModelLayout, gen: torch.Generator) -> torch.Tensor:
    """Random statistics: means anywhere, variances positive (a negative one is refused)."""
    b = torch.empty(layout.buffer_numel)
    for spec in layout.buffer_specs:
        part = b[spec.offset : spec.end]
        if spec.name.endswith("running_var"):
            part.uniform_(0.2, 3.0, generator=gen)
        else:
            part.uniform_(-2.0, 2.0, generator=gen)
    return b


def _reply(msg: Message, node: int, arrays: ArrayRecord, n: int) -> Message:
    TaskIdentity.node_id = node
    content = RecordDict({"arrays": arrays, "metrics": MetricRecord({"num-examples": n})})
    return Message(content, reply_to=msg)


CASES = {
    "fedavg": {"mode": "sync", "min_clients": 4, "round_timeout": None},  # rule "mean"
    "fedasync": {"alpha": 0.6},  # rule "own": the same moving average as the weights
    "fedogd": {"epoch_timeout": None, "min_updates": 4, "min_available": 4},  # rule "latest"
    "orthofl": {},  # rule "own", and each job hands the client its own statistics back (G6)
}


@pytest.mark.parametrize("name", list(CASES))
def test_statistics_aggregate_as_the_server_aggregates_them(name: str) -> None:
    seed = random.randrange(1 << 30)
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    model = _bn_model(seed)
    initial = ArrayRecord(model.state_dict())
    layout = layout_of(initial)
    adapter = AggsrvStrategy(name, CASES[name], seed=seed)
    grid = NodeGrid(NODES)
    arrays = initial
    rounds: list[list[tuple[int, torch.Tensor, torch.Tensor, int]]] = []
    sent_buffers: list[dict[int, torch.Tensor]] = []  # what each round's jobs carried
    for server_round in range(1, 4):
        messages = list(adapter.configure_train(server_round, arrays, ConfigRecord(), grid))
        assert len(messages) == len(NODES), f"round {server_round} ({seed=})"
        replies, sent, jobs = [], [], {}
        for msg in messages:
            node = msg.metadata.dst_node_id
            job_arrays = msg.content["arrays"]
            assert "1.num_batches_tracked" in job_arrays  # loads with a strict load_state_dict
            assert ModelLayout.from_json(msg.content["config"][LAYOUT]) == layout
            jobs[node] = record_to_buffers(job_arrays, layout)
            final = record_to_flat(job_arrays, layout) + torch.randn(layout.numel, generator=gen)
            buffers = _positive_buffers(layout, gen)
            n = rng.randrange(5, 50)
            replies.append(_reply(msg, node, flat_to_record(final, layout, buffers), n))
            sent.append((node, final, buffers, n))
        order = list(range(len(replies)))
        rng.shuffle(order)
        arrays, _ = adapter.aggregate_train(server_round, [replies[i] for i in order])
        rounds.append([sent[i] for i in order])
        sent_buffers.append(jobs)
    strategy = adapter.strategy
    assert strategy.version >= 1, f"{name}: no version made ({seed=})"
    final_buffers = record_to_buffers(arrays, layout)
    assert torch.equal(final_buffers, strategy.global_buffers())
    assert not torch.equal(final_buffers, record_to_buffers(initial, layout))
    if name == "fedavg":
        # Independent oracle: each sync round's statistics are the sample-weighted mean of the
        # round's replies (float64), whatever order they came in.
        last = rounds[-1]
        total = sum(n for *_, n in last)
        want = sum(b.double() * n for _, _, b, n in last) / total
        torch.testing.assert_close(final_buffers.double(), want, rtol=0, atol=1e-6)

    with ServerReplay(
        name, CASES[name], layout, record_to_flat(initial, layout), NODES,
        initial_buffers=record_to_buffers(initial, layout),
    ) as server:  # fmt: skip
        for updates, jobs_sent in zip(rounds, sent_buffers, strict=True):
            jobs = {node: server.job(node) for node, *_ in sorted(updates)}
            for node, job in jobs.items():
                assert torch.equal(job.buffers, jobs_sent[node]), f"{name} node {node} ({seed=})"
            for node, final, buffers, n in updates:
                server.push(node, final, n, buffers)
        server_model = server.model()
        server_buffers = server.srv.strategy.global_buffers().clone()
    assert torch.equal(record_to_flat(arrays, layout), server_model), f"{name} ({seed=})"
    assert torch.equal(final_buffers, server_buffers), f"{name} ({seed=})"


def _batches(seed: int, count: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(6, 3, 6, 6, generator=gen), torch.randint(0, 7, (6,), generator=gen))
            for _ in range(count)]  # fmt: skip


def test_clientapp_trains_from_the_jobs_statistics_and_replies_them() -> None:
    seed = random.randrange(1 << 30)
    model = _bn_model(seed)
    adapter = AggsrvStrategy("fedasync", {"alpha": 0.5, "local_epochs": 1})
    (msg,) = adapter.configure_train(1, ArrayRecord(model.state_dict()), ConfigRecord(),
                                     NodeGrid([5]))  # fmt: skip
    job = job_from_message(msg)
    assert torch.equal(job.buffers, adapter.strategy.global_buffers())

    # aggsrv's loop: starts from the job's statistics, BatchNorm updates them while training.
    client_model = _bn_model(seed + 1)  # other weights and statistics: the job's must win
    result = train_job(client_model, _batches(seed), job)
    assert result.buffers is not None and not torch.equal(result.buffers, job.buffers)
    # It started from the job's weights and statistics, not the model's own: another model with
    # other weights and statistics ends bit for bit where this one did.
    other_model = _bn_model(seed + 7)
    other = train_job(other_model, _batches(seed), job)
    assert torch.equal(other.buffers, result.buffers) and torch.equal(other.weights, result.weights)
    TaskIdentity.node_id = 5
    answer = reply(msg, client_model, num_examples=18)
    outcome = adapter.fold_reply(answer)
    assert outcome is not None and outcome.status.name == "APPLIED"
    # FedAsync's "own" rule: x <- (1 - a) x + a x_client for the statistics as for the weights.
    a = 0.5  # staleness 0: alpha * (0 + 1) ** -0.5
    want = (1 - a) * job.buffers.double() + a * result.buffers.double()
    torch.testing.assert_close(adapter.strategy.global_buffers().double(), want, rtol=0, atol=1e-6)

    # Flower's own idiom on the ClientApp side: strict load, train, reply the whole state dict.
    (msg2,) = adapter.configure_train(2, ArrayRecord(), ConfigRecord(), NodeGrid([5]))
    plain = _bn_model(seed + 2)
    plain.load_state_dict(msg2.content["arrays"].to_torch_state_dict())
    layout = ModelLayout.from_module(plain)
    assert torch.equal(layout.flatten_buffers(plain), adapter.strategy.global_buffers())
    opt = torch.optim.SGD(plain.parameters(), lr=0.05)
    for x, y in _batches(seed + 3, 2):
        opt.zero_grad()
        nn.functional.cross_entropy(plain(x), y).backward()
        opt.step()
    TaskIdentity.node_id = 5
    content = RecordDict({"arrays": ArrayRecord(plain.state_dict()),
                          "metrics": MetricRecord({"num-examples": 12})})  # fmt: skip
    outcome = adapter.fold_reply(Message(content, reply_to=msg2))
    assert outcome is not None and outcome.version == 2


def _refused(adapter: AggsrvStrategy, msg: Message, arrays: ArrayRecord, what: str) -> None:
    """The reply is refused and nothing changes; the node's next job still works."""
    strategy = adapter.strategy
    before = (strategy.version, strategy.global_model().clone(), strategy.global_buffers().clone())
    assert adapter.fold_reply(_reply(msg, 9, arrays, 10)) is None, what
    assert strategy.version == before[0], what
    assert torch.equal(strategy.global_model(), before[1]), what
    assert torch.equal(strategy.global_buffers(), before[2]), what


def test_bad_replies_are_refused_and_change_nothing() -> None:
    seed = random.randrange(1 << 30)
    gen = torch.Generator().manual_seed(seed)
    model = _bn_model(seed)
    adapter = AggsrvStrategy("fedasync", {"alpha": 0.5})
    grid = NodeGrid([9])
    arrays = ArrayRecord(model.state_dict())
    layout = layout_of(arrays)
    good = layout.flatten(model) + 0.1
    stats = _positive_buffers(layout, gen)
    nan_stats = stats.clone()
    nan_stats[0] = math.nan
    negative_var = stats.clone()
    negative_var[layout.buffer_specs[1].offset] = -0.5  # 1.running_var
    wrong_shape = dict(flat_to_record(good, layout, stats).items())
    wrong_shape["5.bias"] = Array(np.ones(6, dtype=np.float32))  # the layout says (7,)
    bad = {
        "no statistics": flat_to_record(good, layout),
        "NaN statistic": flat_to_record(good, layout, nan_stats),
        "negative variance": flat_to_record(good, layout, negative_var),
        "another model": ArrayRecord(nn.Linear(3, 2).state_dict()),
        "wrong shape": ArrayRecord(wrong_shape),
    }
    for server_round, (what, record) in enumerate(bad.items(), start=1):
        (msg,) = adapter.configure_train(server_round, arrays, ConfigRecord(), grid)
        _refused(adapter, msg, record, what)
    (msg,) = adapter.configure_train(len(bad) + 1, arrays, ConfigRecord(), grid)
    outcome = adapter.fold_reply(_reply(msg, 9, flat_to_record(good, layout, stats), 10))
    assert outcome is not None and outcome.version == 1
