"""Test setup shared by every test module.

Triton reads TRITON_INTERPRET when the module defining the kernels is imported, so it must be set
here, before any test imports `aggsrv.kernels.triton`. On a CUDA machine the real kernels run.

OpenMP threads (torch's, and numba's parallel kernels') spin for a while after each parallel
region by default, waiting for the next one. Many tests run several busy processes at once (shard
ranks, `aggsrv serve`, simulated clients), which inherit this environment: on a 2-core machine the
spinning threads take the cores from the process that has work, and every gloo collective or RPC
waits for it (the strategies on 3 gloo shards used twice the CPU time). Passive waiting changes
no result, only who gets the CPU; OpenMP reads it when its library loads, so before torch.
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402 - after the OpenMP setting, which torch reads when it loads
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def servers():
    """A factory of in-process RunningServers (tests/support/server_helpers.py), all
    stopped at the end of the test."""
    from server_helpers import RunningServer  # grpc only for the tests that use a server

    started = []

    def make(**config):
        srv = RunningServer(**config)
        started.append(srv)
        return srv

    yield make
    for srv in started:
        srv.stop()


@pytest.fixture
def flower_identity(monkeypatch):
    """A run identity for building Flower Messages outside a real ServerApp/ClientApp process
    (which sets it); tests set ``TaskIdentity.node_id`` to the node that replies."""
    from flwr.supercore.task_identity import TaskIdentity

    monkeypatch.setattr(TaskIdentity, "_run_id", 1)
    monkeypatch.setattr(TaskIdentity, "_task_id", 1)
    monkeypatch.setattr(TaskIdentity, "_node_id", 0)
    return TaskIdentity
