"""Test setup shared by every test module.

Triton reads TRITON_INTERPRET when the module defining the kernels is imported, so it must be set
here, before any test imports `aggsrv.kernels.triton`. On a CUDA machine the real kernels run.
"""

import os

import pytest
import torch

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
