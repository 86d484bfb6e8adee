"""Bearer-token authentication for the aggregation server.

Clients send ``authorization: Bearer <token>`` in their gRPC call metadata. Tokens come from one
of two sources:

* HMAC-signed tokens (:class:`HmacAuthenticator`): the server holds a secret and anyone holding
  it can mint tokens offline (``aggsrv token``); the client id travels inside the token, so the
  server needs no per-client state and tokens expire on their own.
* A tokens file (:class:`TokensFileAuthenticator`): an operator-maintained TOML file mapping
  client ids to opaque tokens, reloaded when it changes so a token can be revoked without a
  restart.

Either way authentication yields a :class:`Principal`; the server then checks on every call that
the principal may act as the client id the request names, so one client cannot upload or fetch
as another. This module is pure Python (no grpc import) so it can be tested and reused alone.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import logging
import math
import os
import re
import secrets
import stat
import threading
import time
import tomllib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

__all__ = [
    "ADMIN_SUBJECT",
    "ID_PATTERN",
    "ROLES",
    "ROLE_ADMIN",
    "ROLE_CLIENT",
    "TOKEN_PREFIX",
    "AuthError",
    "Authenticator",
    "HmacAuthenticator",
    "NoAuth",
    "Principal",
    "TokensFileAuthenticator",
    "bearer_token",
    "issue_token",
    "load_secret",
    "new_secret",
    "save_secret",
    "write_private_file",
    "write_tokens_file",
]

log = logging.getLogger(__name__)

ROLE_CLIENT = "client"
ROLE_ADMIN = "admin"
ROLES = (ROLE_CLIENT, ROLE_ADMIN)
ADMIN_SUBJECT = "admin"
# Ids end up in log lines, metrics labels and file names: a small safe alphabet, bounded length.
ID_PATTERN = re.compile(r"[A-Za-z0-9._:@-]{1,128}")
TOKEN_PREFIX = "aggsrv1"

SECRET_BYTES = 32
MIN_SECRET_BYTES = 16
MIN_TOKEN_CHARS = 16
# Far above any token we issue (~200 characters); refusing longer input before decoding bounds
# the work an unauthenticated caller can make us do.
MAX_TOKEN_CHARS = 4096
# Tokens travel as HTTP/2 header values, which gRPC limits to printable ASCII; no spaces so the
# "Bearer <token>" header splits unambiguously.
_TOKEN_CHARS = re.compile(r"[\x21-\x7e]+")
_B64URL = re.compile(r"[A-Za-z0-9_-]*")
_RELOAD_CHECK_SECONDS = 1.0


@dataclass(frozen=True)
class Principal:
    """Who a verified token speaks for."""

    subject: str  # the client id, or ADMIN_SUBJECT for tokens-file admin tokens
    role: str  # ROLE_CLIENT or ROLE_ADMIN
    expires: float | None  # unix time; None: never

    def may_act_as(self, client_id: str) -> bool:
        """True if requests naming ``client_id`` are allowed; admins manage, they never train."""
        return self.role == ROLE_CLIENT and hmac.compare_digest(
            self.subject.encode(), client_id.encode()
        )


class AuthError(Exception):
    """Authentication or authorization failure; ``code_name`` is the gRPC status code to send.

    ``code_name`` is "UNAUTHENTICATED" (missing, malformed, forged, expired or unknown token) or
    "PERMISSION_DENIED" (a valid token that may not do what was asked). Messages never include
    the token itself, since they are logged and returned to the caller.
    """

    def __init__(self, message: str, code_name: str = "UNAUTHENTICATED") -> None:
        super().__init__(message)
        self.code_name = code_name


# --- secrets -----------------------------------------------------------------------------------


def new_secret() -> bytes:
    """A fresh random HMAC secret (32 bytes)."""
    return secrets.token_bytes(SECRET_BYTES)


def write_private_file(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` atomically with mode 0o600, so a crash never leaves a half-written file
    and the content is never readable by others, not even for a moment."""
    path = Path(path)
    # Every directory we create is private (mkdir(parents=True) would give ancestors 0o777).
    for parent in reversed([d for d in path.parents if not d.exists()]):
        parent.mkdir(mode=0o700, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def save_secret(path: str | os.PathLike[str], secret: bytes) -> None:
    """Store ``secret`` as hex text (mode 0o600, written atomically; parent dirs made 0o700)."""
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"secret must be at least {MIN_SECRET_BYTES} bytes, got {len(secret)}")
    write_private_file(path, secret.hex() + "\n")


def load_secret(path: str | os.PathLike[str]) -> bytes:
    """Read a secret written by :func:`save_secret`: hex text of at least 16 bytes.

    Only hex is accepted (not raw bytes) so that a wrong file, e.g. a TLS key or a tokens file,
    is refused instead of silently becoming the secret.
    """
    path = Path(path)
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise ValueError(f"secret file {path} does not exist") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning(
            "secret file %s is readable by group or others (mode %o); chmod 600 it",
            path,
            stat.S_IMODE(mode),
        )
    raw = path.read_bytes()
    try:
        secret = bytes.fromhex(raw.decode("ascii").strip())
    except (UnicodeDecodeError, ValueError):
        raise ValueError(
            f"secret file {path} must hold the secret as hex text of at least "
            f"{MIN_SECRET_BYTES} bytes (as save_secret writes it)"
        ) from None
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(
            f"secret in {path} is {len(secret)} bytes; at least {MIN_SECRET_BYTES} are required"
        )
    return secret


# --- signed tokens -----------------------------------------------------------------------------


def _b64encode(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _b64decode(text: str, what: str) -> bytes:
    """Strict unpadded base64url: the stdlib decoder silently skips foreign characters, and only
    the canonical encoding is accepted so one byte string has exactly one spelling."""
    if not _B64URL.fullmatch(text) or len(text) % 4 == 1:
        raise AuthError(f"malformed token: {what} is not base64url")
    try:
        data = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (binascii.Error, ValueError):
        raise AuthError(f"malformed token: {what} is not base64url") from None
    if _b64encode(data) != text:
        raise AuthError(f"malformed token: {what} is not canonical base64url")
    return data


def _signature(secret: bytes, payload_b64: str) -> str:
    mac = hmac.new(secret, f"{TOKEN_PREFIX}.{payload_b64}".encode("ascii"), hashlib.sha256)
    return _b64encode(mac.digest())


def _check_subject_role(subject: str, role: str) -> None:
    if not isinstance(subject, str) or not ID_PATTERN.fullmatch(subject):
        raise ValueError(
            f"invalid subject {subject!r}: ids are 1-128 characters of A-Z a-z 0-9 . _ : @ -"
        )
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; known roles: {', '.join(ROLES)}")


def issue_token(
    secret: bytes,
    subject: str,
    role: str = ROLE_CLIENT,
    ttl_seconds: float | None = None,
    now: float | None = None,
) -> str:
    """Mint a signed token for ``subject``; ``ttl_seconds`` None means it never expires.

    Format: ``aggsrv1.<b64url(JSON payload)>.<b64url(HMAC-SHA256(secret, "aggsrv1." + payload))>``
    with the payload ``{"sub", "role", "iat", "exp"}`` (unix seconds; exp null if no expiry).
    """
    _check_subject_role(subject, role)
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"secret must be at least {MIN_SECRET_BYTES} bytes")
    if ttl_seconds is not None and not (math.isfinite(ttl_seconds) and ttl_seconds > 0):
        raise ValueError(f"ttl_seconds must be a positive number or None, got {ttl_seconds!r}")
    now = time.time() if now is None else now
    exp = None if ttl_seconds is None else int(now + ttl_seconds)
    payload = json.dumps(
        {"sub": subject, "role": role, "iat": int(now), "exp": exp}, separators=(",", ":")
    )
    payload_b64 = _b64encode(payload.encode("utf-8"))
    return f"{TOKEN_PREFIX}.{payload_b64}.{_signature(secret, payload_b64)}"


def _iso(ts: float) -> str:
    try:
        return datetime.fromtimestamp(ts, tz=UTC).isoformat()
    except (OverflowError, OSError, ValueError):
        return f"unix time {ts}"


def _is_int(value: Any) -> bool:
    # bool is an int subclass; JSON true must not pass as a timestamp.
    return isinstance(value, int) and not isinstance(value, bool)


# --- metadata ----------------------------------------------------------------------------------


def bearer_token(metadata: Iterable[tuple[str | bytes, str | bytes]] | None) -> str | None:
    """The token from ``authorization: Bearer <token>`` call metadata, or None if there is none.

    A header that is present but unusable raises AuthError rather than returning None, so a
    client with a broken header hears what is wrong instead of "missing credentials".
    """
    values = []
    for key, value in metadata or ():
        if isinstance(key, bytes):
            key = key.decode("latin-1")
        if key.lower() == "authorization":
            values.append(value)
    if not values:
        return None
    if len(values) > 1:
        raise AuthError("malformed credentials: several 'authorization' metadata entries")
    value = values[0]
    if isinstance(value, bytes):
        try:
            value = value.decode("ascii")
        except UnicodeDecodeError:
            raise AuthError("malformed credentials: 'authorization' is not ASCII") from None
    scheme, _, token = value.strip().partition(" ")
    if scheme.lower() != "bearer":
        raise AuthError("malformed credentials: expected 'authorization: Bearer <token>'")
    token = token.strip()
    if not token:
        raise AuthError("malformed credentials: empty bearer token")
    if not _TOKEN_CHARS.fullmatch(token):
        raise AuthError("malformed credentials: bearer token contains spaces or non-ASCII")
    return token


# --- authenticators ----------------------------------------------------------------------------

_MISSING = (
    "missing credentials: send 'authorization: Bearer <token>' metadata "
    "(the server was started with authentication on)"
)


class Authenticator(Protocol):
    """Turns a bearer token (None if the call carried none) into a Principal."""

    mode: str

    def authenticate(self, token: str | None) -> Principal | None: ...


class NoAuth:
    """Authentication off: every call is accepted and no identity is checked."""

    mode = "none"

    def authenticate(self, token: str | None) -> None:
        """Always None: there is no principal to check requests against."""
        return None


class HmacAuthenticator:
    """Verifies tokens minted by :func:`issue_token` with the same secret."""

    mode = "hmac"

    def __init__(
        self,
        secret: bytes,
        clock: Callable[[], float] = time.time,
        leeway_seconds: float = 30.0,
    ) -> None:
        if len(secret) < MIN_SECRET_BYTES:
            raise ValueError(f"secret must be at least {MIN_SECRET_BYTES} bytes")
        self._secret = bytes(secret)
        self._clock = clock
        # Tolerates clock skew between the machine that minted a token and this one.
        self.leeway_seconds = leeway_seconds

    def issue(self, subject: str, role: str = ROLE_CLIENT, ttl_seconds: float | None = None) -> str:
        """A token for ``subject`` signed with this authenticator's secret and clock."""
        return issue_token(self._secret, subject, role, ttl_seconds, now=self._clock())

    def authenticate(self, token: str | None) -> Principal:
        """The Principal a token speaks for; AuthError if it is missing, forged or expired."""
        if token is None:
            raise AuthError(_MISSING)
        if not isinstance(token, str):
            raise AuthError("malformed token: not a string")
        if len(token) > MAX_TOKEN_CHARS:
            raise AuthError(f"malformed token: too long (over {MAX_TOKEN_CHARS} characters)")
        parts = token.split(".")
        if len(parts) != 3:
            raise AuthError(f"malformed token: expected 3 '.'-separated parts, got {len(parts)}")
        prefix, payload_b64, sig_b64 = parts
        if prefix != TOKEN_PREFIX:
            raise AuthError(f"malformed token: expected prefix {TOKEN_PREFIX!r}")
        if not _B64URL.fullmatch(payload_b64):
            raise AuthError("malformed token: payload is not base64url")
        if not _B64URL.fullmatch(sig_b64):
            raise AuthError("malformed token: signature is not base64url")
        # Verify before parsing so unauthenticated input never reaches the JSON parser. Comparing
        # the encoded text rejects every other spelling of the same signature bytes too.
        expected = _signature(self._secret, payload_b64)
        if not hmac.compare_digest(expected.encode("ascii"), sig_b64.encode("ascii")):
            raise AuthError("invalid token signature")
        return self._principal(_b64decode(payload_b64, "payload"))

    def _principal(self, payload_bytes: bytes) -> Principal:
        try:
            payload = json.loads(payload_bytes)
        except (ValueError, RecursionError):
            raise AuthError("malformed token: payload is not JSON") from None
        if not isinstance(payload, dict):
            raise AuthError("malformed token: payload is not a JSON object")
        subject, role = payload.get("sub"), payload.get("role")
        exp, iat = payload.get("exp"), payload.get("iat")
        if not isinstance(subject, str) or not ID_PATTERN.fullmatch(subject):
            raise AuthError("malformed token: 'sub' is not a valid id")
        if role not in ROLES:
            raise AuthError("malformed token: unknown 'role'")
        if not _is_int(iat):
            raise AuthError("malformed token: 'iat' is not an integer")
        if exp is not None and not _is_int(exp):
            raise AuthError("malformed token: 'exp' is not an integer or null")
        if exp is not None and exp < self._clock() - self.leeway_seconds:
            raise AuthError(f"token expired at {_iso(exp)}")
        return Principal(subject=subject, role=role, expires=None if exp is None else float(exp))


def _token_hash(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8")).digest()


def _parse_tokens(data: Mapping[str, Any], source: str) -> dict[bytes, Principal]:
    """Token hash -> Principal from a parsed tokens document; ValueError naming the problem."""
    unknown = sorted(set(data) - {"clients", "admin"})
    if unknown:
        raise ValueError(f"{source}: unknown table(s) {', '.join(unknown)}; expected [clients]")
    clients = data.get("clients", {})
    admin = data.get("admin", {})
    if not isinstance(clients, Mapping):
        raise ValueError(f"{source}: [clients] must be a table of id = token(s)")
    if not isinstance(admin, Mapping) or set(admin) - {"tokens"}:
        raise ValueError(f"{source}: [admin] must hold only tokens = [...]")
    entries: list[tuple[str, str, Any]] = [(ADMIN_SUBJECT, ROLE_ADMIN, admin.get("tokens", []))]
    entries += [(cid, ROLE_CLIENT, toks) for cid, toks in clients.items()]
    result: dict[bytes, Principal] = {}
    for subject, role, tokens in entries:
        where = "[admin] tokens" if role == ROLE_ADMIN else f"client {subject!r}"
        if role == ROLE_CLIENT and not ID_PATTERN.fullmatch(subject):
            raise ValueError(
                f"{source}: invalid client id {subject!r}: ids are 1-128 characters of "
                "A-Z a-z 0-9 . _ : @ -"
            )
        if isinstance(tokens, str):
            tokens = [tokens]
        if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
            raise ValueError(f"{source}: {where}: expected a token string or a list of them")
        for i, token in enumerate(tokens):
            # Positions, not the tokens, go into messages: these end up in logs.
            if len(token) < MIN_TOKEN_CHARS:
                raise ValueError(
                    f"{source}: {where}: token #{i + 1} is shorter than {MIN_TOKEN_CHARS} "
                    "characters (e.g. python -c 'import secrets; print(secrets.token_urlsafe())')"
                )
            if not _TOKEN_CHARS.fullmatch(token):
                raise ValueError(
                    f"{source}: {where}: token #{i + 1} must be printable ASCII without spaces"
                )
            digest = _token_hash(token)
            previous = result.get(digest)
            if previous is not None:
                raise ValueError(
                    f"{source}: {where}: token #{i + 1} is also given to {previous.subject!r} "
                    f"({previous.role}); every token must be unique"
                )
            result[digest] = Principal(subject=subject, role=role, expires=None)
    return result


def _load_tokens(path: Path) -> dict[bytes, tuple[bytes, Principal]]:
    """Token hash -> (the same hash, Principal) from a tokens file."""
    with open(path, "rb") as fh:
        try:
            data = tomllib.load(fh)
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"{path}: not valid TOML: {exc}") from None
    return {digest: (digest, p) for digest, p in _parse_tokens(data, str(path)).items()}


class TokensFileAuthenticator:
    """Accepts the tokens listed in a TOML file, reloaded when the file changes.

    File format::

        [clients]
        alice = "a-token-of-16-or-more-characters"
        "bob@site-2" = ["first-token-for-bob..", "second-token-for-bob."]  # rotation

        [admin]
        tokens = ["an-admin-token-of-16+-chars"]

    Client ids must match :data:`ID_PATTERN` (quote keys holding ``.``, ``:`` or ``@``); tokens
    are printable ASCII without spaces, at least 16 characters, and unique across the file.
    Admin tokens authenticate as subject :data:`ADMIN_SUBJECT` with role admin.

    Only SHA-256 hashes of the tokens are kept. The file's mtime/size/inode is checked at most
    once a second and the file reloaded when it changed, so an operator revokes a token by
    editing the file; a reload that fails keeps the previous tokens and logs an error, so a typo
    never locks every client out. A file that fails to load at start-up raises ValueError.
    """

    mode = "tokens"

    def __init__(
        self, path: str | os.PathLike[str], clock: Callable[[], float] = time.time
    ) -> None:
        self.path = Path(path)
        self._clock = clock
        self._lock = threading.Lock()
        self._stamp = self._file_stamp()
        self._tokens = _load_tokens(self.path)
        self._checked_at = clock()
        log.info("loaded %d token(s) from %s", len(self._tokens), self.path)

    def _file_stamp(self) -> tuple[int, int, int]:
        st = os.stat(self.path)
        # Size and inode catch rewrites within the filesystem's timestamp granularity and
        # atomic replaces.
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def _maybe_reload(self) -> None:
        now = self._clock()
        if now - self._checked_at < _RELOAD_CHECK_SECONDS:
            return
        with self._lock:
            if now - self._checked_at < _RELOAD_CHECK_SECONDS:
                return
            self._checked_at = now
            try:
                stamp = self._file_stamp()
            except OSError as exc:
                if self._stamp is not None:
                    log.error("tokens file unreadable, keeping previous tokens: %s", exc)
                self._stamp = None
                return
            if stamp == self._stamp:
                return
            # Remember the stamp even if loading fails: the error is logged once per change.
            self._stamp = stamp
            try:
                tokens = _load_tokens(self.path)
            except (OSError, ValueError) as exc:
                log.error("reloading tokens file failed, keeping previous tokens: %s", exc)
                return
            self._tokens = tokens
            log.info("reloaded %d token(s) from %s", len(tokens), self.path)

    def authenticate(self, token: str | None) -> Principal:
        """The Principal the file lists for ``token``; AuthError if missing or unknown."""
        if token is None:
            raise AuthError(_MISSING)
        if not isinstance(token, str) or len(token) > MAX_TOKEN_CHARS:
            raise AuthError("unknown token")
        self._maybe_reload()
        digest = _token_hash(token)
        # Keys are hashes, so the dict's own comparison leaks nothing useful about any token; the
        # constant-time compare against the stored hash keeps the final decision free of
        # early-exit byte comparisons all the same.
        entry = self._tokens.get(digest)
        if entry is None or not hmac.compare_digest(entry[0], digest):
            raise AuthError("unknown token")
        return entry[1]


def _toml_str(text: str) -> str:
    # JSON string escapes are valid TOML basic-string escapes for the ASCII we allow.
    return json.dumps(text, ensure_ascii=True)


def write_tokens_file(
    path: str | os.PathLike[str],
    clients: Mapping[str, str | list[str]],
    admin: list[str],
) -> None:
    """Write a tokens file for :class:`TokensFileAuthenticator` (mode 0o600, atomic).

    The content is validated first (same rules as loading), so a file this writes always loads.
    """
    _parse_tokens({"clients": dict(clients), "admin": {"tokens": list(admin)}}, str(path))
    lines = ["[clients]"]
    for cid, tokens in clients.items():
        value = (
            _toml_str(tokens)
            if isinstance(tokens, str)
            else "[" + ", ".join(_toml_str(t) for t in tokens) + "]"
        )
        lines.append(f"{_toml_str(cid)} = {value}")
    lines += ["", "[admin]", "tokens = [" + ", ".join(_toml_str(t) for t in admin) + "]", ""]
    write_private_file(path, "\n".join(lines))
