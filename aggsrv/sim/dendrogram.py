"""FedDGIC's grouping dendrograms: the ``"grouping"`` events of a run's ``events.jsonl`` and a
plot of each (matplotlib only; the layout is computed here, with scipy's conventions).

A grouping event (one JSON line) holds ``clients`` (n ids, leaf i is ``clients[i]``), ``labels``
(each client's group, 0..k-1), ``k``, ``p``, the n - 1 sorted merge ``heights``, Eq. 5's
``ratios``, the average-linkage ``linkage`` in scipy's Z format (rows ``[a, b, height, count]``,
leaves 0..n-1, the cluster made by row r is n + r), ``version``, ``time`` and ``reason``.

:func:`leaf_order` and :func:`link_coordinates` give what ``scipy.cluster.hierarchy.dendrogram(Z,
no_plot=True)`` gives as ``leaves``, ``icoord`` and ``dcoord`` with its defaults: descent from the
root, ``Z[r, 0]`` drawn left of ``Z[r, 1]``, leaves at x = 5, 15, 25, ..., a cluster at the mean
x of its two children, and one U per merge listed in post-order (left subtree, right subtree,
then the merge itself).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["cut_height", "leaf_order", "link_coordinates", "load_groupings", "plot_dendrogram"]

_ABOVE_CUT = "0.3"  # links above the cut join groups: dark grey
_Y_LABEL = "cosine distance 1 - S (average linkage)"


def load_groupings(run_dir: str | Path) -> list[dict[str, Any]]:
    """The ``"grouping"`` events of a run, in file order ([] without ``events.jsonl``).

    Other event kinds are skipped; so is a last line cut short by a run still writing it.
    """
    path = Path(run_dir) / "events.jsonl"
    if not path.is_file():
        return []
    text = path.read_text()
    lines = text.splitlines()
    events = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            event = json.loads(line)
        except json.JSONDecodeError as exc:
            if number == len(lines) and not text.endswith("\n"):
                break  # a partial last line
            raise ValueError(f"{path}:{number}: not JSON ({exc.msg})") from None
        if isinstance(event, dict) and event.get("event") == "grouping":
            events.append(event)
    return events


def _linkage(Z: Any) -> tuple[np.ndarray, int]:
    """Z as float64 [n - 1, 4] and n, with the cluster ids checked (each used once, below its
    own row's id), so the descents below terminate."""
    Z = np.asarray(Z, dtype=np.float64)
    if Z.size == 0:
        return Z.reshape(0, 4), 1
    if Z.ndim != 2 or Z.shape[1] != 4:
        raise ValueError(f"a linkage must be [n - 1, 4], got shape {Z.shape}")
    n = Z.shape[0] + 1
    ids = Z[:, :2]
    if np.any(ids != np.floor(ids)):
        raise ValueError("linkage cluster ids must be integers")
    children = ids.astype(np.int64)
    rows = np.arange(n - 1)[:, None]
    if np.any(children < 0) or np.any(children >= n + rows):
        raise ValueError("a linkage row refers to a cluster not made before it")
    if np.unique(children).size != children.size:
        raise ValueError("a linkage uses a cluster twice")
    return Z, n


def _descend(
    Z: np.ndarray, n: int
) -> tuple[list[int], list[list[float]], list[list[float]], list[int]]:
    """(leaves, icoord, dcoord, row of each link) by one iterative post-order descent."""
    if n == 1:
        return [0], [], [], []
    leaves: list[int] = []
    icoord: list[list[float]] = []
    dcoord: list[list[float]] = []
    rows: list[int] = []
    x: dict[int, float] = {}

    def height(c: int) -> float:
        return 0.0 if c < n else float(Z[c - n, 2])

    stack = [(2 * n - 2, False)]
    while stack:
        node, expanded = stack.pop()
        if node < n:
            x[node] = len(leaves) * 10.0 + 5.0
            leaves.append(node)
            continue
        a, b = int(Z[node - n, 0]), int(Z[node - n, 1])
        if not expanded:
            stack += [(node, True), (b, False), (a, False)]  # a is popped (drawn) first
            continue
        h = float(Z[node - n, 2])
        icoord.append([x[a], x[a], x[b], x[b]])
        dcoord.append([height(a), h, h, height(b)])
        rows.append(node - n)
        x[node] = (x[a] + x[b]) / 2
    return leaves, icoord, dcoord, rows


def leaf_order(Z: Any) -> list[int]:
    """The leaves left to right, as scipy's ``dendrogram(Z)["leaves"]``."""
    return _descend(*_linkage(Z))[0]


def link_coordinates(Z: Any) -> tuple[list[list[float]], list[list[float]]]:
    """(icoord, dcoord) of each merge's U, as scipy's ``dendrogram`` lists them."""
    _, icoord, dcoord, _ = _descend(*_linkage(Z))
    return icoord, dcoord


def cut_height(heights: list[float] | np.ndarray, k: int) -> float | None:
    """A height between the last merge made (``heights[n-k-1]``) and the first one not made
    (``heights[n-k]``); above the root for k = 1, below the first merge for k = n; None for
    n = 1."""
    h = np.asarray(heights, dtype=np.float64)
    n = h.size + 1
    if n == 1:
        return None
    if not 1 <= k <= n:
        raise ValueError(f"k must be in 1..{n}, got {k}")
    span = float(h[-1] - h[0]) or float(h[-1]) or 1.0
    if k == 1:
        return float(h[-1]) + 0.05 * span
    if k == n:
        return float(h[0]) / 2
    return float(h[n - k - 1] + h[n - k]) / 2


def _check_event(event: dict[str, Any]) -> tuple[np.ndarray, int, list[str], list[int], int]:
    Z, n = _linkage(event.get("linkage") or [])
    clients = [str(c) for c in event.get("clients") or [f"client-{i}" for i in range(n)]]
    labels = [int(g) for g in event.get("labels") or [0] * n]
    if len(clients) != n or len(labels) != n:
        raise ValueError(
            f"grouping event: {len(clients)} clients and {len(labels)} labels for a linkage of "
            f"{n} leaves"
        )
    k = int(event.get("k", len(set(labels))))
    return Z, n, clients, labels, k


def plot_dendrogram(event: dict[str, Any], path: str | Path, title: str = "") -> None:
    """Draw one grouping event's dendrogram to ``path`` (PNG): links below the cut coloured by
    group, the cut as a dashed line, leaves labelled with the client ids (for n <= 200)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.collections import LineCollection

    Z, n, clients, labels, k = _check_event(event)
    leaves, icoord, dcoord, rows = _descend(Z, n)
    heights = event.get("heights")
    if heights is None or len(heights) != n - 1:
        heights = np.maximum.accumulate(Z[:, 2]) if n > 1 else []
    cut = cut_height(heights, k) if n > 1 else None
    palette = plt.get_cmap("tab10" if max(k, 1) <= 10 else "tab20").colors

    # A link is inside a group when its merge is one of the first n - k (those made before the
    # cut) and all its leaves share a label.
    group: dict[int, int | None] = dict(enumerate(labels))
    for r in range(n - 1):
        a, b = group[int(Z[r, 0])], group[int(Z[r, 1])]
        group[n + r] = a if a == b and r < n - k else None

    width = min(max(6.0, 2.0 + 0.16 * n), 24.0)
    fig, ax = plt.subplots(figsize=(width, 4.6), dpi=110)
    colors = [
        _ABOVE_CUT if group[n + r] is None else palette[group[n + r] % len(palette)] for r in rows
    ]
    ax.add_collection(
        LineCollection(
            [list(zip(xs, ys, strict=True)) for xs, ys in zip(icoord, dcoord, strict=True)],
            colors=colors,
            linewidths=1.3,
        )
    )
    top = max([float(Z[:, 2].max()) if n > 1 else 0.0, cut or 0.0])
    top = top * 1.08 if top > 0 else 1.0
    p = event.get("p")
    cut_label = f"k = {k} (Eq. 5, p = {p:g})" if isinstance(p, int | float) else f"k = {k}"
    if cut is not None:
        ax.axhline(cut, color="grey", linestyle="--", linewidth=1, label=cut_label)
        ax.legend(fontsize=8, loc="upper left")
    else:
        ax.text(0.02, 0.95, cut_label, transform=ax.transAxes, fontsize=8, va="top")
    ax.set_xlim(0, 10 * n)
    ax.set_ylim(0, top)
    if n <= 200:
        ax.set_xticks([10 * i + 5 for i in range(n)])
        size = 8 if n <= 30 else 6 if n <= 80 else 4
        ax.set_xticklabels([clients[i] for i in leaves], rotation=90, fontsize=size)
        for tick, leaf in zip(ax.get_xticklabels(), leaves, strict=True):
            tick.set_color(palette[labels[leaf] % len(palette)])
    else:
        ax.set_xticks([])
        ax.set_xlabel(f"{n} clients (ids left out)")
    ax.set_ylabel(_Y_LABEL)
    ax.grid(axis="y", alpha=0.3)
    if not title:
        title = f"{event.get('strategy', 'grouping')}: version {event.get('version', '?')}"
        if event.get("reason"):
            title += f" ({event['reason']})"
    import textwrap

    ax.set_title("\n".join(textwrap.wrap(title, 80)), fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
