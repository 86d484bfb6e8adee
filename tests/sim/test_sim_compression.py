"""The in-process simulator's clients compress as the Python client does (the `[compression]`
table, docs/compression.md): the server receives about a quarter of the bytes with INT8 values,
and the default scenario still learns; a bad table is refused with what is wrong.
"""

from __future__ import annotations

import pytest
import torch

from aggsrv.sim import run
from aggsrv.sim.config import SimConfig


@pytest.fixture(autouse=True)
def _torch_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _config(**keys) -> SimConfig:
    base = {"strategy": "fedbuff", "transport": "inproc", "threads": 1}
    return SimConfig.from_mapping(SimConfig.load(None, {**base, **keys}).to_dict())


def test_int8_updates_carry_a_quarter_of_the_bytes_and_the_model_still_learns(
    tmp_path, monkeypatch
) -> None:
    """FedBuff takes each update's codes, as a server does (no float32 copy of them)."""
    from aggsrv.strategies.fedbuff import FedBuff

    folded: list[int] = []
    fold = FedBuff._apply_codes

    def counted(self, update, w):
        folded.append(update.quantized.bits)
        return fold(self, update, w)

    plain = run(_config(), progress=False, out_dir=tmp_path / "plain").summary
    monkeypatch.setattr(FedBuff, "_apply_codes", counted)
    packed = run(
        _config(compression={"quantization": "int8"}), progress=False, out_dir=tmp_path / "q"
    ).summary
    assert folded and set(folded) == {8}
    assert len(folded) >= packed["updates_applied"]
    per_update = [s["bytes_received"] / s["updates_applied"] for s in (plain, packed)]
    assert per_update[1] / per_update[0] <= 0.26
    assert packed["final_accuracy"] >= 0.8, packed
    assert abs(packed["final_accuracy"] - plain["final_accuracy"]) <= 0.05


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ({"quantization": "int3"}, "unknown quantization"),
        ({"top_k": 0}, "top_k"),
        ({"colour": "red"}, "compression: .*colour"),
        ({"state_path": "r.pt"}, "state_path"),
    ],
)
def test_a_bad_compression_table_is_refused(table, message) -> None:
    with pytest.raises(ValueError, match=message):
        _config(compression=table)
