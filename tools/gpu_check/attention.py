"""Phase `attention`: the paged attention kernels side by side on three layouts (decode, a
verification chain, a token tree), for speed and for agreement with the CPU fp32 reference.

Kernels: the torch reference (kernels/paged_attention.py, SDPA over gathered pages),
FlexAttention (kernels/flex_attention.py; compiled on a GPU, its compile time reported apart)
and flash-attn where installed and the layout allows it (no trees). The fastest kernel that
agrees is reported per layout: what kernels.attention.use_kernel should be set to.
"""
from __future__ import annotations

import functools
import time

import torch

from kernels import flash, flex_attention
from kernels.paged_attention import ancestor_mask, build_attention_metadata, paged_attention
from tandem.device import synchronize
from tools.gpu_check.runner import PhaseContext
from tools.gpu_check.timing import median_ms, timed_dtype

TREE = (-1, 0, 0, 1, 1, 2, 3, 5)
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 1e-2}


def _layouts(tiny: bool) -> dict[str, tuple[int, int, int, bool]]:
    """name: (batch, new tokens per sequence, context incl. them, tree?)."""
    ctx = 64 if tiny else 2048
    big = 4 if tiny else 32
    return {"decode": (big, 1, ctx, False), "chain_q5": (big, 5, ctx, False),
            "tree_q8": (4 if tiny else 16, len(TREE), ctx, True)}


def _case(layout, shape, dtype, device, block_size: int):
    """(query, key cache, value cache, metadata) for a layout, random values, on device."""
    batch, q, ctx, tree = layout
    heads, kvh, dim = shape
    per = -(-ctx // block_size)
    gen = torch.Generator().manual_seed(0)
    kc = torch.randn(batch * per, block_size, kvh, dim, generator=gen)
    vc = torch.randn(batch * per, block_size, kvh, dim, generator=gen)
    query = torch.randn(batch * q, heads, dim, generator=gen)
    meta = build_attention_metadata([q] * batch, [ctx] * batch,
                                    [list(range(i * per, (i + 1) * per)) for i in range(batch)],
                                    block_size, [ancestor_mask(TREE)] * batch if tree else None)
    ref = paged_attention(query, kc, vc, meta, dim ** -0.5)  # the CPU fp32 reference
    placed = [t.to(device=device, dtype=dtype) for t in (query, kc, vc)]
    return (*placed, meta.to(device)), ref


def _kernels(layout, block_size: int, device) -> dict:
    out = {"reference": paged_attention}
    if flex_attention.is_available():
        out["flex"] = flex_attention.flex_paged_attention
    if (device.type == "cuda" and flash.is_available() and not layout[3]
            and block_size % flash.FLASH_BLOCK_MULTIPLE == 0):
        out["flash"] = flash.flash_paged_attention
    return out


def run(ctx: PhaseContext) -> None:
    dtype = timed_dtype(ctx)
    shape = (4, 2, 16) if ctx.tiny else (32, 8, 128)
    block_size = 256 if ctx.device.type == "cuda" and flash.is_available() else 16
    reps = 2 if ctx.tiny else 20
    ctx.result.update(dtype=str(dtype).removeprefix("torch."), heads_kv_dim=list(shape),
                      block_size=block_size, flash_installed=flash.is_available())
    rows = ctx.result.setdefault("layouts", {})
    for name, layout in _layouts(ctx.tiny).items():
        (q, kc, vc, meta), ref = _case(layout, shape, dtype, ctx.device, block_size)
        row = rows.setdefault(name, {"batch_q_context": list(layout[:3])})
        for kname, kernel in _kernels(layout, block_size, ctx.device).items():
            if ctx.out_of_time():
                return
            t0 = time.perf_counter()
            got = kernel(q, kc, vc, meta, shape[2] ** -0.5)  # first call: flex compiles
            synchronize(ctx.device)
            first_ms = (time.perf_counter() - t0) * 1e3
            diff = (got.float().cpu() - ref).abs().max().item()
            ms = median_ms(functools.partial(kernel, q, kc, vc, meta, shape[2] ** -0.5),
                           ctx.device, reps)
            row[kname] = {"ms": round(ms, 4), "first_call_ms": round(first_ms, 1),
                          "max_abs_diff": diff}
            ctx.check(f"attention/{name}/{kname}", diff < TOLERANCE[dtype], diff)
        agreeing = {k: v["ms"] for k, v in row.items()
                    if isinstance(v, dict) and v["max_abs_diff"] < TOLERANCE[dtype]}
        row["fastest"] = min(agreeing, key=agreeing.get) if agreeing else None
        ctx.log(f"  {name}: " + ", ".join(f"{k} {v:.3f} ms" for k, v in agreeing.items()))
