"""Fixtures the strategy tests share."""

from __future__ import annotations

import secrets

import pytest
import torch


@pytest.fixture
def gen() -> torch.Generator:
    """A freshly seeded generator; the seed is printed so a failure can be replayed."""
    seed = secrets.randbits(31)
    print(f"seed={seed}")
    return torch.Generator().manual_seed(seed)
