"""Grammar bitmasks applied to logits: forbidden tokens get -inf before the sampling
parameters, so every distribution the verifier samples or verifies from is the target's
masked and renormalised (plain constrained sampling's)."""
from __future__ import annotations

import torch


def allowed(
    bitmask: torch.Tensor,  # [rows, words] int32, bit t % 32 of word t // 32 = token t
    vocab_size: int,
) -> torch.Tensor:
    """[rows, vocab_size] bool."""
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    return ((bitmask.unsqueeze(-1) >> bits) & 1).bool().flatten(1)[:, :vocab_size]


def apply_masks(
    logits: torch.Tensor,  # [sum(rows_i), vocab] the step's logits, inputs in order
    masks: list[torch.Tensor | None],  # per input: [rows_i, words] bitmask, or None = free
    rows: list[int],  # rows_i of each input
) -> torch.Tensor:
    """The logits with every masked input's forbidden tokens at -inf (a copy: the raw
    logits still serve logprobs); the same tensor when no input has a grammar."""
    if all(m is None for m in masks):
        return logits
    out, at = logits.clone(), 0
    for m, n in zip(masks, rows):
        if m is not None and n:
            ok = allowed(m[-n:].to(logits.device), logits.shape[-1])
            out[at:at + n].masked_fill_(~ok, float("-inf"))
        at += n
    return out


def mask_drafts(
    logits: torch.Tensor,  # [rows, vocab] a draft's logits, one row per request
    masks: list[torch.Tensor | None],  # per row: [1, words] bitmask, or None = free
) -> torch.Tensor:
    """A draft's rows masked by their grammars, except a row whose draft vocabulary has none
    of the allowed tokens (EAGLE drafts from its commonest tokens only): left free, since the
    verifier masks the target either way and a draft of nothing cannot be sampled."""
    out = apply_masks(logits, masks, [1] * len(masks))
    if out is logits:
        return logits
    empty = torch.isinf(out).all(-1) & ~torch.isinf(logits).all(-1)  # [rows]
    if bool(empty.any()):
        out[empty] = logits[empty]
    return out
