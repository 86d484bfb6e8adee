"""What an upgraded server does with a state directory an earlier version wrote
(docs/compatibility.md): the fixtures under tests/fixtures/ were written by the formats named in
their folder (tests/support/state_fixture.py) and are kept. Each resumes to the version and the
model bits the live server held, replaying its log (float32 updates and INT8 ones folded from
their codes). A checkpoint or a log written in a format this version does not read is refused
with a message that says what to do, never read as damage and dropped.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from server_helpers import RunningServer

from aggsrv.server import durability as D

FIXTURES = sorted((Path(__file__).resolve().parents[1] / "fixtures").glob("state-*"))


def _copy(fixture: Path, tmp_path: Path) -> tuple[Path, dict]:
    state = tmp_path / "state"
    shutil.copytree(fixture / "state", state)
    return state, json.loads((fixture / "expected.json").read_text())


def _resume(state: Path, expected: dict) -> RunningServer:
    config = {k: v for k, v in expected["config"].items() if k != "durability"}
    return RunningServer(state_dir=str(state), durability="on", resume=True, **config)


def test_there_is_a_fixture_of_todays_formats() -> None:
    from aggsrv.server.persistence import FORMAT

    assert any(
        json.loads((f / "expected.json").read_text())["checkpoint_format"] == FORMAT
        and json.loads((f / "expected.json").read_text())["wal_magic"] == D.WAL_MAGIC.decode()
        for f in FIXTURES
    ), "write one: python tests/support/state_fixture.py tests/fixtures/state-<formats>"


@pytest.mark.parametrize("fixture", FIXTURES, ids=[f.name for f in FIXTURES])
def test_a_state_directory_of_an_earlier_version_resumes_bit_for_bit(fixture, tmp_path) -> None:
    state, expected = _copy(fixture, tmp_path)
    assert any(r.kind == "update" for _, r in D.iter_records(state, 0))  # the log has work
    srv = _resume(state, expected)
    try:
        live = srv.state()
    finally:
        srv.stop()
    assert int(live["version"]) == expected["version"]
    want = torch.frombuffer(bytearray.fromhex(expected["model"]), dtype=torch.float32)
    assert torch.equal(live["model"], want)


def test_a_checkpoint_of_a_newer_format_is_refused_with_what_to_do(tmp_path) -> None:
    state, expected = _copy(FIXTURES[-1], tmp_path)
    path = D.list_checkpoints(state)[-1][1]
    payload = torch.load(path, weights_only=False)
    payload["format"] = "aggsrv-checkpoint/99"
    torch.save(payload, path)
    with pytest.raises(Exception, match=r"aggsrv-checkpoint/99.*(newer|upgrade)"):
        _resume(state, expected)


def test_a_log_of_a_newer_format_is_refused_not_dropped_as_torn(tmp_path) -> None:
    """A log whose records carry another version's magic was written by another aggsrv: reading
    it as a torn tail would drop every acknowledged update in it."""
    state, expected = _copy(FIXTURES[-1], tmp_path)
    segment = D.list_segments(state)[0][1]
    data = bytearray(segment.read_bytes())
    assert data[:4] == D.WAL_MAGIC
    data[:4] = b"AWL9"
    segment.write_bytes(bytes(data))
    with pytest.raises(Exception, match=r"AWL9.*(newer|upgrade)"):
        _resume(state, expected)
    assert segment.read_bytes() == bytes(data)  # not truncated as a torn tail
