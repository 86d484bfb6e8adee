"""`mean_around_median` (kernels/robust.py) on torch-sorted columns: the greedy walk outwards
from each column's median, vectorised over the columns (keep steps of gathers). What the CPU
backend runs above its sorting networks' row count (`_cpu_order.NETWORK_MAX_K`), in chunks.
"""

from __future__ import annotations

import torch


def mean_around_median(X: torch.Tensor, keep: int, out: torch.Tensor) -> None:
    work = X if X.dtype in (torch.float32, torch.float64) else X.to(torch.float32)
    srt = work.sort(dim=0).values.to(torch.float64)
    K, D = srt.shape
    half = K // 2
    med = srt[half] if K % 2 else (srt[half - 1] + srt[half]) / 2
    lo = torch.full((D,), half, dtype=torch.int64, device=X.device)
    hi = torch.full((D,), half + 1 if K % 2 else half, dtype=torch.int64, device=X.device)
    total = srt[half].clone() if K % 2 else torch.zeros(D, dtype=torch.float64, device=X.device)
    for _ in range(keep - (K % 2)):
        left = srt.gather(0, (lo - 1).clamp_min(0)[None])[0]
        right = srt.gather(0, hi.clamp_max(K - 1)[None])[0]
        take_left = (hi >= K) | ((lo > 0) & (med - left <= right - med))
        total += torch.where(take_left, left, right)
        lo -= take_left.long()
        hi += (~take_left).long()
    out.copy_(total / keep)
