"""`--dtype int8-bf16`: int8 weights (as tandem.engine.quant) times bf16-rounded activations.

On one CPU core an fp32 product peaks near 90 GFLOP/s, which bounds every forward of more than
a few rows: a prefill, a verify, a batch of sessions. AVX512-BF16's vdpbf16ps does twice the
products per instruction, so kernels/csrc/int8_bf16_gemm.cpp rounds each row of activations
to bf16 (round to nearest even) and keeps everything else: codes and scales are exact as in
`--dtype int8`, products are exact, sums are fp32, and norms, attention, the residual stream
and the KV cache stay fp32. The cost is the activations' rounding, 2^-9 of each value
(docs/results/int8.md measures the greedy text it moves). Codes are 7-bit here (<= 128 levels
per group: the kernel's cheap conversion needs it), so a group off any grid of <= 128 levels
rounds to 127 steps instead of 255; a weight exact in 8 bits only stays Int8Weight.

Rows are batch-invariant as in int8: every row runs the same instructions whatever the batch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kernels import int8_cpu
from tandem.engine.quant import GROUP, KERNEL_SLICE_ROWS, Int8Weight, check_scales, group_codes
from tandem.models import ModelError

if TYPE_CHECKING:
    from tandem.engine.scale_cache import ScaleCache

TILE = 16  # output channels per packed tile (kernels/csrc/int8_bf16_gemm.cpp's kChannels)
LEVELS = 127  # steps between the smallest and largest code of a group


@dataclass(frozen=True, eq=False)
class Int8Bf16Weight:
    """W = scale * (q - center) + zero per group; stands in for a [out, in] float weight in
    LinearRouter, as Int8Weight does."""

    q: torch.Tensor  # [tiles, in // group, group // 2, TILE, 2] uint8 codes <= LEVELS
    scale: torch.Tensor  # [tiles, in // group, TILE] float32 >= 0
    zero: torch.Tensor  # [tiles, in // group, TILE] float32: the weight at code `center`
    center: int  # the code subtracted, about half the largest code
    out_features: int
    exact: bool = False  # the codes reproduce the float weight (every group on a <= 128 grid)

    def __post_init__(self):
        if self.q.dtype != torch.uint8 or self.q.dim() != 5 or self.q.shape[3:] != (TILE, 2):
            raise ValueError(f"q must be uint8 [tiles, groups, group / 2, {TILE}, 2], got "
                             f"{self.q.dtype} {list(self.q.shape)}")
        tiles = self.q.shape[0]
        if not (tiles - 1) * TILE < self.out_features <= tiles * TILE:
            raise ValueError(f"out_features {self.out_features} does not fit {tiles} tiles")
        if not 0 <= self.center <= LEVELS:
            raise ValueError(f"center must be a code in [0, {LEVELS}], got {self.center}")
        check_scales(self, (*self.q.shape[:2], TILE))

    @classmethod
    def quantize(cls, weight: torch.Tensor,  # [out, in] float
                 cache: ScaleCache | None = None) -> Int8Bf16Weight:
        n, k = weight.shape
        if k % GROUP:
            raise ValueError(f"int8-bf16 needs in_features divisible by {GROUP}, got {k}")
        q, scale, lo, exact = group_codes(weight, GROUP, TILE, LEVELS, cache)
        center = (int(q.max()) + 1) // 2

        def pack(t):  # [padded, groups, ...] -> [tiles, groups, ..., TILE]
            return t.reshape(-1, TILE, *t.shape[1:]).movedim(1, -1).contiguous()

        # codes [padded, groups, group] -> [tiles, groups, group / 2, TILE, 2]
        codes = q.reshape(-1, TILE, k // GROUP, GROUP // 2, 2).permute(0, 2, 3, 1, 4)
        return cls(codes.contiguous(), pack(scale), pack(lo + center * scale), center, n, exact)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.out_features, self.q.shape[1] * 2 * self.q.shape[2]))

    @property
    def device(self) -> torch.device:
        return self.q.device

    @property
    def nbytes(self) -> int:
        return self.q.numel() + 4 * (self.scale.numel() + self.zero.numel())

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:  # [out, in]
        codes = self.q.permute(0, 3, 1, 2, 4).reshape(-1, self.q.shape[1], 2 * self.q.shape[2])
        scale = self.scale.movedim(-1, 1).reshape(-1, self.q.shape[1], 1)
        zero = self.zero.movedim(-1, 1).reshape(-1, self.q.shape[1], 1)
        w = (codes.float() - self.center) * scale + zero
        return w.reshape(-1, self.shape[1])[:self.out_features].to(dtype)

    def linear(
        self,
        x: torch.Tensor,  # [rows, in_features] float
        bias: torch.Tensor | None = None,  # [out_features]
        invariant: bool = False,  # always: there is one kernel and no fallback
    ) -> torch.Tensor:  # [rows, out_features] in x.dtype
        kernel = int8_cpu.load_bf16()
        if kernel is None:
            raise RuntimeError("--dtype int8-bf16 needs the AVX512-BF16 kernel, which this "
                               "machine cannot build or run")
        shape, dtype = x.shape, x.dtype
        rows = x.reshape(-1, shape[-1]).float().contiguous()
        # A prefill in slices of rows, so that a slice of x stays in cache across the tiles.
        parts = [kernel.int8_bf16_gemm(part, self.q, self.scale, self.zero, self.out_features,
                                       self.center) for part in rows.split(KERNEL_SLICE_ROWS)]
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        out = out.reshape(*shape[:-1], self.out_features).to(dtype)
        return out if bias is None else out + bias


def quantize(weight: torch.Tensor,  # [out, in] float
             cache: ScaleCache | None = None) -> Int8Bf16Weight | Int8Weight:
    """One weight for --dtype int8-bf16: Int8Bf16Weight, except a weight that 8-bit codes hold
    exactly and 7-bit ones do not (a Q8 checkpoint's, as this target's tied embedding is),
    which keeps them as Int8Weight with fp32 products rather than lose a bit, as does a weight
    whose inputs do not split into groups of 32."""
    if weight.shape[1] % GROUP:
        return Int8Weight.quantize(weight, cache)
    packed = Int8Bf16Weight.quantize(weight, cache)
    if packed.exact:
        return packed
    wide = Int8Weight.quantize(weight, cache)
    return wide if wide.exact else packed


def quantizer(weight_dtype: str):
    """The quantize function of an int8 --dtype; int8-bf16 fails here, at load, where the CPU
    cannot run it."""
    if weight_dtype != "int8-bf16":
        return Int8Weight.quantize
    if int8_cpu.load_bf16() is None:
        raise ModelError("--dtype int8-bf16 needs a CPU with AVX512-BF16 and a C++ compiler; "
                         "use --dtype int8 here")
    return quantize
