"""Client data partitions, named after the papers that use them.

A partition maps the labels of a training set to one index array per client. Every scheme is
seeded (``np.random.default_rng(seed)``), so the same ``(labels, num_clients, spec, seed)`` gives
the same split for every strategy compared, and every index goes to at most one client.

Schemes (the spec file is the normative reference; section 2 of each describes the split):

* ``iid``: shuffle, equal sizes (difference at most 1). Uses every sample.
* ``dirichlet_per_client`` (ORTHOFL, docs/algorithms/orthofl.md 2.1): equal client sizes, each
  client's label mix ~ Dir(alpha), filled sample by sample.
* ``dirichlet_per_class`` (FedHist, docs/algorithms/fedhist.md 2): each class is split over the
  clients with shares ~ Dir(beta) (MOON style); unequal sizes, resampled until every client has
  ``min_size``.
* ``shards`` (FedAvg, used by FedDGIC and FedEN): sort by label, cut into shards, ``s`` per client.
* ``main_class`` (Fed-OGD, docs/algorithms/fedogd.md 3): one (or more) main class per client holding
  a fixed fraction of its data, a few samples of every other class.
* ``p_disorder`` (FedDGIC, docs/algorithms/feddgic.md 2.2): P% of each label is dealt out as
  label-sorted shards, the rest IID.
* ``feden_mix`` (FedEN, docs/algorithms/feden.md 2, gap G7): every client gets a ``similarity``
  share of IID data plus one label-sorted shard; ``mode=half_devices`` gives the other reading.

A spec is a string ``"name"`` or ``"name:key=value,key=value"`` (see :func:`parse_partition`) or a
mapping ``{"name": ..., key: value}``. A user scheme is written ``"module:callable"`` (parameters
may follow after a second colon) and is called like the built-ins in :data:`PARTITIONS`:
``callable(labels, num_clients, rng, num_classes, **params)`` returning one index array per client.
"""

from __future__ import annotations

import bisect
import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from aggsrv.imports import load_callable

__all__ = [
    "PARTITIONS",
    "check_partition_spec",
    "dirichlet_per_class",
    "dirichlet_per_client",
    "feden_mix",
    "format_summary",
    "iid",
    "main_class",
    "p_disorder",
    "parse_partition",
    "partition",
    "shards",
    "summarize",
]

Partitioner = Callable[..., list[np.ndarray]]

# How often dirichlet_per_class redraws before it gives up on the minimum client size.
_MAX_RESAMPLES = 1000


# ---------------------------------------------------------------------------------------------
# parameter checks (messages name the scheme and the parameter)


def _positive_int(scheme: str, key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise ValueError(f"{scheme}: {key} must be a positive integer, got {value!r}")
    return int(value)


def _number(scheme: str, key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | np.number):
        raise ValueError(f"{scheme}: {key} must be a number, got {value!r}")
    return float(value)


def _positive_float(scheme: str, key: str, value: Any) -> float:
    value = _number(scheme, key, value)
    if not value > 0:  # also rejects NaN
        raise ValueError(f"{scheme}: {key} must be > 0 (use inf for uniform), got {value!r}")
    return value


def _fraction(scheme: str, key: str, value: Any, lo: float, hi: float) -> float:
    value = _number(scheme, key, value)
    if not lo <= value <= hi:
        raise ValueError(f"{scheme}: {key} must lie in [{lo:g}, {hi:g}], got {value!r}")
    return value


def _label_sorted(indices: np.ndarray, labels: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """``indices`` ordered by label, in random order within a label (FedAvg's sorted shards)."""
    shuffled = rng.permutation(indices)
    return shuffled[np.argsort(labels[shuffled], kind="stable")]


# ---------------------------------------------------------------------------------------------
# schemes


def iid(
    labels: np.ndarray, num_clients: int, rng: np.random.Generator, num_classes: int
) -> list[np.ndarray]:
    """Shuffle and deal into ``num_clients`` parts whose sizes differ by at most one."""
    del num_classes
    return list(np.array_split(rng.permutation(len(labels)), num_clients))


def dirichlet_per_client(
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    num_classes: int,
    *,
    alpha: float = 0.1,
    chunk: int = 1,
) -> list[np.ndarray]:
    """ORTHOFL's split (docs/algorithms/orthofl.md 2.1, "Dirichlet partition (Hsu et al. style)").

    Each client m draws a label mix q_m ~ Dir(alpha * 1_C) and gets exactly N // M samples (the
    first N % M clients one more: the spec's round-robin remainder), so every sample is used.
    Samples are dealt ``chunk`` at a time (the spec: 1 for CIFAR, 3 for MNIST): pick a uniformly
    random client that is not yet full, draw a class from its q_m by inverse CDF (first class j
    with u <= cumsum_j), and take random unused samples of that class.

    Class exhaustion follows the authors' code: take the first class >= j that still has samples.
    Where the code then falls back to class 0, or redraws u when class 0 is empty too (which can
    spin when q_m has underflowed to zeros, as it does for alpha = 0.01), we wrap around to the
    first class < j with samples: the same answer whenever class 0 has samples, deterministic and
    always finite otherwise. ``alpha = inf`` gives q_m uniform (the spec's 10^4 is close to it).
    Default alpha = 0.1, the paper's value for every data set (spec 2.2).
    """
    scheme = "dirichlet_per_client"
    alpha = _positive_float(scheme, "alpha", alpha)
    chunk = _positive_int(scheme, "chunk", chunk)
    n = len(labels)
    capacity = np.full(num_clients, n // num_clients, dtype=np.int64)
    capacity[: n % num_clients] += 1

    if math.isinf(alpha):
        mixes = np.full((num_clients, num_classes), 1.0 / num_classes)
    else:
        mixes = rng.dirichlet(np.full(num_classes, alpha), size=num_clients)
    cdfs = []
    for q in mixes:
        cdf = np.cumsum(q)
        cdf /= cdf[-1]  # q can sum to 1 - 1e-16; make u <= cdf[-1] always hold
        cdfs.append(cdf.tolist())

    pools = [rng.permutation(np.flatnonzero(labels == c)).tolist() for c in range(num_classes)]
    left = [len(p) for p in pools]  # samples of class c not yet dealt: pools[c][-left[c]:]
    assigned: list[list[int]] = [[] for _ in range(num_clients)]
    room = capacity.tolist()
    open_clients = [m for m in range(num_clients) if room[m] > 0]
    # Each step deals at least one sample, so n steps at most: draw all uniforms up front. The
    # loop is plain Python because numpy calls on scalars would cost more than the work.
    client_u = rng.random(n).tolist()
    class_u = rng.random(n).tolist()
    step = 0
    while open_clients:
        slot = min(int(client_u[step] * len(open_clients)), len(open_clients) - 1)
        m = open_clients[slot]
        j = min(bisect.bisect_left(cdfs[m], class_u[step]), num_classes - 1)
        step += 1
        c = next(
            (k % num_classes for k in range(j, j + num_classes) if left[k % num_classes]), None
        )
        assert c is not None  # the clients' total room equals the samples left
        take = min(chunk, left[c], room[m])
        start = len(pools[c]) - left[c]
        assigned[m].extend(pools[c][start : start + take])
        left[c] -= take
        room[m] -= take
        if room[m] == 0:
            open_clients[slot] = open_clients[-1]
            open_clients.pop()
    return [np.asarray(a, dtype=np.int64) for a in assigned]


def dirichlet_per_class(
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    num_classes: int,
    *,
    beta: float = 0.3,
    min_size: int = 1,
) -> list[np.ndarray]:
    """FedHist's split (docs/algorithms/fedhist.md 2, "partition" row: MOON-style Dir_N(beta)).

    For each class k, draw shares q_k ~ Dir_N(beta) over the N clients and give client j the
    contiguous slice ``floor(cumsum(q_k) * n_k)`` of the shuffled class (MOON's rounding), so every
    sample is used and client sizes are unequal. ``beta = inf`` splits every class evenly (the
    spec's IID case).

    Minimum size: the spec asks for ``|D_i| >= 1``; like MOON's ``min_require_size`` loop we redraw
    the whole split until every client holds at least ``min_size`` samples (MOON uses 10; pass
    ``min_size=10`` for that), and give up with a clear error after 1000 draws. MOON's extra trick
    of zeroing the share of clients already above N/n is not in the spec and not applied. Default
    beta = 0.3, the paper's most skewed setting (it uses {0.3, 1.0, inf}).
    """
    scheme = "dirichlet_per_class"
    beta = _positive_float(scheme, "beta", beta)
    min_size = _positive_int(scheme, "min_size", min_size)
    if min_size * num_clients > len(labels):
        raise ValueError(
            f"{scheme}: min_size={min_size} for {num_clients} clients needs "
            f"{min_size * num_clients} samples but there are {len(labels)}"
        )
    by_class = [np.flatnonzero(labels == c) for c in range(num_classes)]
    for _ in range(_MAX_RESAMPLES):
        parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        for idx in by_class:
            idx = rng.permutation(idx)
            if math.isinf(beta):
                shares = np.full(num_clients, 1.0 / num_clients)
            else:
                shares = rng.dirichlet(np.full(num_clients, beta))
            cuts = (np.cumsum(shares) * len(idx)).astype(np.int64)[:-1]
            for j, piece in enumerate(np.split(idx, cuts)):
                parts[j].append(piece)
        sizes = [sum(len(p) for p in client) for client in parts]
        if min(sizes) >= min_size:
            return [np.concatenate(client).astype(np.int64) for client in parts]
    raise ValueError(
        f"{scheme}: no draw in {_MAX_RESAMPLES} gave every one of {num_clients} clients at least "
        f"{min_size} samples (beta={beta:g}, {len(labels)} samples); use a larger beta, fewer "
        "clients or a smaller min_size"
    )


def shards(
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    num_classes: int,
    *,
    shards_per_client: int | None = None,
    num_shards: int | None = None,
) -> list[np.ndarray]:
    """FedAvg's pathological split (McMahan et al.; FedDGIC and FedEN build on it).

    Sort the samples by label (random order within a label), cut them into
    ``num_clients * shards_per_client`` contiguous shards and give each client
    ``shards_per_client`` shards at random. Default 2 shards per client, as in FedAvg. FedAvg's
    sizes divide evenly (60,000 = 200 x 300); where they do not, shard sizes differ by at most one
    so every sample is still used. ``num_shards`` may be given instead of ``shards_per_client``
    and must be a multiple of ``num_clients``. A client holds at most ``2 * shards_per_client``
    classes, and at most ``shards_per_client`` when every class size is a multiple of the shard
    size.
    """
    del num_classes
    scheme = "shards"
    if num_shards is not None:
        num_shards = _positive_int(scheme, "num_shards", num_shards)
        if num_shards % num_clients:
            raise ValueError(
                f"{scheme}: num_shards={num_shards} does not divide evenly over "
                f"{num_clients} clients"
            )
        per = num_shards // num_clients
        if shards_per_client is not None and shards_per_client != per:
            raise ValueError(
                f"{scheme}: shards_per_client={shards_per_client} contradicts num_shards="
                f"{num_shards} for {num_clients} clients (that is {per} per client)"
            )
        shards_per_client = per
    shards_per_client = _positive_int(
        scheme, "shards_per_client", 2 if shards_per_client is None else shards_per_client
    )
    total = num_clients * shards_per_client
    if total > len(labels):
        raise ValueError(
            f"{scheme}: {num_clients} clients x {shards_per_client} shards = {total} shards "
            f"but only {len(labels)} samples; use fewer shards per client"
        )
    pieces = np.array_split(_label_sorted(np.arange(len(labels)), labels, rng), total)
    order = rng.permutation(total).reshape(num_clients, shards_per_client)
    return [np.concatenate([pieces[s] for s in row]) for row in order]


def main_class(
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    num_classes: int,
    *,
    main_frac: float = 0.95,
    num_main: int = 1,
    size: int | None = None,
) -> list[np.ndarray]:
    """Fed-OGD's split (docs/algorithms/fedogd.md 3, rows "non-IID scheme" to "AG_NEWS split"; code
    ``dataset_noniid(main_label_prop)``).

    Client i requests ``size`` samples (default N // K: CIFAR-10 with 50 clients gives 1000). Its
    main classes are ``(num_main * i + j) mod C`` for j < num_main (i mod 10 on CIFAR-10; 2i and
    2i+1 on CIFAR-100), each with ``floor(main_frac * size / num_main)`` samples, and every other
    class fills ``floor((size - main) / (C - num_main))`` (CIFAR-10: 950 + 9 x 5 = 995; CIFAR-100
    with main_frac=0.8, num_main=2: 400 + 400 + 98 x 2 = 996), exactly as the code does, so sizes
    may fall a few samples short of ``size``. Defaults: one main class at 95% (the paper's CIFAR-10
    setting).

    Oversubscribed classes (the spec's AG_NEWS case): the code truncates late clients; the spec
    allows capping at the available samples. We cap fairly and deterministically: main requests
    are served before fill requests, and a tier that does not fit is scaled down in proportion
    (floor), so no client is favoured for its index.
    """
    scheme = "main_class"
    main_frac = _fraction(scheme, "main_frac", main_frac, 0.0, 1.0)
    num_main = _positive_int(scheme, "num_main", num_main)
    if num_main > num_classes:
        raise ValueError(f"{scheme}: num_main={num_main} exceeds the {num_classes} classes")
    size = _positive_int(scheme, "size", len(labels) // num_clients if size is None else size)
    # The small epsilon keeps 0.95 * 20 = 18.999... from flooring to 18.
    per_main = math.floor(main_frac * size / num_main + 1e-9)
    per_other = (
        (size - num_main * per_main) // (num_classes - num_main) if num_classes > num_main else 0
    )

    if num_main * per_main + (num_classes - num_main) * per_other == 0:
        raise ValueError(
            f"{scheme}: size={size} with main_frac={main_frac:g} gives every client 0 samples; "
            "use a larger size or main_frac"
        )

    main_req = np.zeros((num_clients, num_classes), dtype=np.int64)
    other_req = np.full((num_clients, num_classes), per_other, dtype=np.int64)
    for i in range(num_clients):
        for j in range(num_main):
            c = (num_main * i + j) % num_classes
            main_req[i, c] = per_main
            other_req[i, c] = 0

    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for c in range(num_classes):
        pool = rng.permutation(np.flatnonzero(labels == c))
        pos = 0
        for req in (main_req[:, c], other_req[:, c]):
            want = int(req.sum())
            avail = len(pool) - pos
            grant = req if want <= avail else (req * avail) // want
            for i in np.flatnonzero(grant):
                parts[i].append(pool[pos : pos + grant[i]])
                pos += int(grant[i])
    empty = [i for i, p in enumerate(parts) if not p]
    if empty:
        raise ValueError(
            f"{scheme}: client(s) {empty[:10]} get no samples: their classes are used up by "
            "other clients; use fewer clients or a smaller size"
        )
    return [np.concatenate(p).astype(np.int64) for p in parts]


def p_disorder(
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    num_classes: int,
    *,
    p: float = 40.0,
    shards_per_client: int = 2,
) -> list[np.ndarray]:
    """FedDGIC's split (docs/algorithms/feddgic.md 2.2, "Non-IID scheme", the spec's DECISION).

    The paper: "we sort the training samples by their labels and then take out P_disorder percent
    of the samples for each label. We follow the FedAvg method to distribute [them] ... We randomly
    assign an equal amount of the remaining samples". So P = 100 is fully non-IID and P = 0 IID
    (Parallel-SGD's ``True_Non_IID(disorder)`` means the opposite; the spec says follow the
    paper, and so do we).

    Per label take a random floor(P/100 * n_label) samples; sort the pooled taken samples by label
    and cut them into ``shards_per_client * K`` equal contiguous shards of floor(taken / (s K));
    give each client ``s`` random shards. The leftover of that cut joins the remaining samples,
    which are shuffled and split into K equal parts; the remainder (< K) is discarded. Client
    sizes therefore differ by at most a few samples. Defaults: P = 40 (the paper's MNIST default;
    CIFAR uses 50) and 2 shards per client (FedAvg).
    """
    scheme = "p_disorder"
    p = _fraction(scheme, "p", p, 0.0, 100.0)
    s = _positive_int(scheme, "shards_per_client", shards_per_client)
    taken_parts, rest_parts = [], []
    for c in range(num_classes):
        idx = rng.permutation(np.flatnonzero(labels == c))
        k = math.floor(p / 100.0 * len(idx) + 1e-9)
        taken_parts.append(idx[:k])
        rest_parts.append(idx[k:])
    taken = np.concatenate(taken_parts)  # already label-sorted and random within a label
    num_shards = s * num_clients
    shard_size = len(taken) // num_shards
    shard_rows = taken[: shard_size * num_shards].reshape(num_shards, shard_size)
    rest = rng.permutation(np.concatenate([*rest_parts, taken[shard_size * num_shards :]]))
    share = len(rest) // num_clients
    order = rng.permutation(num_shards).reshape(num_clients, s)
    return [
        np.concatenate([*shard_rows[row], rest[i * share : (i + 1) * share]]).astype(np.int64)
        for i, row in enumerate(order)
    ]


def feden_mix(
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    num_classes: int,
    *,
    similarity: float = 0.5,
    mode: str = "similarity",
) -> list[np.ndarray]:
    """FedEN's split (docs/algorithms/feden.md 2, "Non-IID partition", gap G7).

    The paper: "the edge devices have half of the data from similar distribution ... each device
    will have some data from each of the 10 classes". The spec's decision (SCAFFOLD-style
    ``similarity``), ``mode=similarity`` (default): shuffle; every client gets n = N // K samples,
    round(similarity * n) of them IID from the shuffled head, the rest as one contiguous shard of
    the label-sorted tail (shard-to-client assignment shuffled). MNIST with 100 clients: 300 IID +
    300 from one shard = 600 each, all classes present, 1-2 dominant. The remainder (< K samples)
    is discarded to keep sizes equal.

    ``mode=half_devices`` is the spec's alternative reading: round(similarity * K) clients get n
    IID samples each and the others one label-sorted shard of n samples each.
    """
    del num_classes
    scheme = "feden_mix"
    similarity = _fraction(scheme, "similarity", similarity, 0.0, 1.0)
    if mode not in ("similarity", "half_devices"):
        raise ValueError(f"{scheme}: mode must be 'similarity' or 'half_devices', got {mode!r}")
    n = len(labels) // num_clients
    perm = rng.permutation(len(labels))
    if mode == "similarity":
        n_iid = round(similarity * n)
        n_skew = n - n_iid
        head = perm[: num_clients * n_iid].reshape(num_clients, n_iid)
        tail = _label_sorted(perm[num_clients * n_iid : num_clients * n], labels, rng)
        skew = tail.reshape(num_clients, n_skew)[rng.permutation(num_clients)]
        return [np.concatenate([head[i], skew[i]]).astype(np.int64) for i in range(num_clients)]
    k_iid = round(similarity * num_clients)
    head = perm[: k_iid * n].reshape(k_iid, n)
    tail = _label_sorted(perm[k_iid * n : num_clients * n], labels, rng)
    skew = tail.reshape(num_clients - k_iid, n)[rng.permutation(num_clients - k_iid)]
    return [*head, *skew]


PARTITIONS: dict[str, Partitioner] = {
    "iid": iid,
    "dirichlet_per_client": dirichlet_per_client,
    "dirichlet_per_class": dirichlet_per_class,
    "shards": shards,
    "main_class": main_class,
    "p_disorder": p_disorder,
    "feden_mix": feden_mix,
}


# ---------------------------------------------------------------------------------------------
# spec parsing


def _parse_value(text: str) -> Any:
    """'3' -> 3, '0.1' / '1e-2' / 'inf' -> float, 'true'/'false' -> bool, anything else -> str."""
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        return text


def _parse_params(spec: str, text: str) -> dict[str, Any]:
    params: dict[str, Any] = {}
    if not text.strip():
        return params
    for item in text.split(","):
        key, eq, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not eq or not key or not value:
            raise ValueError(
                f"partition {spec!r}: bad parameter {item.strip()!r}; write key=value, "
                "e.g. 'dirichlet_per_client:alpha=0.1'"
            )
        if key in params:
            raise ValueError(f"partition {spec!r}: parameter {key!r} given twice")
        params[key] = _parse_value(value)
    return params


def _known() -> str:
    return ", ".join(PARTITIONS) + ", or a user partition as 'module:callable'"


def _is_dotted(text: str) -> bool:
    """``pkg.module`` or ``Class.method``: dotted Python identifiers."""
    return bool(text) and all(part.isidentifier() for part in text.split("."))


def parse_partition(spec: str) -> tuple[str, dict]:
    """Split a partition spec into (name, params).

    ``"iid"`` -> ("iid", {}); ``"dirichlet_per_client:alpha=0.1"`` -> ("dirichlet_per_client",
    {"alpha": 0.1}); ``"pkg.mod:func:k=2"`` -> ("pkg.mod:func", {"k": 2}). Values become int,
    float (``inf`` included), bool or str. The name is checked; parameter names are checked by
    :func:`partition`, which knows each scheme's signature.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"empty partition spec {spec!r}; known: {_known()}")
    text = spec.strip()
    head, _, rest = text.partition(":")
    if head in PARTITIONS:
        return head, _parse_params(text, rest)
    target, _, param_text = rest.partition(":")
    if _is_dotted(head) and _is_dotted(target):
        return f"{head}:{target}", _parse_params(text, param_text)
    raise ValueError(f"unknown partition {head!r} in {spec!r}; known: {_known()}")


def _resolve(name: str) -> Partitioner:
    if name in PARTITIONS:
        return PARTITIONS[name]
    return load_callable(name, "partition")


def _check_params(name: str, fn: Partitioner, params: Mapping[str, Any]) -> None:
    """Reject parameter names the scheme does not take, listing the ones it does."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins have no signature: let the call decide
        return
    kinds = inspect.Parameter
    if any(p.kind is kinds.VAR_KEYWORD for p in sig.parameters.values()):
        return
    # The first four positional parameters are (labels, num_clients, rng, num_classes).
    named = [p for p in sig.parameters.values() if p.kind is not kinds.VAR_POSITIONAL]
    allowed = [
        p.name for p in named[4:] if p.kind in (kinds.POSITIONAL_OR_KEYWORD, kinds.KEYWORD_ONLY)
    ]
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        takes = ", ".join(allowed) if allowed else "no parameters"
        raise ValueError(
            f"partition {name!r}: unknown parameter(s) {', '.join(unknown)}; takes {takes}"
        )


def check_partition_spec(spec: str | Mapping[str, Any]) -> None:
    """Raise ValueError for an unknown scheme or a parameter it does not take, without data
    (a sweep checks every cell's split before it runs anything)."""
    if isinstance(spec, Mapping):
        name, params = str(spec.get("name")), {k: v for k, v in spec.items() if k != "name"}
    else:
        name, params = parse_partition(spec)
    _check_params(name, _resolve(name), params)


def _as_labels(labels: Any) -> np.ndarray:
    if hasattr(labels, "detach"):  # a torch tensor, without importing torch here
        labels = labels.detach().cpu().numpy()
    arr = np.asarray(labels)
    if arr.ndim != 1:
        raise ValueError(f"labels must be one-dimensional, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"labels must be integers, got dtype {arr.dtype}")
    arr = arr.astype(np.int64, copy=False)
    if arr.size and arr.min() < 0:
        raise ValueError(f"labels must be >= 0, got {int(arr.min())}")
    return arr


def _finish(name: str, parts: Sequence[Any], n: int, num_clients: int) -> list[np.ndarray]:
    """Check a scheme's output (user schemes included) and return sorted int64 arrays."""
    if len(parts) != num_clients:
        raise ValueError(
            f"partition {name!r} returned {len(parts)} index arrays for {num_clients} clients"
        )
    out = [np.sort(np.asarray(p, dtype=np.int64).reshape(-1)) for p in parts]
    flat = np.concatenate(out) if out else np.empty(0, dtype=np.int64)
    if flat.size and (flat.min() < 0 or flat.max() >= n):
        raise ValueError(f"partition {name!r} returned indices outside [0, {n})")
    if flat.size and np.bincount(flat, minlength=n).max() > 1:
        raise ValueError(f"partition {name!r} gave some sample to more than one client")
    return out


def partition(
    labels: Any,
    num_clients: int,
    spec: str | Mapping[str, Any],
    seed: int,
    num_classes: int | None = None,
) -> list[np.ndarray]:
    """Split the samples with these ``labels`` over ``num_clients`` clients.

    ``spec`` is a string for :func:`parse_partition` or a mapping ``{"name": ..., **params}``.
    Returns one sorted int64 index array per client; no index appears twice. The same
    ``(labels, num_clients, spec, seed)`` always gives the same arrays. ``num_classes`` defaults to
    ``max(labels) + 1``.
    """
    if isinstance(spec, Mapping):
        if "name" not in spec:
            raise ValueError(f"partition spec mapping needs a 'name' key, got {dict(spec)!r}")
        name, params = str(spec["name"]), {k: v for k, v in spec.items() if k != "name"}
        if name not in PARTITIONS and ":" not in name:
            raise ValueError(f"unknown partition {name!r}; known: {_known()}")
    else:
        name, params = parse_partition(spec)
    arr = _as_labels(labels)
    if isinstance(num_clients, bool) or not isinstance(num_clients, int | np.integer):
        raise ValueError(f"num_clients must be an int, got {num_clients!r}")
    if num_clients < 1:
        raise ValueError(f"num_clients must be >= 1, got {num_clients}")
    if num_clients > len(arr):
        raise ValueError(
            f"partition {name!r}: {num_clients} clients but only {len(arr)} samples; "
            "every client needs at least one"
        )
    inferred = int(arr.max()) + 1 if arr.size else 0
    if num_classes is None:
        num_classes = inferred
    elif num_classes < inferred:
        raise ValueError(f"labels go up to {inferred - 1} but num_classes is {num_classes}")
    fn = _resolve(name)
    _check_params(name, fn, params)
    rng = np.random.default_rng(seed)
    parts = fn(arr, int(num_clients), rng, int(num_classes), **params)
    return _finish(name, parts, len(arr), int(num_clients))


# ---------------------------------------------------------------------------------------------
# reporting


def summarize(parts: Sequence[np.ndarray], labels: Any, num_classes: int) -> list[dict]:
    """Per client: ``{"client": i, "size": n, "labels": [count of class 0, 1, ...]}``."""
    arr = _as_labels(labels)
    return [
        {
            "client": i,
            "size": len(p),
            "labels": np.bincount(arr[np.asarray(p, dtype=np.int64)], minlength=num_classes)
            .astype(int)
            .tolist(),
        }
        for i, p in enumerate(parts)
    ]


def format_summary(summary: Sequence[Mapping[str, Any]], max_rows: int = 20) -> str:
    """A fixed-width table of a :func:`summarize` result for the run output.

    Columns: client, size, number of classes present, share of the largest class, and the count
    per class. With more than ``max_rows`` clients the middle rows are elided; the last line gives
    the size range so skew is visible even then.
    """
    if not summary:
        return "(no clients)"
    rows = list(summary)
    shown: list[Mapping[str, Any] | None] = rows
    elided = 0
    if len(rows) > max_rows:
        head = max(1, max_rows // 2)
        tail = max(1, max_rows - head)
        elided = len(rows) - head - tail
        shown = [*rows[:head], None, *rows[-tail:]]
    width = max(len(str(c)) for r in rows for c in r["labels"]) if rows[0]["labels"] else 1
    lines = [f"{'client':>6} {'size':>7} {'classes':>7} {'top':>5}  labels (count per class)"]
    for r in shown:
        if r is None:
            lines.append(f"{'...':>6}  ({elided} more clients)")
            continue
        counts = r["labels"]
        top = max(counts) / r["size"] if r["size"] else 0.0
        present = sum(1 for c in counts if c)
        cells = " ".join(f"{c:>{width}}" for c in counts)
        lines.append(f"{r['client']:>6} {r['size']:>7} {present:>7} {top:>5.2f}  {cells}")
    sizes = [r["size"] for r in rows]
    lines.append(
        f"{len(rows)} clients, {sum(sizes)} samples; size min {min(sizes)} / "
        f"mean {sum(sizes) / len(sizes):.1f} / max {max(sizes)}"
    )
    return "\n".join(lines)
