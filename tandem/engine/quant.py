"""Weight-only int8: per-output-channel symmetric scales, for memory-bound decoding on CPU.

At batch 1 a decode step streams every weight once, so its time is the bytes read: int8 reads a
quarter of fp32. The matmul is torch's `_weight_int8pack_mm` with bfloat16 activations (its
fp32-activation path is scalar and 2-20x slower than fp32 here; the bf16 one is vectorised).
Activations are rounded to bf16 only inside the product; everything between products (norms,
rotary, attention, the residual stream, the KV cache) stays fp32. Past MAX_PACKED_ROWS rows
(prefill) the kernel loses to fp32 GEMM, so those products run the same arithmetic as one fp32
GEMM instead (bit-identical in our checks, so greedy output does not depend on batch shape).

Scales are rounded to bf16 *before* quantizing, so the kernel's bf16 scales are exact and no
channel carries a systematic gain error.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

WEIGHT_DTYPES = ("float32", "bfloat16", "float16", "int8")
MAX_PACKED_ROWS = 16  # measured: int8pack beats fp32 F.linear up to ~16 rows at 1-2 threads
# The CPU kernel reads K in steps of 8 with no tail: other widths return garbage or crash.
PACK_K_MULTIPLE = 8
_ACT = torch.bfloat16


def compute_dtype(weight_dtype: str) -> torch.dtype:
    """The dtype activations, norms and the KV cache use for a --dtype choice."""
    if weight_dtype not in WEIGHT_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(WEIGHT_DTYPES)}, got {weight_dtype!r}")
    return torch.float32 if weight_dtype == "int8" else getattr(torch, weight_dtype)


@dataclass(frozen=True, eq=False)
class Int8Weight:
    """W ~= q * scale[:, None]; stands in for a [out, in] float weight in LinearRouter."""

    q: torch.Tensor  # [out_features, in_features] int8, in [-127, 127]
    scale: torch.Tensor  # [out_features] bfloat16, > 0

    def __post_init__(self):
        if self.q.dtype != torch.int8 or self.q.dim() != 2:
            raise ValueError(f"q must be a 2-D int8 tensor, got {self.q.dtype} {self.q.shape}")
        if self.scale.shape != self.q.shape[:1] or self.scale.dtype != _ACT:
            raise ValueError(f"scale must be [{self.q.shape[0]}] bfloat16")

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Int8Weight:  # weight: [out, in] float
        w = weight.detach().float()
        scale = (w.abs().amax(dim=1) / 127).clamp_min(1e-12).to(_ACT)
        q = torch.round(w / scale.float()[:, None]).clamp_(-127, 127).to(torch.int8)
        return cls(q.contiguous(), scale.contiguous())

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    @property
    def device(self) -> torch.device:
        return self.q.device

    @property
    def packable(self) -> bool:
        return self.q.shape[1] % PACK_K_MULTIPLE == 0

    @property
    def nbytes(self) -> int:  # as torch.Tensor.nbytes, so callers can sum either
        return self.q.numel() + 2 * self.scale.numel()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:  # [out, in]
        return (self.q.to(dtype) * self.scale.to(dtype)[:, None]).contiguous()

    def linear(
        self,
        x: torch.Tensor,  # [rows, in_features] float
        bias: torch.Tensor | None = None,  # [out_features]
    ) -> torch.Tensor:  # [rows, out_features] in x.dtype
        xb = x.to(_ACT).contiguous()
        if x.shape[0] <= MAX_PACKED_ROWS and x.device.type == "cpu" and self.packable:
            out = torch._weight_int8pack_mm(xb, self.q, self.scale)
        else:
            out = self._emulated(xb)
        out = out.to(x.dtype)
        return out if bias is None else out + bias

    def _emulated(self, xb: torch.Tensor) -> torch.Tensor:  # [rows, in] bf16 -> [rows, out] bf16
        """The packed kernel's arithmetic as one fp32 GEMM: bf16 inputs times int8 (exact
        products), fp32 sums, the scale, then bf16. Same numbers whatever the row count, so a
        token's logits do not depend on whether it was prefilled, decoded or verified."""
        out = F.linear(xb.float(), self.q.float()) * self.scale.float()
        return out.to(_ACT)


def quantize_int8(weight: torch.Tensor | Int8Weight) -> Int8Weight:
    return weight if isinstance(weight, Int8Weight) else Int8Weight.quantize(weight)
