"""Weight-only int8: asymmetric codes with a scale and zero per 32 inputs of each output channel.

At batch 1 a decode step streams every weight once, so its time is the bytes read: these
weights read ~1.25 bytes each instead of fp32's 4. Per-group ranges (rather than one per
output channel) keep the rounding error near bf16's: per-channel int8 changed the greedy text
of this 135M target on most prompts (docs/results/int8.md). A group already on a grid keeps it
(group_scales): weights that came from a 4- or 8-bit checkpoint quantize exactly. Activations,
norms, attention, the residual stream and the KV cache stay fp32.

Every product (decode, verify, prefill) runs kernels/csrc/int8_gemm.cpp, which computes every
output the same way whatever the row count, in slices of KERNEL_SLICE_ROWS rows. Without a
compiler the kernel is absent and every product dequantizes the weight for the fp32 GEMM:
correct, but slower than fp32.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from kernels import int8_cpu
from tandem.device import INT8_DTYPES

if TYPE_CHECKING:
    from tandem.engine.scale_cache import ScaleCache

WEIGHT_DTYPES = ("float32", "bfloat16", "float16", "int8", "int8-bf16")
GROUP = 32
BLOCK = 8  # output channels per packed block (kernels/csrc/int8_gemm.cpp's kBlock)
# A longer product (a prefill) runs in slices of this many rows, so a slice of x stays in cache
# while every channel tile reads it. The kernel beats dequantize + fp32 GEMM at every row count
# measured (16-2048 rows, 1 and 2 threads: 4-6x at 128 rows) and the fp32 GEMM on ready fp32
# weights too (1.4-1.8x): it reads and converts each code once per tile of 12 rows.
KERNEL_SLICE_ROWS = 512


def compute_dtype(weight_dtype: str) -> torch.dtype:
    """The dtype activations, norms and the KV cache use for a --dtype choice."""
    if weight_dtype not in WEIGHT_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(WEIGHT_DTYPES)}, got {weight_dtype!r}")
    return torch.float32 if weight_dtype in INT8_DTYPES else getattr(torch, weight_dtype)


def _group_for(in_features: int) -> int:
    # The kernel wants groups of a multiple of 8 dividing the row; else one group per row.
    return GROUP if in_features % GROUP == 0 else in_features


def group_scales(
    w: torch.Tensor,  # [rows, groups, group] float32
    lo: torch.Tensor,  # [rows, groups] the groups' minima
    hi: torch.Tensor,  # [rows, groups] maxima
) -> torch.Tensor:  # [rows, groups] float32 step between codes
    """(hi - lo) / 255, except where a group's values already sit on an evenly spaced grid of
    at most 256 levels: then the grid's own step, and the codes are exact. Weights dequantized
    from a 4- or 8-bit checkpoint do (the default target was converted from a Q4_1 GGUF, so its
    projections have 16 levels per 32-group), and min/max codes would round them a second time
    to a grid that does not line up with theirs."""
    span = hi - lo
    scale = span / 255
    ordered = w.sort(-1).values
    gaps = ordered[..., 1:] - ordered[..., :-1]
    real = gaps > 1e-6 * span[..., None]  # below this, two codes of one level (fp rounding)
    smallest = torch.where(real, gaps, torch.full_like(gaps, math.inf)).amin(-1)
    done = ~torch.isfinite(smallest)  # constant groups keep span / 255 = 0
    for j in (1, 2, 3, 4):  # the grid's step may divide the smallest gap present
        step = smallest / j
        n = (w - lo[..., None]) / step[..., None]
        fits = ((n - n.round()).abs() <= 1e-3).all(-1) & (span <= 255.001 * step) & ~done
        scale = torch.where(fits, step, scale)
        done |= fits
    return scale


def group_codes(
    weight: torch.Tensor,  # [out, in] float
    group: int,  # inputs per group (dividing in)
    multiple: int,  # out is padded with zero rows to a multiple of this
    levels: int,  # the largest code: 255, or 127 (int8-bf16's 7-bit codes)
    cache: ScaleCache | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]:
    """Codes [padded, groups, group] uint8, scale and lo (the group's minimum) [padded, groups]
    float32 with W ~= q * scale + lo, and whether that is exact up to fp32 rounding."""
    n, k = weight.shape
    padded = -(-n // multiple) * multiple
    w = torch.zeros(padded, k)
    w[:n] = weight.detach().float()
    w = w.reshape(padded, k // group, group)
    lo, hi = w.amin(-1), w.amax(-1)
    scale = group_scales(w, lo, hi) if cache is None else cache.scales(group_scales, w, lo, hi)
    if levels < 255:  # a grid of more steps than the codes hold is spaced over theirs
        scale = torch.where(hi - lo <= (levels + 1e-3) * scale, scale, (hi - lo) / levels)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # constant groups: q = 0
    q = torch.round((w - lo[..., None]) / safe[..., None]).clamp_(0, levels).to(torch.uint8)
    # The same arithmetic as dequantize(), element by element; min/max codes of an off-grid
    # group miss by up to span / (2 * levels), orders of magnitude more.
    miss = (q.float() * scale[..., None] + lo[..., None] - w).abs().max()
    return q, scale, lo, bool(miss <= 1e-5 * w.abs().max())


def check_scales(weight, want: tuple[int, ...]) -> None:
    """A packed weight's scale and zero: float32 of shape `want`, else ValueError."""
    for name in ("scale", "zero"):
        t = getattr(weight, name)
        if t.dtype != torch.float32 or tuple(t.shape) != want:
            raise ValueError(f"{name} must be float32 {list(want)}, got {t.dtype} "
                             f"{list(t.shape)}")


@dataclass(frozen=True, eq=False)
class Int8Weight:
    """W ~= q * scale + zero per group; stands in for a [out, in] float weight in LinearRouter.

    Packed as the kernel reads it: blocks of BLOCK output channels (out_features padded up to a
    multiple), group by group, input by input: the BLOCK channels' codes of one input are
    adjacent bytes, one vector once converted."""

    q: torch.Tensor  # [blocks, in // group, group, BLOCK] uint8 codes
    scale: torch.Tensor  # [blocks, in // group, BLOCK] float32, >= 0 (group_scales)
    zero: torch.Tensor  # [blocks, in // group, BLOCK] float32 (the group's minimum)
    out_features: int
    # Whether the codes reproduce the float weight it was quantized from, up to fp32 rounding
    # (every group already on a grid of <= 256 levels, as a 4- or 8-bit checkpoint's are).
    exact: bool = False

    def __post_init__(self):
        if self.q.dtype != torch.uint8 or self.q.dim() != 4 or self.q.shape[3] != BLOCK:
            raise ValueError(f"q must be uint8 [blocks, groups, group, {BLOCK}], got "
                             f"{self.q.dtype} {list(self.q.shape)}")
        blocks = self.q.shape[0]
        if not (blocks - 1) * BLOCK < self.out_features <= blocks * BLOCK:
            raise ValueError(f"out_features {self.out_features} does not fit {blocks} blocks")
        check_scales(self, (*self.q.shape[:2], BLOCK))

    @classmethod
    def quantize(cls, weight: torch.Tensor,  # [out, in] float
                 cache: ScaleCache | None = None) -> Int8Weight:
        q, scale, lo, exact = group_codes(weight, _group_for(weight.shape[1]), BLOCK, 255, cache)

        def pack(t):  # [padded, groups, ...] -> [blocks, groups, ..., BLOCK]
            return t.reshape(-1, BLOCK, *t.shape[1:]).movedim(1, -1).contiguous()

        return cls(pack(q), pack(scale), pack(lo), weight.shape[0], exact)

    @property
    def group(self) -> int:
        return self.q.shape[2]

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.out_features, self.q.shape[1] * self.group))

    @property
    def device(self) -> torch.device:
        return self.q.device

    @property
    def nbytes(self) -> int:  # as torch.Tensor.nbytes, so callers can sum either
        return self.q.numel() + 4 * (self.scale.numel() + self.zero.numel())

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:  # [out, in]
        w = self.q.float() * self.scale[:, :, None] + self.zero[:, :, None]  # [b, g, G, BLOCK]
        return w.permute(0, 3, 1, 2).reshape(-1, self.shape[1])[:self.out_features].to(dtype)

    def linear(
        self,
        x: torch.Tensor,  # [rows, in_features] float
        bias: torch.Tensor | None = None,  # [out_features]
        invariant: bool = False,
    ) -> torch.Tensor:  # [rows, out_features] in x.dtype
        """invariant: the C++ kernel or an error, never the dequantizing fallback, so every row
        is computed the same way whatever the row count."""
        if x.dim() == 2 and x.shape[0] > KERNEL_SLICE_ROWS and self._kernel(x) is not None:
            parts = [self.linear(part, None, invariant) for part in x.split(KERNEL_SLICE_ROWS)]
            out = torch.cat(parts)
            return out if bias is None else out + bias
        kernel = self._kernel(x)
        if kernel is None:
            if invariant:
                raise RuntimeError("batch-invariant int8 needs the C++ kernel, which did "
                                   "not build here (no compiler?)")
            return F.linear(x, self.dequantize(x.dtype), bias)
        out = kernel.int8_gemm(x.float().contiguous(), self.q, self.scale, self.zero,
                               self.out_features)
        out = out.to(x.dtype)
        return out if bias is None else out + bias

    def _kernel(self, x: torch.Tensor):
        if x.dim() != 2 or x.device.type != "cpu" or self.group % 8:
            return None
        return int8_cpu.load()
