"""A shard's state directory resumes only the shard that wrote it (docs/sharding.md "Crashes and
recovery"): another shard count or rank is refused with what would resume it, and a sharded
federation whose shards do not all hold a checkpoint refuses to start, naming the shard."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from aggsrv.client import Client
from aggsrv.layout import ModelLayout
from aggsrv.server import durability as D
from aggsrv.server.persistence import RecoveryError, check_shard

SETTINGS = """
shard_slice_wait_seconds = 2.0
shard_heartbeat_seconds = 0.2
shard_timeout_seconds = 20.0
rate_limit_per_second = 0.0
"""


def _shard(rank: int, shards: int) -> dict:
    return {"rank": rank, "shards": shards, "bounds": [0, 5, 11][: shards + 1], "seq": 3}


def test_check_shard_takes_only_the_shard_that_wrote_the_state() -> None:
    check_shard(_shard(1, 2), 1, 2)
    check_shard(None, 0, 1)  # a single server's state, resumed by a single server
    with pytest.raises(RecoveryError) as refused:
        check_shard(_shard(1, 2), 0, 2)
    text = str(refused.value)
    assert "shard 1 of a federation of 2 shards" in text, text
    assert "started as shard 0 of 2" in text and "--shards 2 --rank 1" in text, text
    with pytest.raises(RecoveryError) as refused:
        check_shard(_shard(0, 2), 0, 3)
    assert "started as shard 0 of 3" in str(refused.value) and "--shards 2 --rank 0" in str(
        refused.value
    )
    with pytest.raises(RecoveryError) as refused:  # a sharded state, resumed by one server
        check_shard(_shard(0, 2), 0, 1)
    assert "shard 0 of a federation of 2 shards" in str(refused.value)
    with pytest.raises(RecoveryError) as refused:  # one server's state, resumed by shards
        check_shard(None, 0, 2)
    assert "written by a single server" in str(refused.value)
    assert "--shards 2" in str(refused.value)


def _serve(tmp: Path, n: int, resume: bool, url_port: int, ports: list[int], tag: str) -> list:
    from server_helpers import ServeProcess

    settings = tmp / "shards.toml"
    settings.write_text(SETTINGS)
    procs = []
    for r in range(n):
        state = ["--resume" if resume else "--state-dir", str(tmp / f"shard{r}")]
        args = ["--shards", str(n), "--rank", str(r), "--dist-url",
                f"tcp://127.0.0.1:{url_port}", *state, "--strategy", "fedasync",
                "--config", str(settings)]  # fmt: skip
        procs.append(ServeProcess(tmp / f"shard{r}-{tag}.log", ports[r], *args))
    return procs


@pytest.fixture(scope="module")
def refused(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Two `aggsrv serve --shards 2` processes write a checkpoint each and stop. Then shard
    0's directory is resumed by one server (no --shards); and, with shard 1's directory
    emptied, the federation is resumed: what each start said and how it ended."""
    from server_helpers import ServeProcess, free_port

    tmp = tmp_path_factory.mktemp("refused")
    layout = ModelLayout.from_named_shapes([("w", (7, 11)), ("b", (7,))])
    ports = [free_port(), free_port()]
    procs = _serve(tmp, 2, False, free_port(), ports, "first")
    try:
        for p in procs:
            p.wait_serving(90)
        with Client(procs[0].address, "c0", timeout=20) as c:
            c.register(layout=layout, initial=torch.randn(layout.numel))
            job = c.get_job()
            c.push(job, torch.randn(layout.numel), num_samples=3)
        assert procs[0].terminate() == 0  # rank 0 stops the federation: both checkpoint
        assert procs[1].proc.wait(30) == 0
    finally:
        for p in procs:
            p.close()
    for r in range(2):
        assert D.list_checkpoints(tmp / f"shard{r}"), r
    out: dict = {}
    single = ServeProcess(tmp / "single.log", free_port(), "--resume", str(tmp / "shard0"),
                          "--strategy", "fedasync")  # fmt: skip
    try:
        out["single"] = (single.proc.wait(60), single.log())
    finally:
        single.close()
    shutil.rmtree(tmp / "shard1")
    (tmp / "shard1").mkdir()
    procs = _serve(tmp, 2, True, free_port(), ports, "resumed")
    try:
        out["shards"] = [(p.proc.wait(90), p.log()) for p in procs]
    finally:
        for p in procs:
            p.close()
    out["shard1 files"] = sorted(p.name for p in (tmp / "shard1").iterdir())
    return out


def test_a_sharded_state_dir_is_refused_by_one_server(refused: dict) -> None:
    code, text = refused["single"]
    assert code != 0, text
    assert "holds shard 0 of a federation of 2 shards" in text, text
    assert "--shards 2 --rank 0" in text, text


def test_a_shard_without_its_state_refuses_to_start(refused: dict) -> None:
    """Shard 1's directory lost (an empty one in its place) while shard 0 resumes: neither
    serves, shard 1 says its directory holds nothing, and nothing is written to it."""
    (code0, log0), (code1, log1) = refused["shards"]
    assert code0 != 0 and code1 != 0, (log0, log1)
    assert "shard 1's state directory holds nothing" in log1, log1
    assert refused["shard1 files"] == []


def test_rank0_names_the_shard_without_its_state(refused: dict) -> None:
    """The operator reading rank 0's log learns which shard's directory is missing."""
    _, log0 = refused["shards"][0]
    assert "shard 1" in log0 and "state directory" in log0, log0
