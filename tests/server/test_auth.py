"""Bearer-token authentication (aggsrv.server.auth): signed tokens, tokens files, metadata."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import os
import secrets
import stat
import string

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aggsrv.server.auth import (
    ADMIN_SUBJECT,
    ID_PATTERN,
    ROLE_ADMIN,
    ROLE_CLIENT,
    TOKEN_PREFIX,
    AuthError,
    HmacAuthenticator,
    NoAuth,
    Principal,
    TokensFileAuthenticator,
    bearer_token,
    issue_token,
    load_secret,
    new_secret,
    save_secret,
    write_tokens_file,
)

SETTINGS = settings(max_examples=200, deadline=None)
ids = st.from_regex(ID_PATTERN, fullmatch=True)
B64_CHARS = string.ascii_letters + string.digits + "-_"


class FakeClock:
    def __init__(self, now: float = 1_700_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def sign(secret: bytes, payload: bytes) -> str:
    """A token over an arbitrary payload, signed the way the server signs."""
    payload_b64 = b64(payload)
    mac = hmac.new(secret, f"{TOKEN_PREFIX}.{payload_b64}".encode(), hashlib.sha256).digest()
    return f"{TOKEN_PREFIX}.{payload_b64}.{b64(mac)}"


# --- signed tokens -----------------------------------------------------------------------------


@SETTINGS
@given(subject=ids, role=st.sampled_from([ROLE_CLIENT, ROLE_ADMIN]))
def test_issued_token_verifies_to_its_principal(subject: str, role: str) -> None:
    auth = HmacAuthenticator(new_secret())
    principal = auth.authenticate(auth.issue(subject, role))
    assert principal == Principal(subject=subject, role=role, expires=None)
    assert principal.may_act_as(subject) is (role == ROLE_CLIENT)


def test_token_format_and_payload() -> None:
    secret = new_secret()
    token = issue_token(secret, "site-7@lab", ttl_seconds=600, now=1000.5)
    prefix, payload_b64, sig_b64 = token.split(".")
    assert prefix == TOKEN_PREFIX and "=" not in token
    payload = base64.urlsafe_b64decode(payload_b64 + "=" * (-len(payload_b64) % 4))
    assert json.loads(payload) == {"sub": "site-7@lab", "role": "client", "iat": 1000, "exp": 1600}
    assert token == sign(secret, payload)
    principal = HmacAuthenticator(secret, clock=FakeClock(1000)).authenticate(token)
    assert principal.expires == 1600.0


def test_principal_may_act_as() -> None:
    alice = Principal("alice", ROLE_CLIENT, None)
    assert alice.may_act_as("alice")
    assert not alice.may_act_as("bob")
    assert not alice.may_act_as("alice ")
    assert not Principal(ADMIN_SUBJECT, ROLE_ADMIN, None).may_act_as(ADMIN_SUBJECT)


@SETTINGS
@given(data=st.data())
def test_any_single_character_change_is_refused(data: st.DataObject) -> None:
    secret = new_secret()
    token = issue_token(secret, data.draw(ids), ttl_seconds=data.draw(st.none() | st.just(3600)))
    pos = data.draw(st.integers(0, len(token) - 1), label="position")
    repl = data.draw(
        st.sampled_from(B64_CHARS + ".=+/ ") | st.characters(), label="replacement"
    ).replace(token[pos], "")
    if not repl:
        repl = "A" if token[pos] != "A" else "B"
    forged = token[:pos] + repl + token[pos + 1 :]
    with pytest.raises(AuthError) as info:
        HmacAuthenticator(secret).authenticate(forged)
    assert info.value.code_name == "UNAUTHENTICATED"


def test_last_signature_character_has_no_alias() -> None:
    """43 base64 characters carry 258 bits for a 256-bit MAC: a lenient decoder would accept a
    different final character that decodes to the same bytes."""
    secret = new_secret()
    token = issue_token(secret, "alice")
    for c in B64_CHARS:
        if c != token[-1]:
            with pytest.raises(AuthError, match="signature"):
                HmacAuthenticator(secret).authenticate(token[:-1] + c)


def test_token_from_another_secret_is_refused() -> None:
    token = issue_token(new_secret(), "alice")
    with pytest.raises(AuthError, match="invalid token signature"):
        HmacAuthenticator(new_secret()).authenticate(token)


def test_payload_swapped_between_tokens_is_refused() -> None:
    secret = new_secret()
    alice = issue_token(secret, "alice").split(".")
    bob = issue_token(secret, "bob").split(".")
    with pytest.raises(AuthError, match="signature"):
        HmacAuthenticator(secret).authenticate(".".join([alice[0], bob[1], alice[2]]))


def test_expiry_with_leeway() -> None:
    secret = new_secret()
    clock = FakeClock(1000.0)
    auth = HmacAuthenticator(secret, clock=clock, leeway_seconds=30)
    token = auth.issue("alice", ttl_seconds=60)
    assert auth.authenticate(token).expires == 1060.0
    clock.now = 1060 + 29.9  # expired, but within the clock-skew leeway
    assert auth.authenticate(token).subject == "alice"
    clock.now = 1060 + 30.1
    with pytest.raises(AuthError, match="expired at 1970-01-01T00:17:40") as info:
        auth.authenticate(token)
    assert info.value.code_name == "UNAUTHENTICATED"
    clock.now = 10**9  # a token without expiry stays valid
    assert auth.authenticate(auth.issue("alice")).expires is None


def test_missing_token_names_the_header() -> None:
    with pytest.raises(AuthError, match="authorization: Bearer"):
        HmacAuthenticator(new_secret()).authenticate(None)


@pytest.mark.parametrize(
    ("token", "match"),
    [
        ("", "3 '.'-separated parts"),
        ("aggsrv1.abc", "3 '.'-separated parts"),
        ("aggsrv1.a.b.c", "3 '.'-separated parts"),
        ("aggsrv2.abc.def", "prefix"),
        ("aggsrv1.a+b.def", "payload is not base64url"),
        ("aggsrv1.abc.d=f", "signature is not base64url"),
        ("aggsrv1." + "a" * 5000, "too long"),
    ],
)
def test_malformed_tokens_say_what_is_wrong(token: str, match: str) -> None:
    with pytest.raises(AuthError, match=match):
        HmacAuthenticator(new_secret()).authenticate(token)


@pytest.mark.parametrize(
    ("payload", "match"),
    [
        (b"\xff\xfe", "not JSON"),
        (b"[1, 2]", "not a JSON object"),
        (b'{"sub": "a b", "role": "client", "iat": 1, "exp": null}', "'sub'"),
        (b'{"sub": 5, "role": "client", "iat": 1, "exp": null}', "'sub'"),
        (b'{"sub": "a", "role": "root", "iat": 1, "exp": null}', "'role'"),
        (b'{"sub": "a", "role": "client", "exp": null}', "'iat'"),
        (b'{"sub": "a", "role": "client", "iat": true, "exp": null}', "'iat'"),
        (b'{"sub": "a", "role": "client", "iat": 1, "exp": 1.5e12}', "'exp'"),
        (b'{"sub": "a", "role": "client", "iat": 1, "exp": NaN}', "'exp'"),
        (b'{"sub": "a", "role": "client", "iat": 1, "exp": -1' + b"0" * 400 + b"}", "expired"),
        (b"[" * 1200 + b"]" * 1200, "not JSON"),  # nested past the recursion limit,
    ],
)
def test_signed_but_bad_payloads_are_refused(payload: bytes, match: str) -> None:
    """Fields are checked even behind a valid signature (a secret shared with another tool)."""
    secret = new_secret()
    with pytest.raises(AuthError, match=match):
        HmacAuthenticator(secret).authenticate(sign(secret, payload))


def test_subject_pattern() -> None:
    secret = new_secret()
    for good in ["a", "client-1", "x" * 128, "org.site:gpu@host_2"]:
        assert HmacAuthenticator(secret).authenticate(issue_token(secret, good)).subject == good
    for bad in ["", "x" * 129, "a b", "a/b", "é", "a\n", "a,b"]:
        with pytest.raises(ValueError, match="invalid subject"):
            issue_token(secret, bad)
    with pytest.raises(ValueError, match="unknown role"):
        issue_token(secret, "alice", role="root")
    for ttl in [0, -1, float("inf"), float("nan")]:
        with pytest.raises(ValueError, match="ttl_seconds"):
            issue_token(secret, "alice", ttl_seconds=ttl)
    with pytest.raises(ValueError, match="at least 16 bytes"):
        HmacAuthenticator(b"short")


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=8,
)
payloads = st.fixed_dictionaries(
    {},
    optional={
        "sub": ids | json_values,
        "role": st.sampled_from([ROLE_CLIENT, ROLE_ADMIN]) | json_values,
        "iat": st.integers() | json_values,
        "exp": st.none() | st.integers() | json_values,
    },
).map(lambda d: json.dumps(d).encode())


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_any_string_is_a_valid_token_or_an_auth_error(data: st.DataObject) -> None:
    secret = new_secret()
    auth = HmacAuthenticator(secret, clock=FakeClock())
    parts = st.text(alphabet=B64_CHARS + "=+/.", max_size=60)
    candidate = data.draw(
        st.one_of(
            st.text(),
            st.builds(lambda a, b: f"{TOKEN_PREFIX}.{a}.{b}", parts, parts),
            (
                payloads
                | st.binary(max_size=64)
                | json_values.map(lambda v: json.dumps(v).encode())
            ).map(lambda p: sign(secret, p)),
        )
    )
    try:
        principal = auth.authenticate(candidate)
    except AuthError as exc:
        assert exc.code_name == "UNAUTHENTICATED"
        return
    assert isinstance(principal, Principal)
    assert ID_PATTERN.fullmatch(principal.subject)
    assert principal.role in (ROLE_CLIENT, ROLE_ADMIN)


# --- metadata ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("metadata", "expected"),
    [
        ([("authorization", "Bearer abc.def")], "abc.def"),
        ([("authorization", "bearer abc")], "abc"),
        ([("Authorization", "BEARER   abc  ")], "abc"),
        ([("authorization", b"Bearer abc")], "abc"),
        ([("x-other", "v"), ("authorization", "Bearer t"), ("user-agent", "g")], "t"),
        ([], None),
        (None, None),
        ([("x-authorization", "Bearer t")], None),
    ],
)
def test_bearer_token(metadata, expected: str | None) -> None:
    assert bearer_token(metadata) == expected


@pytest.mark.parametrize(
    ("metadata", "match"),
    [
        ([("authorization", "Basic dXNlcjpwYXNz")], "Bearer"),
        ([("authorization", "abc")], "Bearer"),
        ([("authorization", "Bearer")], "empty"),
        ([("authorization", "Bearer   ")], "empty"),
        ([("authorization", "Bearer a b")], "spaces"),
        ([("authorization", b"Bearer \xff")], "ASCII"),
        ([("authorization", "Bearer a"), ("authorization", "Bearer a")], "several"),
    ],
)
def test_bearer_token_malformed(metadata, match: str) -> None:
    with pytest.raises(AuthError, match=match) as info:
        bearer_token(metadata)
    assert info.value.code_name == "UNAUTHENTICATED"


@SETTINGS
@given(st.lists(st.tuples(st.sampled_from(["authorization", "x"]), st.text() | st.binary())))
def test_bearer_token_never_raises_anything_else(metadata) -> None:
    try:
        token = bearer_token(metadata)
    except AuthError:
        return
    assert token is None or (token and " " not in token)


def test_no_auth() -> None:
    auth = NoAuth()
    assert auth.mode == "none"
    assert auth.authenticate(None) is None and auth.authenticate("anything") is None
    assert HmacAuthenticator(new_secret()).mode == "hmac"


def test_auth_error_code() -> None:
    assert AuthError("x").code_name == "UNAUTHENTICATED"
    assert AuthError("x", "PERMISSION_DENIED").code_name == "PERMISSION_DENIED"


# --- secrets files -----------------------------------------------------------------------------


def test_save_and_load_secret(tmp_path, caplog) -> None:
    secret = new_secret()
    assert len(secret) == 32 and secret != new_secret()
    path = tmp_path / "new" / "dir" / "secret.hex"
    save_secret(path, secret)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE(path.parent.parent.stat().st_mode) == 0o700
    assert path.read_text() == secret.hex() + "\n"
    assert [p.name for p in path.parent.iterdir()] == ["secret.hex"]  # no temp file left
    with caplog.at_level(logging.WARNING, logger="aggsrv.server.auth"):
        assert load_secret(path) == secret
    assert not caplog.records
    save_secret(path, b"\x01" * 16)  # overwrites, still private
    assert load_secret(path) == b"\x01" * 16
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_load_secret_warns_when_readable_by_others(tmp_path, caplog) -> None:
    path = tmp_path / "secret"
    path.write_text(secrets.token_hex(32))
    path.chmod(0o644)
    with caplog.at_level(logging.WARNING, logger="aggsrv.server.auth"):
        load_secret(path)
    assert "chmod 600" in caplog.text


@pytest.mark.parametrize(
    "content",
    [b"", b"not hex at all\n", b"abcd\n", secrets.token_bytes(64), b"\xff" * 40, b"00" * 15],
    # Named by kind, not by the random bytes: the test ids stay the same from one collection to
    # the next (pytest-xdist's workers must collect the same tests).
    ids=["empty", "not-hex", "short-hex", "random-bytes", "non-ascii", "too-short"],
)
def test_load_secret_refuses_garbage(tmp_path, content: bytes) -> None:
    path = tmp_path / "secret"
    path.write_bytes(content)
    path.chmod(0o600)
    with pytest.raises(ValueError, match="secret"):
        load_secret(path)


def test_load_secret_missing_file(tmp_path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        load_secret(tmp_path / "nope")


def test_save_secret_refuses_short(tmp_path) -> None:
    with pytest.raises(ValueError, match="at least 16"):
        save_secret(tmp_path / "s", b"abc")


# --- tokens files ------------------------------------------------------------------------------


def tok() -> str:
    return secrets.token_urlsafe(24)


def test_tokens_file_roundtrip(tmp_path) -> None:
    alice, bob1, bob2, odd, adm = tok(), tok(), tok(), tok(), tok()
    path = tmp_path / "tokens.toml"
    write_tokens_file(path, {"alice": alice, "bob": [bob1, bob2], "org.x:y@z": odd}, [adm])
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    auth = TokensFileAuthenticator(path, clock=FakeClock())
    assert auth.mode == "tokens"
    assert auth.authenticate(alice) == Principal("alice", ROLE_CLIENT, None)
    assert auth.authenticate(bob1).subject == auth.authenticate(bob2).subject == "bob"
    assert auth.authenticate(odd).subject == "org.x:y@z"
    assert auth.authenticate(adm) == Principal(ADMIN_SUBJECT, ROLE_ADMIN, None)
    for unknown in [tok(), alice[:-1], alice + "x", ""]:
        with pytest.raises(AuthError, match="unknown token"):
            auth.authenticate(unknown)
    with pytest.raises(AuthError, match="authorization: Bearer"):
        auth.authenticate(None)
    # Only hashes are kept in memory.
    assert alice not in repr(vars(auth))


def test_tokens_file_hand_written(tmp_path) -> None:
    path = tmp_path / "tokens.toml"
    path.write_text(
        '[clients]\nalice = "alice-token-0123456789"\nbob = ["bob-token-0123456789"]\n'
        '\n[admin]\ntokens = ["admin-token-0123456789"]\n'
    )
    auth = TokensFileAuthenticator(path)
    assert auth.authenticate("alice-token-0123456789").subject == "alice"
    assert auth.authenticate("bob-token-0123456789").subject == "bob"
    assert auth.authenticate("admin-token-0123456789").role == ROLE_ADMIN
    path.write_text('[clients]\nalice = "alice-token-0123456789"\n')  # [admin] is optional
    assert TokensFileAuthenticator(path).authenticate("alice-token-0123456789").subject == "alice"


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ('[clients]\na = "same-token-0123456789"\nb = "same-token-0123456789"\n', "unique"),
        (
            '[clients]\na = "same-token-0123456789"\n[admin]\ntokens=["same-token-0123456789"]\n',
            "unique",
        ),
        ('[clients]\na = ["ok-token-0123456789", "ok-token-0123456789"]\n', "unique"),
        ('[clients]\na = "short"\n', "shorter than 16"),
        ('[clients]\n"a b" = "long-enough-token-123"\n', "invalid client id"),
        ('[clients]\na = "has space in token 123"\n', "printable ASCII"),
        ("[clients]\na = 12345678901234567890\n", "token string"),
        ('[client]\na = "long-enough-token-123"\n', "unknown table"),
        ('[admin]\ntoken = ["long-enough-token-123"]\n', r"\[admin\]"),
        ("[clients\n", "not valid TOML"),
    ],
)
def test_tokens_file_errors(tmp_path, content: str, match: str) -> None:
    path = tmp_path / "tokens.toml"
    path.write_text(content)
    with pytest.raises(ValueError, match=match) as info:
        TokensFileAuthenticator(path)
    assert "0123456789" not in str(info.value)  # tokens never appear in messages


def test_write_tokens_file_validates(tmp_path) -> None:
    with pytest.raises(ValueError, match="unique"):
        write_tokens_file(tmp_path / "t", {"a": "x" * 20, "b": "x" * 20}, [])
    with pytest.raises(ValueError, match="shorter"):
        write_tokens_file(tmp_path / "t", {"a": "x"}, [])
    assert not (tmp_path / "t").exists()


def bump_mtime(path, seconds: int = 10) -> None:
    st_ = path.stat()
    os.utime(path, ns=(st_.st_atime_ns, st_.st_mtime_ns + seconds * 10**9))


def test_tokens_file_reloads_on_change(tmp_path) -> None:
    old, new = tok(), tok()
    path = tmp_path / "tokens.toml"
    write_tokens_file(path, {"alice": old}, [])
    clock = FakeClock()
    auth = TokensFileAuthenticator(path, clock=clock)
    assert auth.authenticate(old).subject == "alice"

    # Rewrite in place (same inode), same length, then make sure the mtime moved.
    path.write_text(path.read_text().replace(old, new))
    bump_mtime(path)
    clock.now += 0.5  # checked at most once a second
    assert auth.authenticate(old).subject == "alice"
    clock.now += 0.6
    assert auth.authenticate(new).subject == "alice"
    with pytest.raises(AuthError, match="unknown token"):
        auth.authenticate(old)  # revoked without a restart

    # An atomic replace by write_tokens_file is picked up too.
    third = tok()
    write_tokens_file(path, {"bob": third}, [])
    bump_mtime(path, 20)
    clock.now += 1.1
    assert auth.authenticate(third).subject == "bob"


def test_tokens_file_failed_reload_keeps_old_tokens(tmp_path, caplog) -> None:
    good = tok()
    path = tmp_path / "tokens.toml"
    write_tokens_file(path, {"alice": good}, [])
    clock = FakeClock()
    auth = TokensFileAuthenticator(path, clock=clock)

    path.write_text('[clients]\nalice = "short"\n')
    bump_mtime(path)
    clock.now += 2
    with caplog.at_level(logging.ERROR, logger="aggsrv.server.auth"):
        assert auth.authenticate(good).subject == "alice"
        clock.now += 2
        assert auth.authenticate(good).subject == "alice"
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "keeping previous tokens" in errors[0].getMessage()

    path.unlink()  # a missing file also keeps the old tokens
    clock.now += 2
    assert auth.authenticate(good).subject == "alice"

    fixed = tok()
    write_tokens_file(path, {"carol": fixed}, [])
    clock.now += 2
    assert auth.authenticate(fixed).subject == "carol"
    with pytest.raises(AuthError):
        auth.authenticate(good)
