"""Differential privacy's noise: Gaussian draws from a cryptographically secure stream, with a
tail that reaches past 12 standard deviations and the floating-point defence of Holohan and
Braghin's secure mode (docs/privacy.md, "The noise").

**Key.** A :class:`NoiseKey` is 256 bits from the operating system (``secrets``), held in
memory only: it is not part of any state, checkpoint, log line or repr, so a restarted server
draws a fresh key. ``NoiseKey.insecure(seed)`` derives one from a number, for reproducible
experiments (the simulator's ``dp_seed``); its draws can be recomputed by anyone who knows or
guesses the seed.

**Streams.** Every draw is addressed by (shard rank, draw number, purpose): its stream key is
``HMAC-SHA256(key, label | rank | draw | purpose)``, and the draw's values are cut into blocks
of :data:`BLOCK` values, block ``j`` read from AES-256 in counter mode under the stream key with
the counter starting at ``j * 2^64`` (so no block runs into another). Every shard and every
release has its own stream; the values do not depend on how many threads compute them. AES-CTR
comes from ``cryptography`` (OpenSSL, AES-NI): a standard construction of a secure generator,
about 8 GB/s per core here, and it releases the GIL, so blocks are drawn on several threads.

**Sampler.** A 256-layer ziggurat (Marsaglia and Tsang 2000, laid out as numpy's
``standard_normal``, its tables built from R with V exact): each attempt takes one 64-bit word
(8 bits of layer, a sign bit and a 52-bit magnitude), about 1.02 words per value on average.
Its tail beyond ``R = 3.654`` comes from Marsaglia's exact tail method with 53-bit uniforms, so
the largest value one draw can take is ``R + sqrt(2 * 53 ln 2) = 12.23`` standard deviations
(:data:`TRUNCATION`); the body is a grid of step below ``2^-50`` standard deviations.

**Secure mode.** Each released value is ``(N1 + N2) / sqrt(2)`` of two independent draws, in
float64, then scaled: the sum of two draws has no holes in its support at the float grid that
one draw's output would leave, which is what Mironov's (2012) attack on floating-point Laplace
and Gaussian noise reads (Holohan and Braghin 2021; IBM's diffprivlib does the same). It
doubles the words and the sampling, not the memory traffic of the release.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import os
import secrets
import struct
import threading
from concurrent.futures import ThreadPoolExecutor

import numba as nb
import numpy as np

__all__ = [
    "BLOCK",
    "TRUNCATION",
    "PURPOSE_COUNT",
    "PURPOSE_UPDATE",
    "NoiseKey",
    "draw_values",
    "fill_gaussian",
    "gaussian_block",
]

KEY_BYTES = 32
BLOCK = 1 << 18  # values per counter-addressed block (4 MiB of words: stays in cache)
_LABEL = b"aggsrv/dp-noise/v1"
PURPOSE_UPDATE = 0  # the noise on a release's sum
PURPOSE_COUNT = 1  # adaptive clipping's noised count

# The ziggurat's tables: 256 layers of equal area V under exp(-x^2 / 2), the base one a strip
# [0, R] x [0, f(R)] plus the tail beyond R (numpy's construction). V follows from R exactly
# (the 12 digits often quoted leave the top layer's area 1e-9 off; this one is within 2e-13).
_R = 3.6541528853610088
_V = _R * math.exp(-0.5 * _R * _R) + math.sqrt(math.pi / 2) * math.erfc(_R / math.sqrt(2))
TRUNCATION = _R + math.sqrt(2.0 * 53.0 * math.log(2.0))  # the largest |value| of one draw


def _tables() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    m = 2.0**52
    ki = np.zeros(256, dtype=np.uint64)
    wi = np.zeros(256, dtype=np.float64)
    fi = np.zeros(256, dtype=np.float64)
    dn = tn = _R
    q = _V / math.exp(-0.5 * dn * dn)
    ki[0] = np.uint64(int((dn / q) * m))
    wi[0] = q / m
    wi[255] = dn / m
    fi[0] = 1.0
    fi[255] = math.exp(-0.5 * dn * dn)
    for i in range(254, 0, -1):
        dn = math.sqrt(-2.0 * math.log(_V / dn + math.exp(-0.5 * dn * dn)))
        ki[i + 1] = np.uint64(int((dn / tn) * m))
        tn = dn
        fi[i] = math.exp(-0.5 * dn * dn)
        wi[i] = dn / m
    return ki, wi, fi


_KI, _WI, _FI = _tables()


class NoiseKey:
    """The noise's secret: 256 bits, in memory only. Never printed: ``repr`` hides it."""

    __slots__ = ("_key", "secure")

    def __init__(self, key: bytes, secure: bool) -> None:
        if len(key) != KEY_BYTES:
            raise ValueError(f"a noise key has {KEY_BYTES} bytes, got {len(key)}")
        self._key = bytes(key)
        self.secure = secure

    @classmethod
    def from_os(cls) -> NoiseKey:
        return cls(secrets.token_bytes(KEY_BYTES), secure=True)

    @classmethod
    def insecure(cls, seed: int) -> NoiseKey:
        """A key derived from ``seed`` (reproducible experiments only: anyone who knows or
        guesses the seed can recompute every draw and subtract it)."""
        return cls(hashlib.sha256(b"aggsrv/dp-seed/v1:%d" % int(seed)).digest(), secure=False)

    def __repr__(self) -> str:
        return f"NoiseKey({'secure' if self.secure else 'insecure seed'})"

    def __reduce__(self):  # a key is never pickled into a state or a checkpoint
        raise TypeError("a differential-privacy noise key is not serialisable")

    def stream_key(self, rank: int, draw: int, purpose: int) -> bytes:
        """The AES-256 key of one draw's stream."""
        address = struct.pack(">IQB", rank, draw, purpose)
        return hmac.new(self._key, _LABEL + address, hashlib.sha256).digest()


# ------------------------------------------------------------------ the sampler (numba)

_U53 = 1.0 / 9007199254740992.0  # 2^-53


@nb.njit(nogil=True, cache=True)
def _fill(words, out, scale, draws, ki, wi, fi, tail_from=0.0):
    """``out[i] = scale * (N_1 + ... + N_draws) / sqrt(draws)`` while the words last: (values
    written, words used). A value whose words ran out is not written (the caller goes on with
    the stream's next words). ``tail_from > 0`` draws from the tail method alone, N(0, 1) given
    value > tail_from (its tests reach past 6 and 8 standard deviations so). One function, not
    helpers returning tuples: numba keeps it at about 1.5 ns a draw, helpers cost 40."""
    nw = words.shape[0]
    w = 0
    c = scale / math.sqrt(draws)
    r = tail_from if tail_from > 0.0 else _R
    for i in range(out.shape[0]):
        start = w
        total = 0.0
        for _ in range(draws):
            sign = False
            while True:
                if tail_from <= 0.0:
                    if w >= nw:
                        return i, start
                    bits = words[w]
                    w += 1
                    idx = np.int64(bits & np.uint64(0xFF))
                    bits = bits >> np.uint64(8)
                    sign = (bits & np.uint64(1)) != np.uint64(0)
                    rabs = (bits >> np.uint64(1)) & np.uint64(0x000FFFFFFFFFFFFF)
                    x = np.float64(rabs) * wi[idx]
                    if sign:
                        x = -x
                    if rabs < ki[idx]:
                        break
                    if idx != 0:  # the wedge of layer idx: one more uniform
                        if w >= nw:
                            return i, start
                        u = np.float64(words[w] >> np.uint64(11)) * _U53
                        w += 1
                        if (fi[idx - 1] - fi[idx]) * u + fi[idx] < math.exp(-0.5 * x * x):
                            break
                        continue
                # Beyond r: Marsaglia's exact tail, two 53-bit uniforms a try.
                while True:
                    if w + 2 > nw:
                        return i, start
                    xx = -math.log1p(-np.float64(words[w] >> np.uint64(11)) * _U53) / r
                    yy = -math.log1p(-np.float64(words[w + 1] >> np.uint64(11)) * _U53)
                    w += 2
                    if yy + yy > xx * xx:
                        break
                x = -(r + xx) if sign else r + xx
                break
            total += x
        out[i] = c * total
    return out.shape[0], w


# ------------------------------------------------------------------ streams and blocks

_scratch = threading.local()


def _words(encryptor, n: int) -> np.ndarray:
    """The next ``n`` 64-bit words of an AES-CTR stream (a per-thread buffer, overwritten by
    the thread's next call)."""
    size = n * 8
    zeros = getattr(_scratch, "zeros", None)
    if zeros is None or zeros.size < size:
        _scratch.zeros = zeros = np.zeros(size, dtype=np.uint8)
        _scratch.out = np.empty(size, dtype=np.uint8)
    out = _scratch.out[:size]
    encryptor.update_into(memoryview(zeros[:size]), memoryview(out))
    return out.view(np.uint64)


def cipher_module():
    """cryptography's cipher primitives (an optional dependency: the error says how to get
    it)."""
    try:
        from cryptography.hazmat.primitives import ciphers
    except ImportError as exc:
        raise ImportError(
            "differential privacy's noise needs the cryptography package (pip install 'aggsrv[dp]')"
        ) from exc
    return ciphers


def _encryptor(stream_key: bytes, block: int):
    ciphers = cipher_module()
    counter = (block << 64).to_bytes(16, "big")
    cipher = ciphers.Cipher(ciphers.algorithms.AES(stream_key), ciphers.modes.CTR(counter))
    return cipher.encryptor()


def _draw(
    stream_key: bytes, block: int, out: np.ndarray, scale: float, draws: int, tail_from=0.0
) -> None:
    """Fill ``out`` from block ``block`` of a stream with :func:`_fill`'s values, fetching the
    stream's words as they are used (a value whose words ran out is drawn from the next ones)."""
    enc = _encryptor(stream_key, block)
    per_value = 4 if tail_from > 0.0 else draws  # the tail method takes 2 words a try
    done = 0
    while done < out.shape[0]:
        left = out.shape[0] - done
        words = _words(enc, per_value * left + left // 16 + 64)
        wrote, _ = _fill(words, out[done:], scale, draws, _KI, _WI, _FI, tail_from)
        done += wrote


def gaussian_block(stream_key: bytes, block: int, out: np.ndarray, scale: float) -> None:
    """Fill ``out`` (float64, at most :data:`BLOCK` values) with block ``block`` of the stream:
    ``scale * (N1 + N2) / sqrt(2)`` per value."""
    _draw(stream_key, block, out, scale, 2)


def standard_normals(stream_key: bytes, n: int) -> np.ndarray:
    """``n`` single ziggurat draws of N(0, 1) from the start of a stream (the sampler alone,
    without the secure mode's sum; for tests and audits)."""
    out = np.empty(n, dtype=np.float64)
    _draw(stream_key, 0, out, 1.0, 1)
    return out


def tail_normals(stream_key: bytes, n: int, r: float) -> np.ndarray:
    """``n`` draws of N(0, 1) given value > ``r`` by the sampler's tail method (for tests)."""
    out = np.empty(n, dtype=np.float64)
    _draw(stream_key, 0, out, 1.0, 1, float(r))
    return out


_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _threads() -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(cores or 1, 8))


def _forget_pool() -> None:
    global _pool
    _pool = None


# A forked child (a sweep's worker) has none of the parent's threads: it makes its own pool.
os.register_at_fork(after_in_child=_forget_pool)


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(_threads(), thread_name_prefix="aggsrv-dp-noise")
        return _pool


def fill_gaussian(
    key: NoiseKey, rank: int, draw: int, out: np.ndarray, std: float, purpose: int = 0
) -> None:
    """Fill ``out`` (float64, contiguous) with draw ``draw`` of shard ``rank``: N(0, std^2) per
    value, blocks on several threads; the values depend only on (key, rank, draw, purpose)."""
    if out.dtype != np.float64 or not out.flags.c_contiguous:
        raise ValueError("the noise is drawn into a contiguous float64 array")
    stream = key.stream_key(rank, draw, purpose)
    blocks = [(j, out[j * BLOCK : (j + 1) * BLOCK]) for j in range(-(-out.shape[0] // BLOCK))]
    if len(blocks) <= 1:
        for j, part in blocks:
            gaussian_block(stream, j, part, std)
        return
    futures = [_executor().submit(gaussian_block, stream, j, part, std) for j, part in blocks]
    for f in futures:
        f.result()


def draw_values(
    key: NoiseKey, rank: int, draw: int, n: int, std: float, purpose: int = PURPOSE_UPDATE
) -> np.ndarray:
    """Draw ``draw`` of shard ``rank`` as a new float64 array of ``n`` values (what
    :func:`fill_gaussian` writes; an experiment with a fixed seed recomputes its noise so)."""
    out = np.empty(n, dtype=np.float64)
    fill_gaussian(key, rank, draw, out, std, purpose)
    return out
