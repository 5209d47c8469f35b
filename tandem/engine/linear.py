"""x @ W.T for the small row counts of decoding, routed to whichever BLAS layout is faster.

On CPU, a product with few rows hits very different kernels depending on the layout: a 1-row
F.linear runs as gemv at ~10 GB/s, `W @ x.T` with 2..16 rows streams W up to 3x faster, but
for some shapes (e.g. SmolLM2's 576x1536 down projection at 1 thread) it is 2x slower than
F.linear from 3 rows on. So the model measures both per (weight shape, rows) on this
machine and thread count (once: tandem.engine.tune_cache keeps the answer) and routes
accordingly.
"""
from __future__ import annotations

import time
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from tandem.engine.quant import Int8Weight
from tandem.engine.quant_bf16 import Int8Bf16Weight
from tandem.engine.tune_cache import TuneCache

QUANTIZED = (Int8Weight, Int8Bf16Weight)  # each computes its own products (.linear)

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


def invariant_linear(
    x: torch.Tensor,  # [m, in_features]
    weight: torch.Tensor,  # [out_features, in_features]
    bias: torch.Tensor | None,  # [out_features]
    min_rows: int,
) -> torch.Tensor:  # [m, out_features]
    """F.linear with at least `min_rows` rows: from there on (measured_invariant_rows) the BLAS
    computes each output row the same way whatever the row count, so a row's result depends
    on that row alone, not on what else shares its batch."""
    m = x.shape[0]
    if m < min_rows:
        x = torch.cat([x, x.new_zeros(min_rows - m, x.shape[1])])
    out = F.linear(x, weight)[:m]
    return out if bias is None else out + bias


def measure_invariant_rows(weights: Sequence[torch.Tensor], probe_rows: int = 48,
                           reference_rows: int = 160) -> int:
    """The fewest rows from which F.linear gives every row bit-identically to a large
    product, for each of these weight shapes (on this machine, BLAS and thread count: the
    small-row paths, gemv and thread splits, reduce in other orders). 0 if none up to
    probe_rows does, i.e. padding cannot make this BLAS batch-invariant."""
    needed = 1
    for w in weights:
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(reference_rows, w.shape[1], generator=gen).to(w.dtype)
        ref = F.linear(x, w)
        bad = [m for m in range(1, probe_rows + 1) if not torch.equal(F.linear(x[:m], w),
                                                                     ref[:m])]
        if bad and bad[-1] == probe_rows:
            return 0
        needed = max(needed, bad[-1] + 1 if bad else 1)
    return needed


class LinearRouter:
    """Chooses F.linear or mm_transposed per (out, in, rows); F.linear until tuned.

    `invariant_rows` > 0 is batch-invariant mode: every product runs invariant_linear (one
    layout, padded to that many rows), so a row's output does not depend on the batch."""

    def __init__(self, invariant_rows: int = 0):
        self.use_mm: dict[tuple[int, int, int], bool] = {}
        self.invariant_rows = invariant_rows

    def __call__(self, x: torch.Tensor, weight: torch.Tensor | Int8Weight | Int8Bf16Weight,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
        if isinstance(weight, QUANTIZED):
            return weight.linear(x, bias, invariant=self.invariant_rows > 0)
        if self.invariant_rows:
            return invariant_linear(x, weight, bias, self.invariant_rows)
        m = x.shape[0]
        if m <= MAX_ROUTED_ROWS and self.use_mm.get((*weight.shape, _bucket(m)), False):
            return mm_transposed(x, weight, bias)
        return F.linear(x, weight, bias)

    def tune(self, weights_by_shape: Sequence[Sequence[torch.Tensor]],
             rows: Sequence[int] = (*range(1, 9), MAX_ROUTED_ROWS),
             cache: TuneCache | None = None) -> None:
        """Time both layouts over every copy of each shape (cold caches, like a forward), or
        take what `cache` kept from an earlier load on this machine."""
        measured: dict[str, dict[int, bool]] = {}
        for copies in weights_by_shape:
            if isinstance(copies[0], QUANTIZED) or copies[0].device.type != "cpu":
                continue
            key = TuneCache.key(copies[0], len(copies))
            kept = cache.get(key) if cache is not None else None
            if kept is None or not set(rows) <= set(kept):
                kept = measured[key] = {m: self._mm_is_faster(copies, m) for m in rows}
            for m in rows:
                self.use_mm[(*copies[0].shape, m)] = kept[m]
        if cache is not None:
            cache.put(measured)

    @staticmethod
    def _mm_is_faster(copies: Sequence[torch.Tensor], m: int) -> bool:
        x = torch.randn(m, copies[0].shape[1], dtype=copies[0].dtype)
        t_linear = _best_of(lambda: [F.linear(x, w) for w in copies])
        t_mm = _best_of(lambda: [mm_transposed(x, w) for w in copies])
        return t_mm < t_linear


def _best_of(fn, reps: int = 2) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best
