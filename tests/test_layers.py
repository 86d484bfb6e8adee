"""The layers stay one-way: kernels <- layout <- values <- strategies <- server/sim <- cli.

Each check imports a module in a fresh interpreter and lists what else got loaded, so a stray
import anywhere in the chain (not just in the module itself) fails it.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# Module prefixes each entry point must not load.
HIGHER = {
    "aggsrv.client": ("aggsrv.strategies", "aggsrv.server", "aggsrv.sim", "aggsrv.cli", "flwr"),
    "aggsrv.values": ("aggsrv.strategies", "aggsrv.server", "aggsrv.sim", "grpc", "google"),
    "aggsrv.layout": ("aggsrv.strategies", "aggsrv.server", "aggsrv.values", "grpc"),
    "aggsrv.protocol": ("aggsrv.strategies", "aggsrv.server", "aggsrv.sim"),
    "aggsrv.strategies": ("aggsrv.server", "aggsrv.sim", "aggsrv.cli", "grpc", "flwr"),
    "aggsrv.server.app": ("aggsrv.sim", "aggsrv.cli", "flwr"),
}


def _loaded_after_import(module: str) -> list[str]:
    code = f"import json, sys, {module}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("module", sorted(HIGHER))
def test_a_layer_loads_nothing_above_it(module: str) -> None:
    loaded = _loaded_after_import(module)
    above = [m for m in loaded if any(m == p or m.startswith(p + ".") for p in HIGHER[module])]
    assert not above, f"importing {module} loads {above}"


def test_the_client_loads_no_strategy_module_at_all() -> None:
    # The one the issue names: a client program pays for the client, not for 17 strategies.
    loaded = _loaded_after_import("aggsrv.client")
    assert "aggsrv.values" in loaded
    assert not [m for m in loaded if m.startswith("aggsrv.strategies")]
