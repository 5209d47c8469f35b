"""x @ W.T for the small row counts of decoding, routed to whichever BLAS layout is faster.

On CPU, a product with few rows hits very different kernels depending on the layout: a 1-row
F.linear runs as gemv at ~10 GB/s, `W @ x.T` with 2..16 rows streams W up to 3x faster, but
for some shapes (e.g. SmolLM2's 576x1536 down projection at 1 thread) it is 2x slower than
F.linear from 3 rows on. So the model measures both per (weight shape, rows) once at load
time, on this machine and thread count, and routes accordingly.
"""
from __future__ import annotations

import time
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from tandem.engine.quant import Int8Weight

MAX_ROUTED_ROWS = 16  # beyond this (prefill) F.linear wins everywhere we measured


def _bucket(m: int) -> int:
    return m if m <= 8 else MAX_ROUTED_ROWS  # 9..15 rows run padded to 16


def _padded_rows(m: int) -> int:
    # 1 row and 9..15 rows are slower in `W @ x.T` than 2 and 16 rows: pad up.
    return 2 if m == 1 else MAX_ROUTED_ROWS if m > 8 else m


def mm_transposed(
    x: torch.Tensor,  # [m, in_features]
    weight: torch.Tensor,  # [out_features, in_features]
    bias: torch.Tensor | None = None,  # [out_features]
) -> torch.Tensor:  # [m, out_features]
    m = x.shape[0]
    padded = _padded_rows(m)
    if padded != m:
        x = torch.cat([x, x[:1].expand(padded - m, -1)])
    out = torch.mm(weight, x.t())[:, :m].t().contiguous()
    return out if bias is None else out + bias


class LinearRouter:
    """Chooses F.linear or mm_transposed per (out, in, rows); F.linear until tuned."""

    def __init__(self):
        self.use_mm: dict[tuple[int, int, int], bool] = {}

    def __call__(self, x: torch.Tensor, weight: torch.Tensor | Int8Weight,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
        if isinstance(weight, Int8Weight):
            return weight.linear(x, bias)
        m = x.shape[0]
        if m <= MAX_ROUTED_ROWS and self.use_mm.get((*weight.shape, _bucket(m)), False):
            return mm_transposed(x, weight, bias)
        return F.linear(x, weight, bias)

    def tune(self, weights_by_shape: Sequence[Sequence[torch.Tensor]],
             rows: Sequence[int] = (*range(1, 9), MAX_ROUTED_ROWS)) -> None:
        """Time both layouts over every copy of each shape (cold caches, like a forward)."""
        for copies in weights_by_shape:
            if isinstance(copies[0], Int8Weight) or copies[0].device.type != "cpu":
                continue
            for m in rows:
                x = torch.randn(m, copies[0].shape[1], dtype=copies[0].dtype)
                t_linear = _best_of(lambda: [F.linear(x, w) for w in copies])  # noqa: B023
                t_mm = _best_of(lambda: [mm_transposed(x, w) for w in copies])  # noqa: B023
                self.use_mm[(*copies[0].shape, m)] = t_mm < t_linear


def _best_of(fn, reps: int = 2) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best
