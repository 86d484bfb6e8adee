"""Helpers of the server tests that push over real gRPC: fresh random inputs, hand-checked results,
registered clients (tests/ is not a package: `from push_helpers import fresh_gen`)."""

from __future__ import annotations

import os
from collections.abc import Callable

import grpc
import torch

from aggsrv import protocol as P
from aggsrv.client.client import Client
from aggsrv.layout import ModelLayout
from aggsrv.v1 import aggregation_pb2 as pb

ATOL = 1e-6


def rand(n: int, gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(n, generator=gen) * scale


def fresh_gen() -> torch.Generator:
    """Fresh random inputs every run (the seed is printed so a failure can be replayed)."""
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"random seed {seed}")
    return torch.Generator().manual_seed(seed)


def call_or_error(fn: Callable):
    try:
        return fn()
    except grpc.RpcError as exc:
        return exc


def register_with_hash(client_id: str, layout: ModelLayout, layout_hash: str | None = None):
    header = pb.RegisterHeader(
        client_id=client_id,
        layout=P.layout_to_pb(layout),
        layout_hash=layout.hash if layout_hash is None else layout_hash,
    )
    return [pb.RegisterRequest(header=header)]


def assert_close_to_hand(got: torch.Tensor, want64: torch.Tensor, atol: float = ATOL) -> None:
    """float32 result against the float64 hand value: `atol` per unit of the largest value."""
    tol = atol * max(1.0, want64.abs().max().item())
    err = (got.double() - want64).abs().max().item()
    assert err <= tol, f"max abs error {err:.3g} > {tol:.3g}"


def registered_clients(
    address: str, names: list[str], model: torch.nn.Module, chunk_bytes: int | None = None
) -> list[Client]:
    """Registered clients; the first one uploads the initial model (`chunk_bytes` overrides the
    chunk size the client learns from GetStatus)."""
    clients = [Client(address, name) for name in names]
    for c in clients:
        if chunk_bytes is not None:
            c.chunk_bytes = chunk_bytes
        c.register(model)
    return clients


# ----------------------------------------------------------------------------- hand results
