"""Dropouts: clients that leave at a virtual time or after N updates, and may come back.

Which clients leave: an explicit ``clients`` list, or ``k`` of them (``count``, or
``round(fraction * n)``) chosen by ``choose``:

* ``random`` (the default): ``k`` distinct clients drawn uniformly from the seed's
  ``STREAM_DROP_CHOICE`` generator.
* ``label``: the holders of one label leave, so that label becomes rare among the clients that
  stay (the case where compensating for dropped clients should matter). The label ``L`` is drawn
  uniformly, from the same generator, among the labels the split holds (column sum > 0 of the
  ``[num_clients, num_classes]`` label counts the simulator passes in); the clients are ranked by
  their count of ``L``, descending, ties (clients without ``L`` included) by client index, and the
  first ``k`` leave. ``describe`` records ``L`` and ``label_share``, the fraction of ``L``'s
  examples the leavers hold.

Either way each leaver's leave and return times are drawn per client (``STREAM_DROP_LEAVE``,
``STREAM_DROP_RETURN``), so they do not depend on how the client was chosen.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .checks import choice, fraction_count, int_at_least, number, value_range
from .components import Component, Context
from .streams import STREAM_DROP_CHOICE, STREAM_DROP_LEAVE, STREAM_DROP_RETURN, job_rng

CHOICES = ("random", "label")


def holders_of_a_label(
    where: str, counts: np.ndarray | None, k: int, rng: np.random.Generator
) -> tuple[list[int], int, float]:
    """``choose=label``: the ``k`` clients holding the most of a drawn label (sorted), the
    label, and the share of its examples they hold."""
    if counts is None:
        raise ValueError(
            f"{where}: choose='label' needs the data split (the per-client label counts); "
            "make_profile was called without label_counts"
        )
    totals = counts.sum(axis=0)
    held = np.flatnonzero(totals > 0)
    if held.size == 0:
        raise ValueError(f"{where}: choose='label' needs training examples; label_counts is all 0")
    label = int(held[rng.integers(held.size)])
    column = counts[:, label]
    # lexsort's last key is the primary one: most examples of the label first, then index.
    order = np.lexsort((np.arange(len(column)), -column))[:k]
    share = float(column[order].sum() / totals[label])
    return sorted(int(c) for c in order), label, share


class Dropout(Component):
    """Clients that leave at a virtual time or after N updates, and may come back."""

    kind = "dropout"
    keys = ("count", "fraction", "clients", "choose", "at_time", "after_updates", "return_after")

    def __init__(self, ctx: Context, p: Mapping[str, Any]) -> None:
        where = "dropout"
        n = ctx.num_clients
        chosen = [k for k in ("count", "fraction", "clients") if k in p]
        if len(chosen) > 1:
            raise ValueError(f"{where}: give one of count, fraction, clients, not {chosen}")
        how = choice(where, "choose", p.get("choose", "random"), CHOICES)
        if "clients" in p and "choose" in p:
            raise ValueError(
                f"{where}: choose applies to count or fraction; give choose or clients, not both"
            )
        chosen_by: dict[str, Any] = {}
        if "clients" in p:
            clients = p["clients"]
            if isinstance(clients, str) or not isinstance(clients, Sequence):
                raise ValueError(f"{where}: clients must be a list of client indices")
            ids = sorted({int_at_least(where, "client", c, 0) for c in clients})
            if ids and ids[-1] >= n:
                raise ValueError(f"{where}: client {ids[-1]} out of range for {n} clients")
        else:
            if "count" in p:
                k = int_at_least(where, "count", p["count"], 0)
                if k > n:
                    raise ValueError(f"{where}: count {k} exceeds the {n} clients")
            else:
                k = fraction_count(where, number(where, "fraction", p.get("fraction", 0.25)), n)
            rng = job_rng(ctx.seed, 0, 0, STREAM_DROP_CHOICE)
            chosen_by["choose"] = how
            if how == "label":
                ids, label, share = holders_of_a_label(where, ctx.label_counts, k, rng)
                chosen_by.update(label=label, label_share=share)
            else:
                ids = sorted(int(c) for c in rng.choice(n, k, replace=False))
        if "at_time" in p and "after_updates" in p:
            raise ValueError(f"{where}: give at_time or after_updates, not both")
        self.by_time = "at_time" in p
        spec = p["at_time"] if self.by_time else p.get("after_updates", [4, 20])
        key = "at_time" if self.by_time else "after_updates"
        leave = value_range(where, key, spec, integer=not self.by_time)
        if not self.by_time and leave[0] < 1:
            raise ValueError(f"{where}: after_updates must be >= 1, got {spec!r}")
        ret = p.get("return_after")
        ret_range = None if ret is None else value_range(where, "return_after", ret, integer=False)
        shown = list(leave) if self.by_time else [int(v) for v in leave]
        self.spec = {
            **chosen_by,
            key: shown,
            "return_after": None if ret_range is None else list(ret_range),
        }
        # Per client: when it leaves (virtual time, or its number of updates) and for how long.
        self.leave: dict[int, float] = {}
        self.away_for: dict[int, float | None] = {}
        for c in ids:
            lo, hi = leave
            rng = job_rng(ctx.seed, c, 0, STREAM_DROP_LEAVE)
            if self.by_time:
                self.leave[c] = lo if lo == hi else float(rng.uniform(lo, hi))
            else:
                self.leave[c] = float(rng.integers(int(lo), int(hi) + 1))
            if ret_range is None:
                self.away_for[c] = None
            else:
                rlo, rhi = ret_range
                rng = job_rng(ctx.seed, c, 0, STREAM_DROP_RETURN)
                self.away_for[c] = rlo if rlo == rhi else float(rng.uniform(rlo, rhi))
        # after_updates with a return: the virtual time each client was first seen gone.
        self._left_at: dict[int, float] = {}

    def _window(
        self, client: int, t: float, sent: int, last_update_at: float | None
    ) -> tuple[float, float] | None:
        """The client's absence ``[start, end)`` (end may be inf), or None if it is not known
        to be away at (t, sent): it never leaves, has not left yet, or came back."""
        if client not in self.leave:
            return None
        away = self.away_for[client]
        if self.by_time:
            start = self.leave[client]
            return (start, math.inf if away is None else start + away)
        n = int(self.leave[client])
        if sent < n:
            return None
        if away is None:
            return (-math.inf, math.inf)
        if sent > n:
            return None  # it came back and sent more
        if last_update_at is None:
            # The simulator asks when the N-th update arrives: remember the earliest such time.
            last_update_at = min(self._left_at.get(client, t), t)
            self._left_at[client] = last_update_at
        return (last_update_at, last_update_at + away)

    def online(self, client: int, t: float, sent: int, last_update_at: float | None) -> bool:
        window = self._window(client, t, sent, last_update_at)
        return window is None or not window[0] <= t < window[1]

    def next_change(
        self, client: int, t: float, sent: int, last_update_at: float | None
    ) -> float | None:
        window = self._window(client, t, sent, last_update_at)
        if window is None:
            return None  # never leaves, or only its next update can make it leave
        start, end = window
        if t < start:
            return start
        return end if t < end and math.isfinite(end) else None

    def describe(self) -> dict[str, Any]:
        return {
            **self.spec,
            "clients": [
                {
                    "client": c,
                    "at_time" if self.by_time else "after_updates": (
                        self.leave[c] if self.by_time else int(self.leave[c])
                    ),
                    "return_after": self.away_for[c],
                }
                for c in sorted(self.leave)
            ],
        }
