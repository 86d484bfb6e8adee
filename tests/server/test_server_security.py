"""Security of the served API, over real gRPC on loopback: bearer tokens (HMAC-signed and a tokens
file), the client-id and admin checks, TLS and mutual TLS, operator calls, and a real
`aggsrv serve` process with its generated secret and admin token.

Every refusal is checked for its status code AND for leaving the server as it was: the global
model and the strategy's whole state bit-exact, the update counters (only PushUpdate refusals
count, as rejected updates under their code) and the client's lease."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import stat
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from server_helpers import RunningServer, flat, register_messages, tiny_model, update_messages
from state_helpers import assert_same_state
from tls_helpers import make_pki

from aggsrv.cli import main as cli_main
from aggsrv.client.client import Client
from aggsrv.server import auth as A
from aggsrv.server import durability as D
from aggsrv.server.app import SERVICE_NAME
from aggsrv.v1 import aggregation_pb2 as pb
from aggsrv.v1 import aggregation_pb2_grpc as pb_grpc
from aggsrv.v1 import tensor_pb2 as tpb
from aggsrv.values import Status

REPO = Path(__file__).resolve().parents[2]
CALL_S = 5.0  # every single call (refusals come back at once; this only bounds a hang)
PROC_CALL_S = 30.0  # calls to the `aggsrv serve` process (its first calls warm it up)
SC = grpc.StatusCode


# ---------------------------------------------------------------------------------- helpers


def rng(salt: int = 0) -> torch.Generator:
    """A generator with a fresh random seed: every run uses new weights and updates."""
    return torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little") ^ salt)


def random_model() -> torch.nn.Module:
    model = tiny_model(0)
    gen = rng(1)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    return model


@contextlib.contextmanager
def running(**config) -> Iterator[RunningServer]:
    srv = RunningServer(**config)
    try:
        yield srv
    finally:
        srv.stop()


def bearer(token: str | None) -> list[tuple[str, str]]:
    return [] if token is None else [("authorization", f"Bearer {token}")]


def refused(fn: Callable[[], object]) -> grpc.RpcError:
    """The RpcError `fn` ended with (fails the test if it succeeded)."""
    try:
        result = fn()
    except grpc.RpcError as exc:
        return exc
    pytest.fail(f"call succeeded but should have been refused: {result!r}")


def assert_refused(fn: Callable[[], object], code: SC, *words: str) -> grpc.RpcError:
    exc = refused(fn)
    assert exc.code() == code, (exc.code(), exc.details())
    for word in words:
        assert word in (exc.details() or ""), (word, exc.details())
    return exc


def tamper_signature(token: str) -> str:
    """The token with one character in the middle of its signature changed."""
    prefix, payload, sig = token.split(".")
    i = len(sig) // 2
    swapped = "A" if sig[i] != "A" else "B"
    return f"{prefix}.{payload}.{sig[:i]}{swapped}{sig[i + 1 :]}"


class Snapshot:
    """What a refused call must leave alone."""

    def __init__(self, srv: RunningServer, lease_of: str | None = None) -> None:
        fed = srv.federation
        self.model = srv.model()
        self.state = srv.state()
        self.version = fed.version
        self.counters = dict(fed.counters)
        self.rejected = dict(fed.rejected_by_code)
        self.clients = sorted(fed.clients)
        self.lease = fed.clients[lease_of].lease_expires if lease_of else None
        self.lease_of = lease_of

    def check(self, srv: RunningServer, rejected_pushes: dict[str, int] | None = None) -> None:
        """Unchanged, except PushUpdate refusals counted as rejected updates under their code."""
        fed = srv.federation
        after = srv.model()
        assert torch.equal(after.view(torch.int32), self.model.view(torch.int32))
        assert_same_state(srv.state(), self.state)
        assert fed.version == self.version
        assert sorted(fed.clients) == self.clients
        if self.lease_of:
            assert fed.clients[self.lease_of].lease_expires == self.lease
        want = dict(self.counters)
        want_codes = dict(self.rejected)
        for code, n in (rejected_pushes or {}).items():
            if n:
                want["rejected"] = want.get("rejected", 0) + n
                want_codes[code] = want_codes.get(code, 0) + n
        assert {k: v for k, v in fed.counters.items() if v} == {k: v for k, v in want.items() if v}
        assert {k: v for k, v in fed.rejected_by_code.items() if v} == {
            k: v for k, v in want_codes.items() if v
        }


class Calls:
    """Raw calls on one plaintext channel, each with the credentials given per call."""

    def __init__(self, address: str, layout_source: Client) -> None:
        self.channel = grpc.insecure_channel(address)
        self.stub = pb_grpc.AggregationStub(self.channel)
        self.client = layout_source  # has the layout (registered)

    def close(self) -> None:
        self.channel.close()

    def register(self, token: str | None, client_id: str):
        layout = self.client.layout
        weights = torch.randn(layout.numel, generator=rng(2))
        msgs = register_messages(layout, client_id, {"weights": weights})
        return self.stub.Register(iter(msgs), metadata=bearer(token), timeout=CALL_S)

    def get_job(self, token: str | None, client_id: str):
        req = pb.GetJobRequest(
            client_id=client_id, layout_hash=self.client.layout.hash, dtype=tpb.WIRE_DTYPE_FLOAT32
        )
        return list(self.stub.GetJob(req, metadata=bearer(token), timeout=CALL_S))

    def push(self, token: str | None, client_id: str, job, delta, update_id: str):
        msgs = update_messages(self.client, job, delta, client_id=client_id, update_id=update_id)
        return self.stub.PushUpdate(iter(msgs), metadata=bearer(token), timeout=CALL_S)

    def heartbeat(self, token: str | None, client_id: str, job_id: str = ""):
        req = pb.HeartbeatRequest(client_id=client_id, job_id=job_id)
        return self.stub.Heartbeat(req, metadata=bearer(token), timeout=CALL_S)

    def status(self, token: str | None):
        return self.stub.GetStatus(pb.GetStatusRequest(), metadata=bearer(token), timeout=CALL_S)

    def model(self, token: str | None):
        req = pb.GetModelRequest(dtype=tpb.WIRE_DTYPE_FLOAT32)
        return list(self.stub.GetModel(req, metadata=bearer(token), timeout=CALL_S))

    def checkpoint(self, token: str | None):
        req = pb.CheckpointRequest()
        return self.stub.Checkpoint(req, metadata=bearer(token), timeout=CALL_S)

    def shutdown(self, token: str | None):
        req = pb.ShutdownRequest(grace_seconds=1.0)
        return self.stub.Shutdown(req, metadata=bearer(token), timeout=CALL_S)


def secret_file(tmp_path: Path) -> tuple[bytes, Path]:
    secret = A.new_secret()
    path = tmp_path / "auth" / "secret"
    A.save_secret(path, secret)
    return secret, path


def model_from(messages: list) -> tuple[int, int]:
    """(version, numel) from a GetModel stream."""
    header = messages[0].header
    return int(header.version), sum(int(t.numel) for t in header.tensors)


# ---------------------------------------------------------------------------------- 1. HMAC


def test_hmac_tokens_every_refusal_has_its_code_and_changes_nothing(tmp_path) -> None:
    secret, path = secret_file(tmp_path)
    with running(auth="hmac", auth_secret_file=str(path), rate_limit_per_second=0) as srv:
        admin = srv.server.admin_token
        assert admin and (path.parent / "admin.token").read_text().strip() == admin
        tok_a = A.issue_token(secret, "a", ttl_seconds=3600)  # a TTL token that is still valid
        tok_b = A.issue_token(secret, "b")
        model = random_model()
        x0 = flat(model)
        gen = rng(3)
        with Client(srv.address, "a", token=tok_a, retries=0, timeout=CALL_S) as a:
            assert a.register(model).initial_model_adopted
            job = a.get_job()
            first = a.push(job, torch.randn(x0.numel(), generator=gen), epochs=1.0, num_samples=2)
            assert first.status is Status.APPLIED and first.version == 1
            job2 = a.get_job()  # outstanding while the refusals run, pushed at the end
            delta2 = torch.randn(x0.numel(), generator=gen)
            calls = Calls(srv.address, a)
            try:
                before = Snapshot(srv, lease_of="a")
                fixed_id = uuid.uuid4().hex  # every refused push reuses the final push's id
                pushes = {"UNAUTHENTICATED": 0, "PERMISSION_DENIED": 0}

                # -- bad credentials: UNAUTHENTICATED on every call, operator calls included
                other_secret = A.issue_token(A.new_secret(), "a")
                expired = A.issue_token(secret, "a", ttl_seconds=60, now=time.time() - 3600)
                forged_payload = ".".join(
                    [*tok_a.split(".")[:2], tok_b.split(".")[2]]
                )  # a's payload with b's signature
                bad = {
                    "no token": (None, "missing credentials"),
                    "garbage": ("garbage-token-0123456789", "malformed token"),
                    "other secret": (other_secret, "invalid token signature"),
                    "signature char changed": (tamper_signature(tok_a), "signature"),
                    "payload swapped": (forged_payload, "invalid token signature"),
                    "expired": (expired, "expired"),
                }
                for name, (token, words) in bad.items():
                    for what, fn in {
                        "Register": lambda t=token: calls.register(t, "a"),
                        "GetJob": lambda t=token: calls.get_job(t, "a"),
                        "PushUpdate": lambda t=token: calls.push(t, "a", job2, delta2, fixed_id),
                        "Heartbeat": lambda t=token: calls.heartbeat(t, "a", job2.job_id),
                        "GetStatus": lambda t=token: calls.status(t),
                        "GetModel": lambda t=token: calls.model(t),
                        "Checkpoint": lambda t=token: calls.checkpoint(t),
                        "Shutdown": lambda t=token: calls.shutdown(t),
                    }.items():
                        exc = refused(fn)
                        assert exc.code() == SC.UNAUTHENTICATED, (name, what, exc.code())
                        assert words in exc.details(), (name, what, exc.details())
                        assert token is None or token not in exc.details()  # never echoed
                    pushes["UNAUTHENTICATED"] += 1
                before.check(srv, pushes)

                # -- valid token of client b acting as client a
                for fn in (
                    lambda: calls.register(tok_b, "a"),
                    lambda: calls.get_job(tok_b, "a"),
                    lambda: calls.push(tok_b, "a", job2, delta2, fixed_id),
                    lambda: calls.heartbeat(tok_b, "a", job2.job_id),
                ):
                    assert_refused(fn, SC.PERMISSION_DENIED, "'b'", "client 'a'")
                pushes["PERMISSION_DENIED"] += 1
                # -- client tokens on operator calls
                for token in (tok_a, tok_b):
                    assert_refused(
                        lambda t=token: calls.checkpoint(t), SC.PERMISSION_DENIED, "admin token"
                    )
                    assert_refused(
                        lambda t=token: calls.shutdown(t), SC.PERMISSION_DENIED, "admin token"
                    )
                assert not srv.server.stop_requested.is_set()
                # -- the admin token manages, it never trains
                assert_refused(
                    lambda: calls.push(admin, "a", job2, delta2, fixed_id),
                    SC.PERMISSION_DENIED,
                    "admin",
                )
                pushes["PERMISSION_DENIED"] += 1
                for fn in (
                    lambda: calls.get_job(admin, "a"),
                    lambda: calls.heartbeat(admin, "a"),
                    lambda: calls.register(admin, "a"),
                    lambda: calls.heartbeat(admin, A.ADMIN_SUBJECT),
                ):
                    assert_refused(fn, SC.PERMISSION_DENIED, "admin")
                before.check(srv, pushes)
                assert pushes == {"UNAUTHENTICATED": len(bad), "PERMISSION_DENIED": 2}

                # -- GetStatus and GetModel: any valid token (b is not even registered)
                for token in (tok_a, tok_b, admin):
                    status = calls.status(token)
                    assert status.version == 1 and status.auth == "hmac"
                    assert status.updates_rejected == sum(pushes.values())
                    assert model_from(calls.model(token)) == (1, x0.numel())
                before.check(srv, pushes)

                # -- health and reflection need no token
                health = health_pb2_grpc.HealthStub(calls.channel)
                for service in ("", SERVICE_NAME):
                    resp = health.Check(
                        health_pb2.HealthCheckRequest(service=service), timeout=CALL_S
                    )
                    assert resp.status == health_pb2.HealthCheckResponse.SERVING
                refl = reflection_pb2_grpc.ServerReflectionStub(calls.channel)
                answers = list(
                    refl.ServerReflectionInfo(
                        iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                        timeout=CALL_S,
                    )
                )
                names = {s.name for s in answers[0].list_services_response.service}
                assert {SERVICE_NAME, "grpc.health.v1.Health"} <= names, names
                before.check(srv, pushes)

                # The refusals left job2 outstanding and the update id unused: a's push of it,
                # with the id every refused push carried, is applied (not a duplicate).
                m = srv.model()
                resp = calls.push(tok_a, "a", job2, delta2, fixed_id)
                assert resp.outcome == pb.OUTCOME_APPLIED and resp.version == 2
                assert not torch.equal(srv.model(), m)
                hb = calls.heartbeat(tok_a, "a")
                assert hb.latest_version == 2
            finally:
                calls.close()
        metrics = srv.server.metrics.registry
        for code, want in (("UNAUTHENTICATED", 8 * len(bad)), ("PERMISSION_DENIED", 13)):
            got = metrics.get_sample_value("aggsrv_auth_failures_total", {"code": code})
            assert got == want, (code, got)


# ---------------------------------------------------------------------------- 2. tokens file


def test_tokens_file_valid_unknown_and_revoked_by_rewriting_the_file(tmp_path) -> None:
    tokens = {name: f"{name}-token-{uuid.uuid4().hex}" for name in ("a", "b", "admin")}
    path = tmp_path / "tokens.toml"
    A.write_tokens_file(path, {"a": tokens["a"], "b": tokens["b"]}, admin=[tokens["admin"]])
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    with running(auth="tokens", tokens_file=str(path)) as srv:
        model = random_model()
        gen = rng(4)
        with (
            Client(srv.address, "a", token=tokens["a"], retries=0, timeout=CALL_S) as a,
            Client(srv.address, "b", token=tokens["b"], retries=0, timeout=CALL_S) as b,
        ):
            assert a.register(model).initial_model_adopted
            b.register(model)
            job = a.get_job()
            res = a.push(job, torch.randn(a.layout.numel, generator=gen), epochs=1.0)
            assert res.status is Status.APPLIED and res.version == 1
            assert a.status().auth == "tokens"
            job = a.get_job()
            delta = torch.randn(a.layout.numel, generator=gen)
            calls = Calls(srv.address, a)
            try:
                before = Snapshot(srv, lease_of="a")
                unknown = "x" + tokens["a"][1:]
                for fn in (
                    lambda: calls.status(unknown),
                    lambda: calls.heartbeat(unknown, "a"),
                    lambda: calls.push(unknown, "a", job, delta, uuid.uuid4().hex),
                ):
                    assert_refused(fn, SC.UNAUTHENTICATED, "unknown token")
                assert_refused(lambda: calls.status(None), SC.UNAUTHENTICATED, "missing")
                assert_refused(
                    lambda: calls.push(tokens["b"], "a", job, delta, uuid.uuid4().hex),
                    SC.PERMISSION_DENIED,
                )
                assert_refused(lambda: calls.checkpoint(tokens["a"]), SC.PERMISSION_DENIED)
                # The [admin] token passes the role check (no state_dir: nowhere to write).
                assert_refused(
                    lambda: calls.checkpoint(tokens["admin"]),
                    SC.FAILED_PRECONDITION,
                    "state_dir",
                )
                assert calls.status(tokens["admin"]).version == 1
                before.check(srv, {"UNAUTHENTICATED": 1, "PERMISSION_DENIED": 1})

                # Revoke a: rewrite the file without it (mtime bumped as well).
                A.write_tokens_file(path, {"b": tokens["b"]}, admin=[tokens["admin"]])
                future = time.time() + 5
                os.utime(path, (future, future))
                time.sleep(1.1)  # the authenticator looks at the file at most once a second
                before = Snapshot(srv, lease_of="a")
                assert_refused(lambda: a.heartbeat(), SC.UNAUTHENTICATED, "unknown token")
                assert_refused(lambda: a.push(job, delta), SC.UNAUTHENTICATED, "unknown token")
                assert_refused(lambda: a.get_model(), SC.UNAUTHENTICATED)
                before.check(srv, {"UNAUTHENTICATED": 1})
                # b and the admin are unaffected.
                assert b.heartbeat().latest_version == 1
                assert calls.status(tokens["admin"]).version == 1
            finally:
                calls.close()


# ------------------------------------------------------------------------------------ 3. TLS


def test_tls_server_refuses_plaintext_and_untrusted_servers(tmp_path) -> None:
    pki = make_pki(tmp_path / "pki")
    with running(tls_cert=pki.path("server.pem"), tls_key=pki.path("server.key")) as srv:
        model = random_model()
        for host in ("localhost", "127.0.0.1"):  # the certificate names both
            with Client(f"{host}:{srv.port}", f"c-{host}", tls_ca=pki.path("ca.pem"),
                        retries=0, timeout=CALL_S) as c:  # fmt: skip
                c.register(model)
                version, got = c.get_model()
                assert version == 0 and torch.equal(got, flat(model))
        before = Snapshot(srv)
        with Client(srv.address, "plain", retries=0, timeout=CALL_S) as plain:
            assert_refused(plain.status, SC.UNAVAILABLE)
            assert_refused(lambda: plain.register(model), SC.UNAVAILABLE)
        # A client that trusts another CA does not accept the server's certificate.
        with Client(f"localhost:{srv.port}", "wrong-ca", tls_ca=pki.path("other-ca.pem"),
                    retries=0, timeout=CALL_S) as c:  # fmt: skip
            assert_refused(c.status, SC.UNAVAILABLE)
        before.check(srv)


def test_mutual_tls_needs_a_client_certificate_from_the_client_ca(tmp_path) -> None:
    pki = make_pki(tmp_path / "pki")
    with running(
        tls_cert=pki.path("server.pem"),
        tls_key=pki.path("server.key"),
        tls_client_ca=pki.path("ca.pem"),
    ) as srv:
        model = random_model()
        address = f"localhost:{srv.port}"
        with Client(address, "m1", tls_ca=pki.path("ca.pem"), tls_cert=pki.path("client.pem"),
                    tls_key=pki.path("client.key"), retries=0, timeout=CALL_S) as c:  # fmt: skip
            assert c.register(model).initial_model_adopted
            job = c.get_job()
            res = c.push(job, torch.randn(c.layout.numel, generator=rng(5)), epochs=1.0)
            assert res.status is Status.APPLIED and res.version == 1
        before = Snapshot(srv, lease_of="m1")
        with Client(address, "m1", tls_ca=pki.path("ca.pem"), retries=0, timeout=CALL_S) as c:
            assert_refused(c.status, SC.UNAVAILABLE)
            assert_refused(c.heartbeat, SC.UNAVAILABLE)
        with Client(address, "m1", tls_ca=pki.path("ca.pem"), tls_cert=pki.path("rogue.pem"),
                    tls_key=pki.path("rogue.key"), retries=0, timeout=CALL_S) as c:  # fmt: skip
            assert_refused(c.status, SC.UNAVAILABLE)
            assert_refused(c.heartbeat, SC.UNAVAILABLE)
        with Client(srv.address, "m1", retries=0, timeout=CALL_S) as c:  # plaintext
            assert_refused(c.status, SC.UNAVAILABLE)
        before.check(srv)


def test_tls_and_hmac_together(tmp_path) -> None:
    pki = make_pki(tmp_path / "pki")
    secret, path = secret_file(tmp_path)
    with running(
        tls_cert=pki.path("server.pem"),
        tls_key=pki.path("server.key"),
        auth="hmac",
        auth_secret_file=str(path),
    ) as srv:
        address = f"localhost:{srv.port}"
        ca = pki.path("ca.pem")
        tok = A.issue_token(secret, "t1")
        model = random_model()
        with Client(address, "t1", token=tok, tls_ca=ca, retries=0, timeout=CALL_S) as c:
            assert c.register(model).initial_model_adopted
            job = c.get_job()
            res = c.push(job, torch.randn(c.layout.numel, generator=rng(6)), epochs=1.0)
            assert res.status is Status.APPLIED and res.version == 1
            assert c.status().auth == "hmac"
            job = c.get_job()
        before = Snapshot(srv, lease_of="t1")
        delta = torch.randn(flat(model).numel(), generator=rng(7))
        with Client(address, "t1", tls_ca=ca, retries=0, timeout=CALL_S) as anon:
            anon.layout = c.layout
            assert_refused(anon.status, SC.UNAUTHENTICATED, "missing")
            assert_refused(lambda: anon.push(job, delta), SC.UNAUTHENTICATED, "missing")
        forged = A.issue_token(A.new_secret(), "t1")
        with Client(address, "t1", token=forged, tls_ca=ca, retries=0, timeout=CALL_S) as f:
            assert_refused(f.heartbeat, SC.UNAUTHENTICATED, "signature")
        tok_t2 = A.issue_token(secret, "t2")
        with Client(address, "t1", token=tok_t2, tls_ca=ca, retries=0, timeout=CALL_S) as o:
            o.layout = c.layout
            assert_refused(lambda: o.push(job, delta), SC.PERMISSION_DENIED, "'t2'")
            assert_refused(o.heartbeat, SC.PERMISSION_DENIED)
        # The right token over plaintext does not reach the TLS port.
        with Client(srv.address, "t1", token=tok, retries=0, timeout=CALL_S) as p:
            assert_refused(p.status, SC.UNAVAILABLE)
        before.check(srv, {"UNAUTHENTICATED": 1, "PERMISSION_DENIED": 1})


# ------------------------------------------------------------------------- 4. operator calls


def test_checkpoint_and_shutdown_with_the_admin_token(tmp_path) -> None:
    state = tmp_path / "state"
    with running(auth="hmac", state_dir=str(state), durability="on") as srv:
        admin = srv.server.admin_token
        secret_path = state / "auth" / "secret"
        assert srv.server.secret_path == secret_path
        assert (state / "auth" / "admin.token").read_text().strip() == admin
        tok = A.issue_token(A.load_secret(secret_path), "c1")
        calls = None
        with Client(srv.address, "c1", token=tok, retries=0, timeout=CALL_S) as c:
            calls = Calls(srv.address, c)
            try:
                # No model yet: nothing to checkpoint.
                assert_refused(lambda: calls.checkpoint(admin), SC.FAILED_PRECONDITION, "model")
                c.register(random_model())
                job = c.get_job()
                res = c.push(job, torch.randn(c.layout.numel, generator=rng(8)), epochs=1.0)
                assert res.status is Status.APPLIED and res.version == 1
                resp = calls.checkpoint(admin)
                assert resp.version == 1
                written = Path(resp.path)
                assert written.is_file() and written.parent == state
                assert resp.bytes == written.stat().st_size > 0
                payload = D.load_checkpoint(written)
                assert payload["state"]["version"] == 1
                assert torch.equal(payload["state"]["model"], srv.model())
                status = calls.status(admin)
                assert status.last_checkpoint_version == 1 and status.durability == "on"

                # A client token neither checkpoints nor stops the server.
                files = D.list_checkpoints(state)
                before = Snapshot(srv, lease_of="c1")
                assert_refused(lambda: calls.checkpoint(tok), SC.PERMISSION_DENIED)
                assert_refused(lambda: calls.shutdown(tok), SC.PERMISSION_DENIED)
                assert D.list_checkpoints(state) == files
                assert not srv.server.stop_requested.is_set()
                before.check(srv)

                # The admin token does: the answer names the version, then the stop is asked.
                assert calls.shutdown(admin).version == 1
                deadline = time.monotonic() + 5
                while not srv.server.stop_requested.is_set() and time.monotonic() < deadline:
                    time.sleep(0.01)
                assert srv.server.stop_requested.is_set()
                assert srv.server.stop_grace == 1.0
            finally:
                calls.close()


def test_the_admin_token_is_never_logged_but_kept_in_a_private_file(tmp_path, caplog) -> None:
    caplog.set_level(logging.DEBUG, logger="aggsrv")
    state = tmp_path / "state"
    with running(auth="hmac", state_dir=str(state), durability="on") as srv:
        admin = srv.server.admin_token
        assert (
            admin
            and A.HmacAuthenticator(A.load_secret(state / "auth" / "secret"))
            .authenticate(admin)
            .role
            == A.ROLE_ADMIN
        )
        with Client(srv.address, "c1", token=admin, retries=0, timeout=CALL_S) as c:
            assert c.status().auth == "hmac"  # the token works
    token_file = state / "auth" / "admin.token"
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    assert token_file.read_text() == admin + "\n"
    said = [r.getMessage() + " " + repr(r.args) + " " + repr(r.__dict__) for r in caplog.records]
    assert not [line for line in said if admin in line]
    assert any(str(token_file) in r.getMessage() for r in caplog.records), said


def test_the_admin_token_goes_to_the_terminal_once_and_never_elsewhere(tmp_path) -> None:
    import io

    from aggsrv.server.app import show_admin_token

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    where = tmp_path / "auth" / "admin.token"
    terminal, redirected = Terminal(), io.StringIO()
    show_admin_token("aggsrv1.tok.en", where, terminal)
    show_admin_token("aggsrv1.tok.en", where, redirected)
    assert terminal.getvalue().count("aggsrv1.tok.en") == 1 and str(where) in terminal.getvalue()
    # stderr redirected to a file is a log: the token stays in its private file only (the log
    # says where that is).
    assert redirected.getvalue() == ""


def test_checkpoint_without_state_dir_is_failed_precondition(tmp_path) -> None:
    _, path = secret_file(tmp_path)
    with running(auth="hmac", auth_secret_file=str(path)) as srv:
        admin = srv.server.admin_token
        with Client(srv.address, "c1", token=admin, retries=0, timeout=CALL_S) as c:
            assert_refused(
                lambda: c.admin_call("Checkpoint", pb.CheckpointRequest()),
                SC.FAILED_PRECONDITION,
                "state_dir",
            )
            assert c.status().durability == "off"


# ------------------------------------------------------------------------ 5. a real process


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cli(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "aggsrv.cli", *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
    )  # fmt: skip


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    """`aggsrv ARGS` through the CLI's main() in this process: (exit code, stdout, stderr)."""
    capsys.readouterr()
    rc = cli_main(list(args))
    out, err = capsys.readouterr()
    return rc, out, err


def finish(proc: subprocess.Popen, timeout: float = 60) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def wait_serving(proc: subprocess.Popen, address: str, log: Path, limit: float = 60.0) -> None:
    started = time.monotonic()
    with grpc.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() - started < limit:
            if proc.poll() is not None:
                raise AssertionError(f"serve exited with {proc.returncode}: {log.read_text()}")
            try:
                resp = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=0.5)
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.05)
    raise AssertionError(f"not SERVING after {limit} s: {log.read_text()}")


def test_serve_process_default_hmac_generated_secret_and_admin_cli(tmp_path, capsys) -> None:
    state = tmp_path / "state"
    port = free_port()
    address = f"127.0.0.1:{port}"
    log_path = tmp_path / "serve.log"
    serve_cmd = [sys.executable, "-m", "aggsrv.cli", "serve", "--host", "127.0.0.1"]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [*serve_cmd, "--port", str(port), "--state-dir", str(state)],
            stdout=subprocess.DEVNULL, stderr=log, cwd=REPO,
        )  # fmt: skip
    try:
        wait_serving(proc, address, log_path)
        secret_path = state / "auth" / "secret"
        admin_path = state / "auth" / "admin.token"
        for p in (secret_path, admin_path):
            assert stat.S_IMODE(p.stat().st_mode) == 0o600, p
        assert stat.S_IMODE((state / "auth").stat().st_mode) == 0o700
        admin = admin_path.read_text().strip()
        text = log_path.read_text()
        assert admin not in text and f"admin token written to {admin_path}" in text, text
        assert "no auth secret configured: generated one in" in text and str(secret_path) in text
        assert "auth hmac" in text and "tokens travel in plaintext" in text

        token = cli("token", "--secret-file", str(secret_path), "c1")
        rc, out, err = finish(token)
        assert rc == 0, err
        tok = out.strip()
        assert tok.startswith(A.TOKEN_PREFIX + ".") and "\n" not in tok
        model = random_model()
        gen = rng(9)
        with Client(address, "c1", token=tok, retries=0, timeout=PROC_CALL_S) as c:
            assert c.register(model).initial_model_adopted
            res = c.push(c.get_job(), torch.randn(c.layout.numel, generator=gen), epochs=1.0)
            assert res.status is Status.APPLIED and res.version == 1
        with Client(address, "c2", token=tok, retries=0, timeout=PROC_CALL_S) as other:
            assert_refused(other.heartbeat, SC.PERMISSION_DENIED)

        # The operator commands against the process; status and checkpoint run main() in this
        # process (the same code as `python -m aggsrv.cli`, without importing torch again),
        # shutdown below as a process of its own.
        conn = [address, "--timeout", str(PROC_CALL_S)]
        rc, out, err = run_cli(capsys, "status", *conn, "--token-file", str(admin_path))
        assert rc == 0, err
        assert "version 1" in out and "hmac" in out, out
        rc, out, err = run_cli(capsys, "checkpoint", *conn, "--token-file", str(admin_path))
        assert rc == 0, err
        assert "checkpoint of version 1" in out and str(state) in out, out
        rc, out, err = run_cli(capsys, "checkpoint", *conn, "--token", tok)
        assert rc == 1, (out, err)
        assert "PERMISSION_DENIED" in err, err
        rc, out, err = run_cli(capsys, "status", *conn)  # no token
        assert rc == 1 and "UNAUTHENTICATED" in err, (out, err)
        numbers = [n for n, _ in D.list_checkpoints(state)]

        # One more update after the requested checkpoint: the final one must hold it.
        with Client(address, "c1", token=tok, retries=0, timeout=PROC_CALL_S) as c:
            c.register(model)
            res = c.push(c.get_job(), torch.randn(c.layout.numel, generator=gen), epochs=1.0)
            assert res.status is Status.APPLIED and res.version == 2
            version, final_model = c.get_model()
            assert version == 2
        rc, out, err = finish(cli("shutdown", *conn, "--token-file", str(admin_path)))
        assert rc == 0, err
        assert "server stopping at version 2" in out, out
        assert proc.wait(timeout=60) == 0, log_path.read_text()
        text = log_path.read_text()
        assert "shutdown requested by an operator" in text and "aggsrv stopped" in text, text
        assert "Traceback" not in text, text
        newest_number, newest = D.latest_checkpoint(state)
        assert newest_number > max(numbers)
        payload = D.load_checkpoint(newest)
        assert payload["state"]["version"] == 2
        assert torch.equal(payload["state"]["model"], final_model)

        # The state dir now holds a run: starting on it without --resume is refused.
        port2 = free_port()
        again = subprocess.run(
            [*serve_cmd, "--port", str(port2), "--state-dir", str(state)],
            capture_output=True, text=True, timeout=60, cwd=REPO,
        )  # fmt: skip
        assert again.returncode == 2, (again.returncode, again.stderr)
        assert "--resume" in again.stderr, again.stderr
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
