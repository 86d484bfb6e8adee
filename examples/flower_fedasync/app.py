"""A small Flower federation whose ServerApp runs aggsrv's FedAsync (or any aggsrv strategy)
asynchronously, and whose ClientApps train by the job's recipe with aggsrv's local loop.

Data: scikit-learn's digits (offline), split over the nodes by a Dirichlet(0.5) partition per
class. Model: a 64-32-10 MLP. This directory is a Flower App (pyproject.toml): run it with
`flwr run examples/flower_fedasync` or with `python examples/flower_fedasync/run.py` (README.md).
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

from aggsrv.data import load_dataset
from aggsrv.data.partitions import partition
from aggsrv.integrations.flower import AggsrvStrategy, record_to_flat, run_async
from aggsrv.integrations.flower.client import job_from_message, reply, train_job
from aggsrv.layout import ModelLayout

SEED = 0
# run.py's knobs; `flwr run` takes `--run-config "strategy='fedhist' num-updates=20"` instead.
ENVIRONMENT = {"strategy": "AGGSRV_EXAMPLE_STRATEGY", "num-updates": "AGGSRV_EXAMPLE_UPDATES"}


def run_config(context: Context) -> dict[str, str | int]:
    """The run config: `flwr run` passes [tool.flwr.app.config] of pyproject.toml, with any
    `--run-config` overrides, as `context.run_config`; `run_simulation` (run.py) passes an empty
    one, so the same table is read from pyproject.toml, with the environment over it."""
    if context.run_config:
        return dict(context.run_config)
    with open(Path(__file__).resolve().parent / "pyproject.toml", "rb") as f:
        config = tomllib.load(f)["tool"]["flwr"]["app"]["config"]
    for key, variable in ENVIRONMENT.items():
        if variable in os.environ:
            config[key] = type(config[key])(os.environ[variable])
    return config


def make_model() -> torch.nn.Module:
    torch.manual_seed(SEED)
    return torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))


def _data(num_nodes: int):
    data = load_dataset("digits", seed=SEED)
    x = data.x_train.reshape(len(data.x_train), -1)
    parts = partition(data.y_train.numpy(), num_nodes, "dirichlet_per_class:beta=0.5", SEED)
    return data, x, parts


def _accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


# ------------------------------------------------------------------------------- ServerApp

server_app = ServerApp()


@server_app.main()
def server_main(grid: Grid, context: Context) -> None:
    config = run_config(context)
    strategy_name, updates = str(config["strategy"]), int(config["num-updates"])
    model = make_model()
    layout = ModelLayout.from_module(model)
    data = load_dataset("digits", seed=SEED)
    x_test = data.x_test.reshape(len(data.x_test), -1)
    initial = ArrayRecord(torch_state_dict={n: p.detach() for n, p in model.named_parameters()})
    options = {"learning_rate": 0.1} if strategy_name != "fedavg" else {}
    strategy = AggsrvStrategy(strategy_name, options)

    def central_eval(version: int, arrays: ArrayRecord) -> MetricRecord:
        _load(model, record_to_flat(arrays, layout))
        return MetricRecord({"accuracy": _accuracy(model, x_test, data.y_test)})

    result = run_async(
        grid, strategy, initial, max_updates=updates, job_timeout=120.0,
        evaluate_fn=central_eval, evaluate_every=max(1, updates // 4),
    )  # fmt: skip
    accuracy = {v: m["accuracy"] for v, m in sorted(result.evaluations.items())}
    print(
        f"aggsrv {strategy_name} in Flower: {result.updates_applied} updates, version "
        f"{result.version}, accuracy by version {accuracy}",
        flush=True,
    )
    context.state["result"] = MetricRecord(
        {"version": result.version, "accuracy": accuracy[max(accuracy)]}
    )


def _load(model: torch.nn.Module, flat: torch.Tensor) -> None:
    with torch.no_grad():
        start = 0
        for p in model.parameters():
            p.copy_(flat[start : start + p.numel()].view_as(p))
            start += p.numel()


# ------------------------------------------------------------------------------- ClientApp

client_app = ClientApp()


@client_app.train()
def client_train(msg: Message, context: Context) -> Message:
    # Flower's simulation gives each node its partition-id and the number of partitions.
    node = int(context.node_config.get("partition-id", 0))
    data, x, parts = _data(int(context.node_config.get("num-partitions", 1)))
    idx = torch.as_tensor(parts[node])
    xs, ys = x[idx], data.y_train[idx]
    batch = 32
    loader = [(xs[i : i + batch], ys[i : i + batch]) for i in range(0, len(xs), batch)]
    job = job_from_message(msg)
    model = make_model()
    result = train_job(model, loader, job)
    return reply(msg, model, num_examples=len(xs), metrics={"train_loss": result.mean_loss})
