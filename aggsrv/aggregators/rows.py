"""The rows a strategy keeps for a robust aggregator: a [capacity, D] float32 buffer grown in
blocks, each counted row with its float64 weight. A row is written into :meth:`RowBuffer.slot`
(not yet counted: it holds nothing of the state), checked, and counted by :meth:`commit`, so a
refused update leaves the buffer as it was."""

from __future__ import annotations

import torch

__all__ = ["ROW_BLOCK", "RowBuffer"]

ROW_BLOCK = 8  # rows added at a time when the buffer is full


class RowBuffer:
    """Counted rows ``rows`` [n, D] (float32) and their ``weights`` (n floats)."""

    def __init__(self, dim: int, device: torch.device, capacity: int = 0) -> None:
        self.dim = dim
        self.device = device
        self._data = torch.zeros(capacity, dim, dtype=torch.float32, device=device)
        self.weights: list[float] = []

    def __len__(self) -> int:
        return len(self.weights)

    @property
    def rows(self) -> torch.Tensor:
        """The counted rows, a view [n, D]."""
        return self._data[: len(self.weights)]

    @property
    def nbytes(self) -> int:
        """Bytes the buffer holds (its capacity, not only the counted rows)."""
        return self._data.numel() * self._data.element_size()

    def slot(self) -> torch.Tensor:
        """The [D] row after the counted ones, growing the buffer if full; its content is
        whatever was there (the caller overwrites it)."""
        n = len(self.weights)
        if n >= self._data.shape[0]:
            grown = torch.zeros(n + ROW_BLOCK, self.dim, dtype=torch.float32, device=self.device)
            grown[:n].copy_(self._data[:n])
            self._data = grown
        return self._data[n]

    def with_slot(self, weight: float) -> tuple[torch.Tensor, list[float]]:
        """The counted rows plus the slot (written, not yet counted) and their weights: what an
        aggregation that this row triggers combines."""
        n = len(self.weights)
        return self._data[: n + 1], [*self.weights, float(weight)]

    def commit(self, weight: float) -> None:
        """Count the slot's row with ``weight``."""
        self.slot()  # the slot exists (a caller that wrote it got it from here)
        self.weights.append(float(weight))

    def clear(self) -> None:
        """Forget every row (the memory stays for the next ones)."""
        self.weights = []

    def state(self) -> dict[str, object]:
        """The counted rows and weights (the caller clones tensors)."""
        return {"rows": self.rows, "weights": list(self.weights)}

    def load(self, state: object, what: str) -> None:
        """Restore :meth:`state` (a missing one, from a state saved without rows: empty)."""
        if state is None:
            self.clear()
            return
        assert isinstance(state, dict)
        rows, weights = state["rows"], [float(w) for w in state["weights"]]
        if tuple(rows.shape) != (len(weights), self.dim):
            raise ValueError(
                f"saved {what} has shape {tuple(rows.shape)} for {len(weights)} weights, "
                f"D={self.dim}"
            )
        if rows.shape[0] > self._data.shape[0]:
            self._data = torch.zeros(rows.shape[0], self.dim, dtype=torch.float32,
                                     device=self.device)  # fmt: skip
        self._data[: rows.shape[0]].copy_(rows)
        self.weights = weights
