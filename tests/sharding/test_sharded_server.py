"""A sharded server end to end (issue 9, docs/sharding.md "The server processes"): shard
processes joined by gloo, real gRPC clients that split updates by the shard map, and the
global model compared with one server fed the same calls.

The oracle: rank 0 records every call it orders (registrations, jobs, updates, timers, each
with its ``now``); one whole-model strategy then makes the same calls with the whole updates,
exactly as a single server replays its write-ahead log. Its model must equal the model the
client assembles from the shards (bit for bit for the elementwise strategies, within 1e-5 for
the reducing ones), and every update must get the outcome the shards answered."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import random
import threading
import traceback
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from bitwise_diff import describe_difference
from strategy_cases import strategy_cases

from aggsrv.client.client import Client
from aggsrv.layout import ModelLayout
from aggsrv.strategies import STRATEGIES, Status, StrategyError, Update, UpdateKind, make_strategy
from aggsrv.v1 import aggregation_pb2 as pb
from aggsrv.v1 import tensor_pb2 as tpb

CLIENTS = 3
ROUNDS = 4
CASES = strategy_cases(CLIENTS)
# Strategies whose server work is elementwise: a shard's slice needs nothing from the others.
ELEMENTWISE = {"fedavg", "fedasync", "fedbuff", "fedprox", "fedogd", "mifa", "feden", "ca2fl",
               "twafl"}  # fmt: skip


def _layout() -> ModelLayout:
    # 2 * 64-element cuts fall inside tensors for 2 and 3 shards (D = 251).
    return ModelLayout.from_named_shapes(
        [("a.weight", (11, 13)), ("a.bias", (11,)), ("b.weight", (7, 11)), ("b.bias", (7,)),
         ("c.weight", (2, 7)), ("c.bias", (2,))]
    )  # fmt: skip


def _shard_config(name: str, world: int, rank: int):
    from aggsrv.server.config import ServerConfig

    return ServerConfig(
        host="127.0.0.1", port=0, auth="none", state_dir="", durability="off", device="cpu",
        strategy=name, strategy_config=CASES[name], shards=world, rank=rank,
        rate_limit_per_second=0.0, shard_heartbeat_seconds=0.2, shard_slice_wait_seconds=5.0,
        shard_timeout_seconds=30.0,
    )  # fmt: skip


def _shard_main(rank: int, world: int, init: str, names: list[str], queue: Any) -> None:
    """One shard process: the federations of ``names`` one after another in one gloo group;
    rank 0 reports its port, then the calls it ordered."""
    try:
        import torch.distributed as dist

        from aggsrv.server.app import Server
        from aggsrv.server.shards import ShardGroup

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
        for name in names:
            config = _shard_config(name, world, rank)
            shards = ShardGroup.of(config)
            calls: list[tuple[str, dict]] = []
            if rank == 0:
                announce = shards.announce

                def record(kind, meta, durable=0, announce=announce, calls=calls):
                    if kind not in ("noop", "stop", "durable", "checkpoint"):
                        calls.append((kind, dict(meta)))
                    announce(kind, meta, durable)

                shards.announce = record
            asyncio.run(_serve_one(Server(config, shards), rank, name, queue))
            if rank == 0:
                queue.put(("calls", name, calls, None))
        dist.destroy_process_group()
    except Exception:
        queue.put(("error", rank, None, traceback.format_exc()))


async def _serve_one(server, rank: int, name: str, queue: Any) -> None:
    port = await server.start()
    if rank == 0:
        queue.put(("port", name, port, None))
    await server.stop_requested.wait()
    await server.stop(1.0)


def _next(queue: Any, kind: str) -> tuple:
    msg = queue.get(timeout=120)
    if msg[0] == "error":
        raise AssertionError(f"shard {msg[1]} failed:\n{msg[3]}")
    assert msg[0] == kind, msg
    return msg


def _run_clients(address: str, layout: ModelLayout, initial: torch.Tensor, seed: int):
    """CLIENTS clients in threads, ROUNDS jobs each; (whole updates by id, outcomes by id,
    refusals by id, the final model)."""
    sent: dict[str, tuple[torch.Tensor, UpdateKind]] = {}
    answers: dict[str, list[Any]] = {}
    lock = threading.Lock()
    first = Client(address, "c0", timeout=30)
    first.register(layout=layout, initial=initial)
    errors: list[str] = []

    def run(i: int) -> None:
        try:
            client = first if i == 0 else Client(address, f"c{i}", timeout=30)
            if i:
                client.register(layout=layout)
            gen = torch.Generator().manual_seed(seed * 31 + i)
            for r in range(ROUNDS):
                try:
                    job = client.get_job(timeout=8)
                except grpc.RpcError as exc:  # no further job for this client (e.g. FedDGIC)
                    assert exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED, exc
                    return
                kind = UpdateKind.WEIGHTS if (i + r) % 2 else UpdateKind.DELTA
                noise = 0.05 * torch.randn(layout.numel, generator=gen)
                tensor = job.weights + noise if kind is UpdateKind.WEIGHTS else noise
                update_id = f"u{i}-{r}"
                with lock:
                    sent[update_id] = (tensor.clone(), kind)
                recipe = job.recipe
                # Client 1 sends its first update twice: every shard answers DUPLICATE.
                for _ in range(2 if (i, r) == (1, 0) else 1):
                    try:
                        answer = client.push(
                            job, tensor, kind=kind, num_samples=10 + 7 * i, update_id=update_id,
                            steps=recipe.local_steps or 0, epochs=recipe.local_epochs or 0.0,
                        )  # fmt: skip
                    except grpc.RpcError as exc:
                        answer = exc.code()
                    with lock:
                        answers.setdefault(update_id, []).append(answer)
        except Exception:
            errors.append(traceback.format_exc())

    threads = [threading.Thread(target=run, args=(i,)) for i in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors[0]
    version, model = first.get_model()
    first.close()
    return sent, answers, version, model


def _replay(name: str, layout: ModelLayout, initial: torch.Tensor, calls, sent) -> tuple:
    """One whole-model strategy making rank 0's calls; (model, outcome or refusal by id)."""
    strategy = make_strategy(
        name, layout=layout, initial=initial.clone(), config=CASES[name], device="cpu"
    )
    outcomes: dict[str, list[Any]] = {}
    for kind, meta in calls:
        now = meta.get("now")
        try:
            if kind == "register":
                strategy.on_register(meta["client"], now)
            elif kind == "job":
                strategy.job_for(meta["client"], now)
            elif kind == "timer":
                strategy.on_timer(now)
            elif kind == "update":
                tensor, how = sent[meta["update_id"]]
                assert how.name == meta["kind"]
                update = Update(
                    client_id=meta["client"], job_id=int(meta["job_id"]),
                    base_version=int(meta["base_version"]), update_id=meta["update_id"],
                    num_samples=int(meta["num_samples"]), work_done=float(meta["work_done"]),
                    kind=how, tensor=tensor.clone(),
                )  # fmt: skip
                outcome = strategy.on_update(update, now)
                outcomes.setdefault(meta["update_id"], []).append(outcome)
        except StrategyError as exc:
            if kind == "update":
                outcomes.setdefault(meta["update_id"], []).append(exc)
    return strategy.version, strategy.global_model(), outcomes


@pytest.mark.parametrize("world", [2, 3])
def test_every_strategy_on_shard_processes_equals_one_server(world: int, tmp_path: Path) -> None:
    seed = random.randrange(1 << 30)
    names = sorted(CASES)
    layout = _layout()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    init = f"file://{tmp_path / 'rendezvous'}"
    procs = [
        ctx.Process(target=_shard_main, args=(r, world, init, names, queue), daemon=True)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    try:
        for name in names:
            _, _, port, _ = _next(queue, "port")
            address = f"127.0.0.1:{port}"
            initial = torch.randn(layout.numel, generator=torch.Generator().manual_seed(seed))
            sent, answers, version, model = _run_clients(address, layout, initial, seed)
            with Client(address, "operator") as op:
                status = op.status()
                assert [s.rank for s in status.shard_map.shards] == list(range(world))
                assert status.shard_map.shards[-1].end == layout.numel
                # A reader that never registered gets the whole model too (aggsrv pull).
                assert torch.equal(op.get_model(version)[1], model), name
                op.admin_call("Shutdown", pb.ShutdownRequest(grace_seconds=1))
            _, _, calls, _ = _next(queue, "calls")
            want_version, want, outcomes = _replay(name, layout, initial, calls, sent)
            context = f"{name} on {world} shards, seed {seed}"
            assert version == want_version, context
            assert set(answers) == set(outcomes), context
            for uid, got in answers.items():
                assert len(got) == len(outcomes[uid]), (context, uid, got, outcomes[uid])
                for answer, expect in zip(got, outcomes[uid], strict=True):
                    if isinstance(expect, StrategyError):
                        assert isinstance(answer, grpc.StatusCode), (context, uid, answer, expect)
                    else:
                        assert (answer.status, answer.version, answer.original) == (
                            expect.status, expect.version, expect.original,
                        ), (context, uid, answer, expect)  # fmt: skip
            assert answers["u1-0"][1].status is Status.DUPLICATE, context
            if name in ELEMENTWISE:
                bounds = [0, *(s.end for s in status.shard_map.shards)]
                diff = describe_difference(model, want, bounds)
                assert not diff, f"{context}: {diff}"
            else:
                err = float((model.double() - want.double()).norm() / want.double().norm())
                assert err <= 1e-5, (context, err)
            accepted = [
                a for got in answers.values() for a in got if not isinstance(a, grpc.StatusCode)
            ]
            assert len(accepted) >= CLIENTS * 2, (context, answers)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


def test_every_strategy_has_a_sharded_case() -> None:
    assert set(STRATEGIES) == set(CASES)


# ------------------------------------------------------------------ `aggsrv serve` shards


def _status_version(address: str) -> int:
    with Client(address, "operator", retries=0) as op:
        return int(op.status().version)


def test_serve_shards_vote_all_or_none_and_a_lost_shard_stops_writes(tmp_path: Path) -> None:
    """Two `aggsrv serve --shards 2` processes: refused slices leave both shards untouched,
    and after one shard is killed the other refuses writes (UNAVAILABLE) but keeps its model."""
    from server_helpers import ServeProcess, free_port

    settings = tmp_path / "shard.toml"
    settings.write_text("shard_slice_wait_seconds = 1.0\nshard_heartbeat_seconds = 0.2\n"
                        "rate_limit_per_second = 0.0\n")  # fmt: skip
    url = f"tcp://127.0.0.1:{free_port()}"
    shards = [
        ServeProcess(
            tmp_path / f"shard{r}.log",
            free_port(),
            "--shards",
            "2",
            "--rank",
            str(r),
            "--dist-url",
            url,
            "--state-dir",
            "",
            "--strategy",
            "fedasync",
            "--config",
            str(settings),
        )  # fmt: skip
        for r in range(2)
    ]
    try:
        for s in shards:
            s.wait_serving(60)
        layout = _layout()
        gen = torch.Generator().manual_seed(random.randrange(1 << 30))
        initial = torch.randn(layout.numel, generator=gen)
        client = Client(shards[0].address, "c0", timeout=20, retries=0)
        resp = client.register(layout=layout, initial=initial)
        assert [s.address for s in resp.shard_map.shards] == [s.address for s in shards]
        with pytest.raises(grpc.RpcError) as refused:  # only rank 0 registers
            Client(shards[1].address, "c1", retries=0).register(layout=layout)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert shards[0].address in refused.value.details()
        for _ in range(2):
            job = client.get_job()
            delta = torch.randn(layout.numel, generator=gen)
            assert client.push(job, delta, num_samples=5).status is Status.APPLIED
        version, model = client.get_model()
        assert version == 2 and not torch.equal(model, initial)

        job = client.get_job()
        parts = client.shard_map.split(torch.randn(layout.numel, generator=gen))
        header = pb.UpdateHeader(
            client_id="c0", job_id=job.job_id, base_version=job.base_version, update_id="half",
            num_samples=5, kind=pb.UPDATE_KIND_DELTA, dtype=tpb.WIRE_DTYPE_FLOAT32,
            layout_hash=layout.hash,
        )  # fmt: skip
        stubs = client._shard_stubs

        def send(rank: int, head: pb.UpdateHeader, to: int | None = None):
            """Slice ``rank`` (its header says so) streamed to shard ``to`` (default: its own)."""
            stream = client._update_stream(head, parts[rank], {}, "dense", rank)
            return stubs[rank if to is None else to].PushUpdate.future(stream(), timeout=20)

        # Shard 1 never gets its slice: rank 0 orders the update, the vote refuses it.
        with pytest.raises(grpc.RpcError) as refused:
            send(0, header).result()
        assert refused.value.code() == grpc.StatusCode.ABORTED
        assert "shard 1 did not receive its slice" in refused.value.details()
        # The slices disagree on the header: shard 1 refuses, so no shard applies it.
        other = pb.UpdateHeader()
        other.CopyFrom(header)
        other.num_samples = 6
        calls = [send(0, header), send(1, other)]
        for call in calls:
            with pytest.raises(grpc.RpcError) as refused:
                call.result()
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        # A slice sent to the wrong shard is refused before anything is ordered.
        with pytest.raises(grpc.RpcError) as refused:
            send(1, header, to=0).result()
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert [_status_version(s.address) for s in shards] == [2, 2]
        assert torch.equal(client.get_model()[1], model)
        # The same update sent whole is then applied on both shards.
        assert client.push(job, torch.cat(parts), update_id="half").status is Status.APPLIED
        version, model = client.get_model()
        assert [_status_version(s.address) for s in shards] == [3, 3] and version == 3

        shards[1].proc.kill()
        shards[1].proc.wait(10)
        job_error = None
        with pytest.raises(grpc.RpcError) as refused:
            try:
                job = client.get_job()
            except grpc.RpcError as exc:  # rank 0 noticed the loss first
                job_error = exc
                raise
            client.push(job, torch.randn(layout.numel, generator=gen), num_samples=5)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value
        assert "lost" in refused.value.details() or job_error is not None
        # Rank 0 stays up: it refuses writes, answers reads, and its slice did not move.
        with Client(shards[0].address, "operator", retries=0) as op:
            assert op.status().version == 3
            with pytest.raises(grpc.RpcError) as refused:
                op.register(layout=layout)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "lost the federation" in refused.value.details()
            with pytest.raises(grpc.RpcError) as refused:  # shard 1's slice is gone
                op.get_model()
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            stream = op._stub.GetModel(pb.GetModelRequest(shard_slice=True), timeout=10)
            header, got = op._receive(stream, "header")
        assert header.version == 3 and header.layout_hash == layout.hash
        assert torch.equal(got["weights"], client.shard_map.split(model)[0])
        client.close()
        # It had stopped taking writes: `aggsrv serve` exits non-zero (restart the federation).
        assert shards[0].terminate() == 1
    finally:
        for s in shards:
            s.close()
