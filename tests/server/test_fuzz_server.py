"""Property-based fuzzing (hypothesis) of the request headers and raw stream bytes of a REAL
server: one in-process server (fedasync, one registered client "fuzz-client" with a job) answers
every property over gRPC on loopback.

For each input, independent oracles written from the status table of aggregation.proto say which
status the call must end with (exactly, where the checks' order makes it one code). Always:

* the call ends with OK only when the input is valid, else with a documented code;
* never UNKNOWN: an exception escaping a handler shows as UNKNOWN, a bug. Bytes that are not a
  protobuf message at all are INVALID_ARGUMENT too: the service's own request deserializers hand
  them to the handler as a value it refuses (`test_unparseable_bytes_are_invalid_argument` pins
  it down per call);
* a refused call leaves the strategy's whole state dict (model, job table, update ledger, ...)
  bit-identical and `updates_accepted` unchanged, and the server stays healthy (health SERVING,
  no upload slot or in-flight update left behind).

Each test prints how many inputs it tried. Inputs are fresh each run (no example database).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import string
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import crc32c as _crc32c
import grpc
import numpy as np
import pytest
import torch
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_helpers import RunningServer, tiny_model
from state_helpers import assert_same_state

from aggsrv import protocol as P
from aggsrv.client.client import Client, ClientJob
from aggsrv.transport import WireDtype
from aggsrv.v1 import aggregation_pb2 as pb
from aggsrv.v1 import aggregation_pb2_grpc as pb_grpc
from aggsrv.v1 import tensor_pb2 as tpb

SC = grpc.StatusCode
OK = SC.OK
IA, NF, FP = SC.INVALID_ARGUMENT, SC.NOT_FOUND, SC.FAILED_PRECONDITION
DL, AB, RE = SC.DATA_LOSS, SC.ABORTED, SC.RESOURCE_EXHAUSTED
# The codes a refused call may end with (the status table), DEADLINE_EXCEEDED included: a call
# that stalls past its short deadline is allowed, but the health checks after it would then
# find the upload slot or the in-flight update it still holds.
DOCUMENTED = {IA, NF, FP, DL, AB, RE, SC.OUT_OF_RANGE, SC.DEADLINE_EXCEEDED}
CODEC = frozenset({IA, DL, RE})  # what a payload the decoder refuses may end with
UNPARSEABLE = "the request bytes are not a valid aggsrv.v1."

REG = "fuzz-client"
CALL_TIMEOUT = 5.0
U64 = 2**64 - 1
LIMIT = 4 << 20  # the server's max_receive_message_bytes (default)
CHUNK = 64  # the chunk size our streams use (the server allows up to chunk_bytes = 1 MiB)
ID_CHARS = string.ascii_letters + string.digits + "._:@-"
ID_OK = frozenset(ID_CHARS)
HUGE = "h" * (5 << 20)  # over the receive limit: gRPC itself answers RESOURCE_EXHAUSTED
ODD_IDS = ["", " ", "a b", "ä", "a\nb", "\x00", "x" * 129, "🙂", "a/b", "A" * 128, "é" * 64]
ODD_IDS.append(HUGE)
DENSE = (tpb.TENSOR_ENCODING_UNSPECIFIED, tpb.TENSOR_ENCODING_DENSE)
DTYPES = (0, 1, 2, 3)  # what a download request may ask for: UNSPECIFIED (= float32) and three
HEADER_DTYPES = (1, 2, 3)  # what a header announcing tensors must name (UNSPECIFIED: refused)
MIN_RECEIVE = 1024  # the smallest receive limit a client may declare (0: not declared)
JOB_STATES = (
    pb.JOB_STATE_CURRENT,
    pb.JOB_STATE_COMPLETED,
    pb.JOB_STATE_SUPERSEDED,
    pb.JOB_STATE_UNKNOWN,
)


def fuzz(max_examples: int) -> settings:
    return settings(
        max_examples=max_examples,
        deadline=None,
        database=None,
        derandomize=False,
        print_blob=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


def well_formed(value: str) -> bool:
    """The id rule of aggregation.proto, written apart from the server's regex."""
    return 1 <= len(value) <= 128 and set(value) <= ID_OK


def layout_hash(tensors) -> str:
    """tensor.proto's layout hash: SHA-256 of the UTF-8 JSON `[[name,[dim,...]],...]`, no
    spaces, non-ASCII characters as their own UTF-8 bytes (never \\uXXXX escapes)."""
    manifest = [[t.name, [int(d) for d in t.shape]] for t in tensors]
    text = json.dumps(manifest, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def job_number(text: str) -> int | None:
    """The job a wire job id names: only the exact decimal form the server writes (str of an
    int >= 1, at most 19 digits); " 1", "+1", "01" and "١" name no job."""
    if re.fullmatch(r"[1-9][0-9]{0,18}", text) is None:
        return None
    return int(text)


# ------------------------------------------------------------------------------------ the server


@dataclass
class Before:
    state: dict
    accepted: int
    model: torch.Tensor
    version: int


@dataclass
class Env:
    srv: RunningServer
    client: Client
    job: ClientJob | None = None
    tried: Counter = field(default_factory=Counter)
    codes: dict[str, Counter] = field(default_factory=dict)
    ledger: set[tuple[str, str]] = field(default_factory=set)  # accepted (client, update id)

    def __post_init__(self) -> None:
        self.channel = grpc.insecure_channel(self.srv.address)
        self.stub = pb_grpc.AggregationStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        self.push_raw = self.channel.stream_unary(
            "/aggsrv.v1.Aggregation/PushUpdate",
            request_serializer=lambda b: b,  # arbitrary bytes: protobuf parses them server-side
            response_deserializer=pb.PushUpdateResponse.FromString,
        )
        self.layout = self.client.layout
        self.layout_pb = P.layout_to_pb(self.layout)
        self.hash = self.layout.hash
        self.d = self.layout.numel

    @property
    def fed(self):
        return self.srv.federation

    @property
    def strategy(self):
        return self.srv.strategy

    def before(self) -> Before:
        return Before(
            self.srv.state(), self.fed.counters["accepted"], self.srv.model(), self.fed.version
        )

    def known_clients(self) -> list[str]:
        return [REG, *sorted(self.fed.clients)[:20]]

    def job_number(self) -> int:
        return int(self.job.job_id)

    def refresh_job(self) -> None:
        self.job = self.client.get_job()

    def record(self, prop: str, code: SC) -> None:
        self.tried[prop] += 1
        self.codes.setdefault(prop, Counter())[code.name] += 1

    def check(
        self,
        prop: str,
        code: SC,
        details: str,
        expected: frozenset | set,
        before: Before,
    ) -> None:
        """The status is one the oracle allows; a refusal changed nothing; the server is well."""
        self.record(prop, code)
        assert code == OK or code in DOCUMENTED, f"undocumented status {code}: {details[:500]}"
        assert code in expected, (
            f"got {code.name} ({details[:300]!r}), expected one of "
            f"{sorted(c.name for c in expected)}"
        )
        if code != OK:
            after = self.before()
            assert after.accepted == before.accepted
            assert torch.equal(after.model.view(torch.int32), before.model.view(torch.int32))
            assert_same_state(before.state, after.state)
        self.check_healthy()

    def check_healthy(self) -> None:
        reply = self.health.Check(health_pb2.HealthCheckRequest(service=""), timeout=CALL_TIMEOUT)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        status = self.stub.GetStatus(pb.GetStatusRequest(), timeout=CALL_TIMEOUT)
        assert status.uploads_in_progress == 0 and status.queue_depth == 0
        assert not self.fed.in_flight_updates
        assert status.version == self.fed.version

    def report(self, prop: str) -> None:
        n = self.tried[prop]
        codes = dict(sorted(self.codes.get(prop, Counter()).items()))
        print(f"\n{prop}: {n} inputs tried, none crashed or changed the model {codes}")


@pytest.fixture(scope="module")
def env() -> Iterator[Env]:
    srv = RunningServer(rate_limit_per_second=0, upload_idle_timeout_seconds=3)
    client = Client(srv.address, REG, retries=0, timeout=CALL_TIMEOUT)
    try:
        client.register(tiny_model(21))
        e = Env(srv, client)
        e.refresh_job()
        yield e
        e.channel.close()
    finally:
        client.close()
        srv.stop()


def call(fn: Callable) -> tuple[SC, str, object]:
    try:
        return OK, "", fn()
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or "", None


# ------------------------------------------------------------------------------------ strategies

u64 = st.one_of(st.integers(0, U64), st.sampled_from([0, 1, 2, 2**31, 2**32, 2**63, U64]))
enums = st.one_of(st.integers(0, 4), st.integers(-(2**31), 2**31 - 1))
floats = st.floats(allow_nan=True, allow_infinity=True)


def pick(known: Callable[[], list[str]], fallback: str) -> st.SearchStrategy[str]:
    """One of a list read when drawn (the draws never depend on the server's state: hypothesis
    wants the same choices to mean the same thing; only the value they map to moves)."""

    def choose(i: int) -> str:
        values = known()
        return values[i % len(values)] if values else fallback

    return st.integers(0, 63).map(choose)


def ids(known: Callable[[], list[str]] = lambda: [REG]) -> st.SearchStrategy[str]:
    """Client or update ids: known ones, well-formed ones, anything, too long, odd ones."""
    return st.one_of(
        pick(known, REG),
        st.text(alphabet=ID_CHARS, min_size=1, max_size=128),
        st.text(max_size=160),
        st.text(alphabet=ID_CHARS, min_size=129, max_size=400),
        st.sampled_from(ODD_IDS),
    )


def hashes(good: str) -> st.SearchStrategy[str]:
    return st.one_of(
        st.just(good),
        st.text(max_size=80),
        st.text(alphabet="0123456789abcdef", min_size=64, max_size=64),
        st.sampled_from([good.upper(), good[:-1], good + "0", ""]),
    )


JOB_ID_FORMS = ["{c}", " {c}", "+{c}", "0{c}", "{c} ", "{c}\n", "", "١", "²", "1_0", "-1", "0x1"]


def job_ids(current: Callable[[], int]) -> st.SearchStrategy[str]:
    """Job ids around the client's current job (and the forms only int() reads as it)."""
    return st.one_of(
        st.sampled_from(JOB_ID_FORMS).map(lambda form: form.format(c=current())),
        st.integers(-5, 5).map(lambda k: str(current() + k)),
        u64.map(str),
        st.text(max_size=12),
    )


def near(value: Callable[[], int], lo: int, hi: int) -> st.SearchStrategy[int]:
    """value() + k for k in [lo, hi], at least 0."""
    return st.integers(lo, hi).map(lambda k: max(0, value() + k))


def tensor_infos(main: str, d: int) -> st.SearchStrategy[list]:
    info = st.builds(
        tpb.TensorInfo,
        name=st.one_of(
            st.sampled_from(["update", "weights", "buffers", "basis", ""]), st.text(max_size=20)
        ),
        numel=st.one_of(st.just(d), st.integers(0, 2 * d), u64),
        encoding=enums,
        nnz=st.one_of(st.integers(0, d + 1), u64),
    )
    return st.one_of(
        st.just([tpb.TensorInfo(name=main, numel=d)]),
        st.sampled_from(DENSE).map(lambda e: [tpb.TensorInfo(name=main, numel=d, encoding=e)]),
        st.lists(info, max_size=4),
    )


def layout_tensors(names: list[str]) -> st.SearchStrategy:
    return st.builds(
        tpb.LayoutTensor,
        name=st.one_of(st.sampled_from([*names, "", "x"]), st.text(max_size=30)),
        shape=st.lists(st.one_of(st.integers(0, 10), u64), max_size=4),
        is_norm=st.booleans(),
    )


@st.composite
def layouts(draw, good: tpb.ModelLayout) -> tpb.ModelLayout:
    names = [t.name for t in good.tensors]
    kind = draw(st.sampled_from(["good", "random", "mutated"]))
    if kind == "good":
        return good
    if kind == "random":
        return tpb.ModelLayout(
            tensors=draw(st.lists(layout_tensors(names), max_size=6)),
            buffers=draw(st.lists(layout_tensors(names), max_size=3)),
        )
    out = tpb.ModelLayout()
    out.CopyFrom(good)
    i = draw(st.integers(0, len(out.tensors) - 1))
    how = draw(st.sampled_from(["shape", "norm", "buffer", "drop", "rename", "swap"]))
    if how == "shape":
        out.tensors[i].shape.append(draw(st.integers(0, 3)))
    elif how == "norm":  # not covered by the hash: still the server's model
        out.tensors[i].is_norm = not out.tensors[i].is_norm
    elif how == "buffer":
        out.buffers.append(draw(layout_tensors(names)))
    elif how == "drop":
        del out.tensors[i]
    elif how == "rename":
        out.tensors[i].name = draw(st.text(max_size=10))
    else:
        j = draw(st.integers(0, len(out.tensors) - 1))
        a, b = tpb.LayoutTensor(), tpb.LayoutTensor()
        a.CopyFrom(out.tensors[i])
        b.CopyFrom(out.tensors[j])
        out.tensors[i].CopyFrom(b)
        out.tensors[j].CopyFrom(a)
    return out


labels = st.one_of(
    st.dictionaries(st.text(max_size=20), st.text(max_size=20), max_size=5),
    st.dictionaries(st.text(max_size=300), st.text(max_size=300), max_size=3),
    st.dictionaries(st.text(min_size=1, max_size=6), st.just("v"), min_size=30, max_size=40),
)


def payload(d: int, seed: int) -> torch.Tensor:
    return torch.randn(d, generator=torch.Generator().manual_seed(seed)) * 0.01


# --------------------------------------------------------------------------------------- oracles


def push_header_verdict(env: Env, h: pb.UpdateHeader) -> frozenset | None:
    """The code PushUpdate's header checks end with, in the service's order; None when the
    header passes and announces exactly the dense float32 "update" of D elements."""
    if not well_formed(h.client_id):
        return frozenset({IA})
    if h.client_id not in env.fed.clients:
        return frozenset({NF})
    if h.layout_hash != env.hash:
        return frozenset({FP})
    if not well_formed(h.update_id):
        return frozenset({IA})
    if h.kind not in (pb.UPDATE_KIND_WEIGHTS, pb.UPDATE_KIND_DELTA):
        return frozenset({IA})
    if h.dtype not in HEADER_DTYPES or job_number(h.job_id) is None:
        return frozenset({IA})
    if {t.name: t.numel for t in h.tensors} != {"update": env.d}:
        return frozenset({IA})
    if any(t.encoding not in (0, 1, 2, 3) for t in h.tensors):
        return frozenset({IA})
    if any(t.encoding not in DENSE for t in h.tensors) or h.dtype in (2, 3):
        # Sparse or half-precision, but the body is dense float32: too many bytes.
        return frozenset({IA})
    return None


def push_strategy_verdict(env: Env, h: pb.UpdateHeader) -> tuple[frozenset, str | None]:
    """After a good decode: (codes, "applied" | "duplicate" | None for a refusal)."""
    if (h.client_id, h.update_id) in env.ledger:
        return frozenset({OK}), "duplicate"
    recipe = env.strategy.make_recipe()
    work = float(h.work.steps) if recipe.local_steps is not None else h.work.epochs
    if not math.isfinite(work) or work < 0:
        return frozenset({IA}), None
    if h.num_samples > env.strategy.config.max_num_samples:
        return frozenset({IA}), None
    n = job_number(h.job_id)
    job = env.strategy.jobs.open.get(n)
    if job is None:
        issued = 1 <= n < env.strategy.jobs.next_id
        return frozenset({AB if issued else IA}), None
    if job.client_id != h.client_id or job.base_version != h.base_version:
        return frozenset({IA}), None
    return frozenset({OK}), "applied"


def valid_body(env: Env, msgs: list) -> bool:
    """Non-empty chunks of "update" in order covering D float32 values, all finite, then a
    trailer with the right length and CRC-32C, then nothing."""
    if not msgs or msgs[-1].WhichOneof("kind") != "trailer":
        return False
    data = b""
    for m in msgs[:-1]:
        if m.WhichOneof("kind") != "chunk":
            return False
        c = m.chunk
        if c.tensor != "update" or c.offset != len(data) or not c.data or len(c.data) % 4:
            return False
        if len(c.data) > env.fed.config.chunk_bytes:
            return False
        data += c.data
    t = msgs[-1].trailer
    if len(data) != 4 * env.d or t.payload_bytes != len(data) or t.crc32c != _crc32c.crc32c(data):
        return False
    return bool(np.isfinite(np.frombuffer(data, "<f4")).all())


def body_messages(env: Env, seed: int) -> list:
    delta = payload(env.d, seed)
    return list(P.chunk_stream({"update": delta}, WireDtype.FLOAT32, CHUNK, pb.UpdateMessage))


def valid_header(env: Env) -> pb.UpdateHeader:
    job = env.job
    return pb.UpdateHeader(
        client_id=REG,
        job_id=job.job_id,
        base_version=job.base_version,
        update_id=uuid.uuid4().hex,
        num_samples=1,
        work=pb.WorkDone(epochs=1.0, complete=True),
        kind=pb.UPDATE_KIND_DELTA,
        dtype=tpb.WIRE_DTYPE_FLOAT32,
        layout_hash=env.hash,
        tensors=[tpb.TensorInfo(name="update", numel=env.d)],
    )


def after_push(env: Env, prop: str, h: pb.UpdateHeader, resp, outcome: str, before: Before):
    """An accepted push: its outcome and version as predicted; then a fresh job."""
    if outcome == "duplicate":
        assert resp.outcome == pb.OUTCOME_DUPLICATE
        assert env.fed.version == before.version
    else:
        assert resp.outcome == pb.OUTCOME_APPLIED and resp.version == before.version + 1
        assert env.fed.counters["accepted"] == before.accepted + 1
        env.ledger.add((h.client_id, h.update_id))
        assert h.job_id == str(job_number(h.job_id)), f"job_id {h.job_id!r} was accepted"
    env.refresh_job()


# ------------------------------------------------------------------------------------ properties


def test_get_job_requests(env: Env) -> None:
    prop = "GetJobRequest"

    @fuzz(200)
    @given(data=st.data())
    def run(data) -> None:
        # A valid request (a registered client, the model's hash, a wire dtype) with up to all
        # three fields replaced by random values.
        req = pb.GetJobRequest(
            client_id=data.draw(pick(env.known_clients, REG)),
            layout_hash=env.hash,
            dtype=data.draw(st.sampled_from(DTYPES)),
        )
        replace = data.draw(st.sets(st.sampled_from(["client_id", "layout_hash", "dtype"])))
        if "client_id" in replace:
            req.client_id = data.draw(ids(env.known_clients))
        if "layout_hash" in replace:
            req.layout_hash = data.draw(hashes(env.hash))
        if "dtype" in replace:
            req.dtype = data.draw(enums)
        if req.ByteSize() > LIMIT:
            want = RE
        elif not well_formed(req.client_id):
            want = IA
        elif req.client_id not in env.fed.clients:
            want = NF
        elif req.layout_hash != env.hash:
            want = FP
        elif req.dtype not in DTYPES:
            want = IA
        else:
            want = OK
        before = env.before()
        code, details, msgs = call(lambda: list(env.stub.GetJob(req, timeout=CALL_TIMEOUT)))
        env.check(prop, code, details, {want}, before)
        if code == OK:
            kinds = [m.WhichOneof("kind") for m in msgs]
            assert kinds[0] == "header" and kinds[-1] == "trailer"
            header = msgs[0].header
            assert header.client_id == req.client_id and header.base_version == env.fed.version
            assert header.dtype == (req.dtype or tpb.WIRE_DTYPE_FLOAT32)
            itemsize = {1: 4, 2: 2, 3: 2}[header.dtype]
            assert msgs[-1].trailer.payload_bytes == env.d * itemsize
            if req.client_id == REG:
                assert env.job is not None
                if header.job_id != env.job.job_id:  # the old job was from an older version
                    assert env.job.base_version < env.fed.version
                env.refresh_job()
                assert env.job.job_id == header.job_id

    run()
    env.report(prop)


def test_heartbeat_requests(env: Env) -> None:
    prop = "HeartbeatRequest"

    @fuzz(200)
    @given(data=st.data())
    def run(data) -> None:
        req = pb.HeartbeatRequest(
            client_id=data.draw(ids(env.known_clients)),
            job_id=data.draw(job_ids(env.job_number)),
        )
        if req.ByteSize() > LIMIT:
            want = RE
        elif not well_formed(req.client_id):
            want = IA
        elif req.client_id not in env.fed.clients:
            want = NF
        else:
            want = OK
        before = env.before()
        code, details, resp = call(lambda: env.stub.Heartbeat(req, timeout=CALL_TIMEOUT))
        env.check(prop, code, details, {want}, before)
        if code == OK:
            assert resp.latest_version == env.fed.version
            if not req.job_id:
                assert resp.job_state == pb.JOB_STATE_UNSPECIFIED
            else:
                assert resp.job_state in JOB_STATES
                n = job_number(req.job_id)
                mine = env.strategy.outstanding_job(req.client_id)
                current = n is not None and mine is not None and mine.job_id == n
                assert (resp.job_state == pb.JOB_STATE_CURRENT) == current, req.job_id

    run()
    env.report(prop)


def test_get_model_requests(env: Env) -> None:
    prop = "GetModelRequest"

    @fuzz(200)
    @given(data=st.data())
    def run(data) -> None:
        latest = env.fed.version
        req = pb.GetModelRequest(
            dtype=data.draw(st.one_of(st.sampled_from(DTYPES), enums)),
            include_buffers=data.draw(st.booleans()),
            client_id=data.draw(ids()),
        )
        version = data.draw(st.one_of(st.none(), near(lambda: latest, -9, 2), u64))
        if version is not None:
            req.version = version
        if req.ByteSize() > LIMIT:
            want = RE
        elif version is not None and version > latest:
            want = SC.OUT_OF_RANGE
        elif version is not None and version not in env.fed.snapshots:
            want = NF
        elif req.dtype not in DTYPES:
            want = IA
        else:
            want = OK
        before = env.before()
        code, details, msgs = call(lambda: list(env.stub.GetModel(req, timeout=CALL_TIMEOUT)))
        env.check(prop, code, details, {want}, before)
        if code == OK:
            header = msgs[0].header
            assert header.version == (latest if version is None else version)
            assert header.latest_version == latest and header.layout_hash == env.hash
            itemsize = {0: 4, 1: 4, 2: 2, 3: 2}[req.dtype]
            assert msgs[-1].trailer.payload_bytes == env.d * itemsize

    run()
    env.report(prop)


@st.composite
def register_bodies(draw, env: Env) -> tuple[str, list]:
    kind = draw(st.sampled_from(["none", "empty_trailer", "bad_trailer", "weights", "junk"]))
    if kind == "none":
        return kind, []
    if kind == "empty_trailer":
        return kind, [pb.RegisterRequest(trailer=tpb.StreamTrailer())]
    if kind == "bad_trailer":
        t = tpb.StreamTrailer(crc32c=draw(st.integers(1, 2**32 - 1)), payload_bytes=draw(u64))
        return kind, [pb.RegisterRequest(trailer=t)]
    if kind == "weights":
        w = payload(env.d, draw(st.integers(0, 1000)))
        return kind, list(
            P.chunk_stream({"weights": w}, WireDtype.FLOAT32, CHUNK, pb.RegisterRequest)
        )
    chunk = tpb.TensorChunk(
        tensor=draw(st.text(max_size=10)), offset=draw(u64), data=draw(st.binary(max_size=64))
    )
    return kind, [pb.RegisterRequest(chunk=chunk)]


def register_verdict(env: Env, h: pb.RegisterHeader, body: str, size: int) -> frozenset:
    """Register's checks in the service's order, for a server that has a model."""
    if size > LIMIT:
        return frozenset({RE})
    if not well_formed(h.client_id):
        return frozenset({IA})
    if len(h.labels) > env.fed.config.max_labels or any(
        len(k.encode()) > 256 or len(v.encode()) > 256 for k, v in h.labels.items()
    ):
        return frozenset({IA})
    if 0 < h.capabilities.max_receive_message_bytes < MIN_RECEIVE:
        return frozenset({IA})
    names = [t.name for t in h.layout.tensors] + [b.name for b in h.layout.buffers]
    if "" in names or len(set(names)) != len(names):
        return frozenset({IA})  # not a layout: empty or duplicate names
    if h.layout_hash != layout_hash(h.layout.tensors):
        return frozenset({IA})
    if h.layout_hash != env.hash or len(h.layout.buffers):
        return frozenset({FP})  # another model (the server's has no float buffers)
    if not h.initial_tensors:
        return frozenset({OK}) if body in ("none", "empty_trailer") else frozenset({IA})
    if h.initial_dtype not in HEADER_DTYPES:
        return frozenset({IA})
    infos = list(h.initial_tensors)
    clean = (
        {t.name: t.numel for t in infos} == {"weights": env.d}
        and all(t.encoding in DENSE for t in infos)
        and h.initial_dtype == tpb.WIRE_DTYPE_FLOAT32
    )
    if clean and body == "weights":
        return frozenset({OK})  # read, checked and discarded
    return CODEC


def test_register_headers(env: Env) -> None:
    prop = "RegisterHeader"
    fields = [
        "client_id", "layout", "layout_hash", "capabilities", "initial_dtype", "initial_tensors",
        "labels", "body",
    ]  # fmt: skip

    @fuzz(400)
    @given(data=st.data())
    def run(data) -> None:
        # A valid registration (a known client again, or a new well-formed id), then up to four
        # of its fields replaced by random values.
        header = pb.RegisterHeader(
            client_id=data.draw(
                st.one_of(pick(env.known_clients, REG), st.text(ID_CHARS, min_size=1, max_size=128))
            ),
            layout=env.layout_pb,
            layout_hash=env.hash,
        )
        body, rest = "none", []
        for name in data.draw(st.sets(st.sampled_from(fields), max_size=4)):
            if name == "client_id":
                header.client_id = data.draw(ids(env.known_clients))
            elif name == "layout":
                lay = data.draw(layouts(env.layout_pb))
                header.layout.CopyFrom(lay)
                if data.draw(st.booleans()):  # mostly a hash that matches the layout sent
                    header.layout_hash = layout_hash(lay.tensors)
            elif name == "layout_hash":
                header.layout_hash = data.draw(hashes(env.hash))
            elif name == "capabilities":
                header.capabilities.CopyFrom(
                    pb.ClientCapabilities(
                        upload_dtypes=data.draw(st.lists(enums, max_size=3)),
                        update_kinds=data.draw(st.lists(enums, max_size=3)),
                        max_receive_message_bytes=data.draw(
                            st.one_of(u64, st.integers(0, 2 * MIN_RECEIVE))
                        ),
                        extensions=data.draw(st.lists(st.text(max_size=10), max_size=2)),
                    )
                )
            elif name == "initial_dtype":
                header.initial_dtype = data.draw(st.one_of(st.sampled_from(DTYPES), enums))
            elif name == "initial_tensors":
                header.initial_tensors.extend(data.draw(tensor_infos("weights", env.d)))
            elif name == "labels":
                header.labels.update(data.draw(labels))
            else:
                body, rest = data.draw(register_bodies(env))
        msgs = [pb.RegisterRequest(header=header), *rest]
        want = register_verdict(env, header, body, msgs[0].ByteSize())
        before = env.before()
        code, details, resp = call(lambda: env.stub.Register(iter(msgs), timeout=CALL_TIMEOUT))
        env.check(prop, code, details, want, before)
        if code == OK:
            assert resp.client_id == header.client_id and resp.layout_hash == env.hash
            assert not resp.initial_model_adopted and resp.model_version == env.fed.version
            assert header.client_id in env.fed.clients
            assert dict(env.fed.clients[header.client_id].labels) == dict(header.labels)
            assert torch.equal(env.srv.model().view(torch.int32), before.model.view(torch.int32))

    run()
    env.report(prop)


def test_update_headers(env: Env) -> None:
    prop = "UpdateHeader"
    fields = [
        "client_id", "job_id", "base_version", "update_id", "num_samples", "work", "kind",
        "dtype", "layout_hash", "tensors",
    ]  # fmt: skip

    @fuzz(400)
    @given(data=st.data())
    def run(data) -> None:
        h = valid_header(env)
        draws = {
            "client_id": ids(env.known_clients),
            "job_id": job_ids(env.job_number),
            "base_version": st.one_of(u64, near(lambda: env.fed.version, -2, 1)),
            "update_id": ids(lambda: sorted(u for _, u in env.ledger)),
            "num_samples": u64,
            "work": st.builds(
                pb.WorkDone,
                steps=u64,
                epochs=floats,
                examples=u64,
                compute_seconds=floats,
                complete=st.booleans(),
                metrics=st.dictionaries(st.text(max_size=8), floats, max_size=3),
            ),
            "kind": st.one_of(st.sampled_from([0, 1, 2]), enums),
            "dtype": st.one_of(st.sampled_from(DTYPES), enums),
            "layout_hash": hashes(env.hash),
            "tensors": tensor_infos("update", env.d),
        }
        for name in data.draw(st.sets(st.sampled_from(fields), max_size=4)):
            value = data.draw(draws[name], label=name)
            if name == "tensors":
                del h.tensors[:]
                h.tensors.extend(value)
            elif name == "work":
                h.work.CopyFrom(value)
            else:
                setattr(h, name, value)
        msgs = [pb.UpdateMessage(header=h), *body_messages(env, data.draw(st.integers(0, 999)))]
        if msgs[0].ByteSize() > LIMIT:
            want, outcome = frozenset({RE}), None
        else:
            want, outcome = push_header_verdict(env, h), None
            if want is None:
                want, outcome = push_strategy_verdict(env, h)
        before = env.before()
        code, details, resp = call(lambda: env.stub.PushUpdate(iter(msgs), timeout=CALL_TIMEOUT))
        env.check(prop, code, details, want, before)
        if code == OK:
            after_push(env, prop, h, resp, outcome, before)

    run()
    env.report(prop)


@st.composite
def mutated(draw, raws: list[bytes]) -> bytes:
    """One of `raws` with one random edit of its bytes: flip, cut, insert or repeat."""
    raw = draw(st.sampled_from(raws))
    how = draw(st.sampled_from(["flip", "cut", "insert", "repeat"]))
    i = draw(st.integers(0, 1 << 16)) % max(1, len(raw))  # not len-dependent: see pick()
    if how == "flip" and raw:
        return raw[:i] + bytes([raw[i] ^ draw(st.integers(1, 255))]) + raw[i + 1 :]
    if how == "cut":
        return raw[:i]
    if how == "insert":
        return raw[:i] + draw(st.binary(min_size=1, max_size=8)) + raw[i:]
    return raw + raw


def parse_all(raws: list[bytes]) -> list | None:
    """The messages as protobuf reads them; None if any of them is not an UpdateMessage."""
    out = []
    for raw in raws:
        try:
            out.append(pb.UpdateMessage.FromString(raw))
        except DecodeError:
            return None
    return out


def raw_verdict(env: Env, msgs: list) -> tuple[frozenset, str | None]:
    if not msgs or msgs[0].WhichOneof("kind") != "header":
        return frozenset({IA}), None
    h = msgs[0].header
    refused = push_header_verdict(env, h)
    if refused is not None:
        return refused, None
    if not valid_body(env, msgs[1:]):
        return CODEC, None
    return push_strategy_verdict(env, h)


def test_raw_update_stream_bytes(env: Env) -> None:
    prop = "PushUpdate raw bytes"

    @fuzz(500)
    @given(data=st.data())
    def run(data) -> None:
        good = [
            m.SerializeToString()
            for m in [pb.UpdateMessage(header=valid_header(env)), *body_messages(env, 7)]
        ]
        if data.draw(st.integers(0, 3), label="edit a valid stream") > 0:  # 3 in 4
            raws = list(good)
            i = data.draw(st.integers(0, 63)) % len(raws)
            how = data.draw(st.sampled_from(["mutate", "replace", "drop", "insert", "keep"]))
            if how == "mutate":
                raws[i] = data.draw(mutated([raws[i]]))
            elif how == "replace":
                raws[i] = data.draw(st.binary(max_size=64))
            elif how == "drop":
                del raws[i]
            elif how == "insert":
                raws.insert(i, data.draw(st.one_of(st.binary(max_size=64), st.sampled_from(good))))
        else:
            piece = st.one_of(
                st.binary(max_size=64),
                st.sampled_from(good),
                mutated(good),
            )
            raws = data.draw(st.lists(piece, max_size=8))
        msgs = parse_all(raws)
        if msgs is None:  # protobuf refuses some message: the server may refuse earlier
            want, outcome = frozenset(DOCUMENTED), None
        else:
            want, outcome = raw_verdict(env, msgs)
        before = env.before()
        code, details, resp = call(lambda: env.push_raw(iter(raws), timeout=CALL_TIMEOUT))
        env.check(prop, code, details, want, before)
        if code == OK:
            after_push(env, prop, msgs[0].header, resp, outcome, before)

    run()
    env.report(prop)


# --------------------------------------------------------------------------- pinned examples


@pytest.mark.parametrize(
    ("method", "kind"),
    [
        ("PushUpdate", "stream_unary"),
        ("Register", "stream_unary"),
        ("Heartbeat", "unary_unary"),
        ("GetJob", "unary_stream"),
        ("GetModel", "unary_stream"),
    ],
)
def test_unparseable_bytes_are_invalid_argument(env: Env, method: str, kind: str) -> None:
    """A request that is not protobuf at all: INVALID_ARGUMENT with a short message (grpc.aio's
    own deserializer would answer UNKNOWN with Python exception text; the service's do not)."""
    garbage = b"\xff\xff\xff"
    rpc = getattr(env.channel, kind)(
        f"/aggsrv.v1.Aggregation/{method}",
        request_serializer=lambda b: b,
        response_deserializer=lambda b: b,
    )
    before = env.before()
    if kind == "stream_unary":
        code, details, _ = call(lambda: rpc(iter([garbage]), timeout=CALL_TIMEOUT))
    elif kind == "unary_unary":
        code, details, _ = call(lambda: rpc(garbage, timeout=CALL_TIMEOUT))
    else:
        code, details, _ = call(lambda: list(rpc(garbage, timeout=CALL_TIMEOUT)))
    assert code == IA and details.startswith(UNPARSEABLE), (code, details)
    env.check(f"unparseable {method}", code, details, frozenset({IA}), before)


def test_register_may_end_with_an_empty_trailer(env: Env) -> None:
    """aggregation.proto: a registration without initial tensors may close the stream after the
    header, and "a trailer with crc32c 0 is also accepted" (was INVALID_ARGUMENT, fixed)."""
    header = pb.RegisterHeader(
        client_id="trailer-client", layout=env.layout_pb, layout_hash=env.hash
    )
    empty = pb.RegisterRequest(trailer=tpb.StreamTrailer())
    resp = env.stub.Register(iter([pb.RegisterRequest(header=header), empty]), timeout=5)
    assert resp.client_id == "trailer-client"
    bad = pb.RegisterRequest(trailer=tpb.StreamTrailer(crc32c=5, payload_bytes=4))
    code, _, _ = call(lambda: env.stub.Register(iter([pb.RegisterRequest(header=header), bad])))
    assert code == IA
    extra = pb.RegisterRequest(trailer=tpb.StreamTrailer())
    code, _, _ = call(
        lambda: env.stub.Register(iter([pb.RegisterRequest(header=header), empty, extra]))
    )
    assert code == IA


# Found by this file: job ids were read with int(), so ' 1', '+1', '01' named job 1.
def test_job_id_must_be_the_exact_string(env: Env) -> None:
    env.refresh_job()
    n = int(env.job.job_id)
    digits = "٠١٢٣٤٥٦٧٨٩"
    variant = "".join(digits[int(c)] for c in str(n))  # the same number in Arabic-Indic digits
    h = valid_header(env)
    h.job_id = variant
    msgs = [pb.UpdateMessage(header=h), *body_messages(env, 3)]
    code, _, resp = call(lambda: env.stub.PushUpdate(iter(msgs), timeout=CALL_TIMEOUT))
    if code == OK:
        env.ledger.add((h.client_id, h.update_id))
        env.refresh_job()
    assert code == IA, f"job_id {variant!r} accepted as job {n}"
