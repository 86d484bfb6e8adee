"""A sharded federation reached through rank 0 only (docs/sharding.md, "One address"): shard
processes joined by gloo, clients with ``direct_to_shards=False`` that send whole updates to
rank 0 (which forwards the slices) and read whole jobs and models from it, with HMAC
authentication on, so rank 0 must present the caller's token to the other shards.

The oracle, as in test_sharded_server.py: rank 0 records every call it orders, and one
whole-model strategy makes the same calls with the whole updates. Every update is a DELTA
that is one-hot on a coordinate of its own, spread over every shard, so the model can only
change where an applied update put its one."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import random
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from bitwise_diff import describe_difference

from aggsrv import cli
from aggsrv.client.client import Client
from aggsrv.layout import ModelLayout
from aggsrv.server import auth as A
from aggsrv.strategies import Status, StrategyError, Update, UpdateKind, make_strategy
from aggsrv.v1 import aggregation_pb2 as pb
from aggsrv.v1 import aggregation_pb2_grpc as pb_grpc
from aggsrv.v1 import tensor_pb2 as tpb

CLIENTS = 3
ROUNDS = 3
CASES = {
    "fedavg": {"mode": "sync", "min_clients": CLIENTS, "round_timeout": 2.0},
    "fedbuff": {"buffer_size": 2},
    "fedasync": {"alpha": 0.5},
    "orthofl": {},
}


def _layout() -> ModelLayout:
    # D = 461: cuts inside tensors, every shard non-empty for 2 and 3 shards.
    return ModelLayout.from_named_shapes(
        [("a.weight", (17, 13)), ("a.bias", (17,)), ("b.weight", (11, 19)), ("b.bias", (11,)),
         ("c.weight", (1, 3))]
    )  # fmt: skip


def _shard_config(name: str, world: int, rank: int, home: Path, extra: dict | None = None):
    from aggsrv.server.config import ServerConfig

    return ServerConfig(
        **(extra or {}),
        host="127.0.0.1", port=0, auth="hmac", auth_secret_file=str(home / f"r{rank}" / "secret"),
        state_dir="", durability="off", device="cpu", strategy=name,
        strategy_config=CASES[name], shards=world, rank=rank, rate_limit_per_second=0.0,
        shard_heartbeat_seconds=0.2, shard_slice_wait_seconds=3.0, shard_timeout_seconds=30.0,
    )  # fmt: skip


def _shard_main(
    rank: int, world: int, init: str, names: list[str], home: Path, queue, extra: dict
) -> None:
    """One shard process: the federations of ``names`` one after another in one gloo group;
    rank 0 reports its port, then the calls it ordered."""
    try:
        import torch.distributed as dist

        from aggsrv.server.app import Server
        from aggsrv.server.shards import ShardGroup

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
        for name in names:
            config = _shard_config(name, world, rank, home, extra)
            shards = ShardGroup.of(config)
            calls: list[tuple[str, dict]] = []
            if rank == 0:
                announce = shards.announce

                def record(kind, meta, *more, announce=announce, calls=calls):
                    if kind not in ("noop", "stop"):
                        calls.append((kind, dict(meta)))
                    return announce(kind, meta, *more)

                shards.announce = record
            asyncio.run(_serve_one(Server(config, shards), rank, name, queue))
            if rank == 0:
                queue.put(("calls", name, calls, None))
        dist.destroy_process_group()
    except Exception:
        queue.put(("error", rank, None, traceback.format_exc()))


async def _serve_one(server, rank: int, name: str, queue) -> None:
    port = await server.start()
    queue.put(("port", name, (rank, port), None))
    await server.stop_requested.wait()
    await server.stop(1.0)


def _next(queue, kind: str) -> tuple:
    msg = queue.get(timeout=120)
    if msg[0] == "error":
        raise AssertionError(f"shard {msg[1]} failed:\n{msg[3]}")
    assert msg[0] == kind, msg
    return msg


class Federations:
    """``world`` shard processes serving the federations of ``names`` in turn."""

    def __init__(self, world: int, names: list[str], tmp: Path, extra: dict | None = None) -> None:
        secret = A.new_secret()
        for r in range(world):  # one secret, one folder per rank (each writes its admin token)
            A.save_secret(tmp / f"r{r}" / "secret", secret)
        self.authority = A.HmacAuthenticator(secret)
        self.world = world
        ctx = mp.get_context("spawn")
        self.queue = ctx.Queue()
        init = f"file://{tmp / 'rendezvous'}"
        self.procs = [
            ctx.Process(
                target=_shard_main,
                args=(r, world, init, names, tmp, self.queue, extra or {}),
                daemon=True,
            )
            for r in range(world)
        ]
        for p in self.procs:
            p.start()

    def next_addresses(self) -> list[str]:
        ports = dict(_next(self.queue, "port")[2] for _ in range(self.world))
        return [f"127.0.0.1:{ports[r]}" for r in range(self.world)]

    def token(self, client_id: str) -> str:
        return self.authority.issue(client_id)

    def client(self, address: str, client_id: str, direct: bool = False, **kw) -> Client:
        return Client(address, client_id, token=self.token(client_id), timeout=30,
                      direct_to_shards=direct, **kw)  # fmt: skip

    def shut_down(self, address: str) -> list[tuple[str, dict]]:
        admin = self.authority.issue(A.ADMIN_SUBJECT, A.ROLE_ADMIN)
        with Client(address, "operator", token=admin) as op:
            op.admin_call("Shutdown", pb.ShutdownRequest(grace_seconds=1))
        return _next(self.queue, "calls")[2]

    def close(self) -> None:
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


def _coordinates(layout: ModelLayout, count: int, seed: int) -> list[int]:
    """``count`` distinct coordinates spread over [0, D), so every shard gets some."""
    rng = random.Random(seed)
    stride = layout.numel // count
    return [k * stride + rng.randrange(stride) for k in range(count)]


def _one_hot(layout: ModelLayout, at: int, value: float) -> torch.Tensor:
    t = torch.zeros(layout.numel)
    t[at] = value
    return t


def _run_relay_clients(feds: Federations, address: str, layout, initial, seed: int):
    """CLIENTS clients that know rank 0 only, ROUNDS one-hot DELTAs each, the first one sent
    twice; (whole updates by id, answers by id, the final version and model)."""
    spots = _coordinates(layout, CLIENTS * ROUNDS, seed)
    sent: dict[str, torch.Tensor] = {}
    answers: dict[str, list[Any]] = {}
    lock = threading.Lock()
    first = feds.client(address, "c0")
    first.register(layout=layout, initial=initial)
    errors: list[str] = []

    def run(i: int) -> None:
        try:
            client = first if i == 0 else feds.client(address, f"c{i}")
            if i:
                client.register(layout=layout)
            assert client.shard_map is None  # it never connects to another shard
            for r in range(ROUNDS):
                job = client.get_job(timeout=20)
                assert job.weights.numel() == layout.numel  # the whole job, from rank 0
                update_id = f"u{i}-{r}"
                tensor = _one_hot(layout, spots[i * ROUNDS + r], 0.5 + i + r / 8)
                with lock:
                    sent[update_id] = tensor.clone()
                for _ in range(2 if (i, r) == (1, 0) else 1):
                    try:
                        answer = client.push(job, tensor, num_samples=10 + 7 * i,
                                             update_id=update_id, epochs=1.0)  # fmt: skip
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


def _replay(name: str, layout, initial, calls, sent) -> tuple:
    """One whole-model strategy making rank 0's calls; (version, model, outcomes by id)."""
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
                update = Update(
                    client_id=meta["client"], job_id=int(meta["job_id"]),
                    base_version=int(meta["base_version"]), update_id=meta["update_id"],
                    num_samples=int(meta["num_samples"]), work_done=float(meta["work_done"]),
                    kind=UpdateKind[meta["kind"]], tensor=sent[meta["update_id"]].clone(),
                )  # fmt: skip
                outcome = strategy.on_update(update, now)
                outcomes.setdefault(meta["update_id"], []).append(outcome)
        except StrategyError as exc:
            if kind == "update":
                outcomes.setdefault(meta["update_id"], []).append(exc)
    return strategy.version, strategy.global_model(), outcomes


def _status_version(feds: Federations, address: str) -> int:
    with feds.client(address, "operator", retries=0) as op:
        return int(op.status().version)


@pytest.mark.parametrize("world", [2, 3])
def test_clients_of_rank_0_only_equal_one_server(world: int, tmp_path: Path) -> None:
    """FedAvg (sync rounds) and FedBuff through rank 0's relay: outcomes, versions and the
    model equal one whole-model strategy's bit for bit; a retried id is DUPLICATE; the whole
    model and job from rank 0 equal what a client assembles from every shard."""
    seed = random.randrange(1 << 30)
    names = ["fedavg", "fedbuff"]
    layout = _layout()
    feds = Federations(world, names, tmp_path)
    try:
        for name in names:
            addresses = feds.next_addresses()
            initial = torch.randn(layout.numel, generator=torch.Generator().manual_seed(seed))
            sent, answers, version, model = _run_relay_clients(
                feds, addresses[0], layout, initial, seed
            )
            context = f"{name} on {world} shards, seed {seed}"
            with feds.client(addresses[0], "c0", direct=True) as direct:
                direct.register(layout=layout)
                assert direct.shard_map is not None and direct.shard_map.shards == world
                _, assembled = direct.get_model(version)
                bounds = list(direct.shard_map.bounds)
            # Rank 0's whole model equals the slices every shard serves, joined.
            assert torch.equal(model, assembled), context
            assert [_status_version(feds, a) for a in addresses] == [version] * world, context
            calls = feds.shut_down(addresses[0])
            want_version, want, outcomes = _replay(name, layout, initial, calls, sent)
            assert version == want_version, context
            assert set(answers) == set(outcomes), context
            for uid, got in answers.items():
                assert len(got) == len(outcomes[uid]), (context, uid, got, outcomes[uid])
                for answer, expect in zip(got, outcomes[uid], strict=True):
                    if isinstance(expect, StrategyError):
                        assert isinstance(answer, grpc.StatusCode), (context, uid, answer)
                    else:
                        assert (answer.status, answer.version, answer.original) == (
                            expect.status, expect.version, expect.original,
                        ), (context, uid, answer, expect)  # fmt: skip
            assert answers["u1-0"][1].status is Status.DUPLICATE, context
            diff = describe_difference(model, want, bounds)
            assert not diff, f"{context}: {diff}"
            # One-hot updates: the model moved only where an update put its one.
            moved = set((model != initial).nonzero().flatten().tolist())
            ones = {int(t.nonzero()) for t in sent.values()}
            assert moved and moved <= ones, (context, sorted(moved - ones))
            assert version >= 2, context
    finally:
        feds.close()


def _until_uploads(feds: Federations, address: str, count: int, limit: float = 20.0) -> None:
    """Wait until the shard at ``address`` has ``count`` uploads in progress."""
    give_up = time.monotonic() + limit
    while _status(feds, address).uploads_in_progress != count:
        assert time.monotonic() < give_up, f"{address} never had {count} uploads in progress"
        time.sleep(0.05)


def _status(feds: Federations, address: str) -> pb.StatusResponse:
    with feds.client(address, "operator", retries=0) as op:
        return op.status()


def _stalled_slice(feds: Federations, address: str, job, layout, update_id: str, rank: int,
                   shard_map) -> tuple[Any, threading.Event]:  # fmt: skip
    """A direct upload of slice ``rank`` that sends its header and stops: the shard holds the
    update id as being uploaded until the call is cancelled."""
    release = threading.Event()
    header = pb.UpdateHeader(
        client_id="c0", job_id=job.job_id, base_version=job.base_version, update_id=update_id,
        num_samples=5, kind=pb.UPDATE_KIND_DELTA, dtype=tpb.WIRE_DTYPE_FLOAT32,
        layout_hash=layout.hash, shard_rank=rank,
        tensors=[tpb.TensorInfo(name="update", numel=shard_map.local_numel(rank))],
    )  # fmt: skip

    def messages():
        yield pb.UpdateMessage(header=header)
        release.wait(30)

    channel = grpc.insecure_channel(address)
    stub = pb_grpc.AggregationStub(channel)
    call = stub.PushUpdate.future(
        messages(), timeout=30, metadata=[("authorization", f"Bearer {feds.token('c0')}")]
    )
    return (call, channel), release


def test_relay_failure_retry_shapes_and_whole_reads(tmp_path: Path) -> None:
    """FedAsync on 2 shards through rank 0: a slice rank 0 cannot forward is UNAVAILABLE with
    nothing applied, its retry is applied once and then DUPLICATE; short and misdirected
    payloads are refused with what rank 0 takes; whole GetModel/GetJob equal the slices."""
    seed = random.randrange(1 << 30)
    layout = _layout()
    feds = Federations(2, ["fedasync"], tmp_path)
    try:
        addresses = feds.next_addresses()
        initial = torch.randn(layout.numel, generator=torch.Generator().manual_seed(seed))
        client = feds.client(addresses[0], "c0", retries=0)
        client.register(layout=layout, initial=initial)
        direct = feds.client(addresses[0], "c0", direct=True, retries=0)
        direct.register(layout=layout)
        shard_map = direct.shard_map
        spots = _coordinates(layout, 4, seed)

        job = client.get_job()
        assert torch.equal(job.weights, initial)
        # Shard 1 holds "u-x" as being uploaded (a stalled direct slice): the forward fails.
        stalled, release = _stalled_slice(feds, addresses[1], job, layout, "u-x", 1, shard_map)
        _until_uploads(feds, addresses[1], 1)
        delta = _one_hot(layout, spots[-1], 2.0)  # on shard 1
        with pytest.raises(grpc.RpcError) as refused:
            client.push(job, delta, update_id="u-x", num_samples=5)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value.details()
        details = refused.value.details()
        assert "shard 1" in details and "send it again" in details, details
        assert [_status_version(feds, a) for a in addresses] == [0, 0]
        stalled[0].cancel()
        release.set()
        stalled[1].close()
        _until_uploads(feds, addresses[1], 0)
        # The retry is applied once; a second retry is DUPLICATE.
        first = client.push(job, delta, update_id="u-x", num_samples=5)
        assert first.status is Status.APPLIED and first.version == 1, first
        again = client.push(job, delta, update_id="u-x", num_samples=5)
        assert again.status is Status.DUPLICATE and again.version == 1, again
        version, model = client.get_model()
        assert version == 1
        assert torch.equal(model, direct.get_model(1)[1])
        moved = (model != initial).nonzero().flatten().tolist()
        assert moved == [spots[-1]], moved

        # A payload that is neither the whole model nor rank 0's slice names both lengths.
        job = client.get_job()
        for numel, rank, code, words in (
            (layout.numel - 1, 0, grpc.StatusCode.INVALID_ARGUMENT, str(layout.numel)),
            (shard_map.local_numel(1), 1, grpc.StatusCode.FAILED_PRECONDITION, "shard 1"),
        ):
            header = pb.UpdateHeader(
                client_id="c0", job_id=job.job_id, base_version=job.base_version,
                update_id=f"bad-{rank}", num_samples=5, kind=pb.UPDATE_KIND_DELTA,
                dtype=tpb.WIRE_DTYPE_FLOAT32, layout_hash=layout.hash, shard_rank=rank,
            )  # fmt: skip
            stream = client._update_stream(header, torch.zeros(numel), {}, "dense", rank)
            with pytest.raises(grpc.RpcError) as refused:
                client._stub.PushUpdate(stream(), timeout=20)
            assert refused.value.code() == code, refused.value.details()
            assert words in refused.value.details(), refused.value.details()
        assert [_status_version(feds, a) for a in addresses] == [1, 1]

        # Whole reads through rank 0 equal the slices joined, in every wire dtype asked for.
        pushed = client.push(job, _one_hot(layout, spots[0], -1.5), num_samples=5)
        assert pushed.status is Status.APPLIED
        job = client.get_job()
        assert torch.equal(job.weights, direct.get_model(job.base_version)[1])
        half = feds.client(addresses[0], "reader", download_dtype="float16", retries=0)
        v, whole = half.get_model(job.base_version)
        assert torch.equal(whole, direct.get_model(v)[1].half().float())
        # `aggsrv pull --rank0-only` saves the whole model read through rank 0 alone.
        out = tmp_path / "model.pt"
        argv = ["pull", addresses[0], "--token", feds.token("puller"), "--rank0-only"]
        assert cli.main([*argv, "--version", str(v), "-o", str(out)]) == 0
        pulled = torch.load(out)
        assert torch.equal(torch.cat([t.reshape(-1) for t in pulled.values()]),
                           direct.get_model(v)[1])  # fmt: skip
        for c in (client, direct, half):
            c.close()
        feds.shut_down(addresses[0])
    finally:
        feds.close()


def test_relay_over_tls_checks_the_shards_against_the_chain_file(tmp_path: Path) -> None:
    """TLS without client certificates: rank 0 checks shard 1's certificate against its own
    tls_cert file, here the server certificate followed by the CA that signed it. The model
    has float buffers (BatchNorm statistics), which live on rank 0 whole: a relayed update
    carries them, and the whole job and model from rank 0 hold them. ORTHOFL: the shards reduce
    partial sums in every update, the buffers' checks included."""
    from tls_helpers import make_pki

    pki = make_pki(tmp_path / "pki")
    chain = tmp_path / "pki" / "chain.pem"
    chain.write_bytes(pki.server_cert + pki.ca_cert)
    tls = {"tls_cert": str(chain), "tls_key": pki.path("server.key")}
    torch.manual_seed(random.randrange(1 << 30))
    model = torch.nn.Sequential(torch.nn.Linear(20, 30), torch.nn.BatchNorm1d(30),
                                torch.nn.Linear(30, 5))  # fmt: skip
    layout = ModelLayout.from_module(model)
    assert layout.buffer_numel > 0
    feds = Federations(2, ["orthofl"], tmp_path, tls)
    try:
        addresses = feds.next_addresses()
        ca = pki.path("ca.pem")
        with feds.client(addresses[0], "c0", tls_ca=ca, retries=0) as client:
            client.register(model)
            initial = client.get_model(include_buffers=True)
            job = client.get_job()
            assert torch.equal(job.weights, initial[1]) and torch.equal(job.buffers, initial[2])
            delta = torch.randn(layout.numel)
            buffers = torch.rand(layout.buffer_numel) + 0.5  # running_var stays positive
            answer = client.push(job, delta, num_samples=3, buffers=buffers)
            assert answer.status is Status.APPLIED
            version, weights, held = client.get_model(include_buffers=True)
        with feds.client(addresses[0], "c1", direct=True, tls_ca=ca, retries=0) as direct:
            direct.register(model)
            _, want, want_held = direct.get_model(version, include_buffers=True)
        assert torch.equal(weights, want) and torch.equal(held, want_held)
        assert version == 1 and not torch.equal(weights, initial[1])
        assert not torch.equal(held, initial[2])
        admin = feds.authority.issue(A.ADMIN_SUBJECT, A.ROLE_ADMIN)
        with Client(addresses[0], "operator", token=admin, tls_ca=ca) as op:
            op.admin_call("Shutdown", pb.ShutdownRequest(grace_seconds=1))
        _next(feds.queue, "calls")
    finally:
        feds.close()
