"""The sampling controls' logits processors (vLLM's meanings), as tensor operations on rows
of logits. verify_service/forward/controls.py decides which rows see which prefix and calls
these in vLLM's order: allowed tokens, banned tokens (bad words, min_tokens), logit bias,
then the penalties; temperature, min-p, top-k and top-p follow in kernels/sampling.py.
"""
from __future__ import annotations

import torch

NEG_INF = float("-inf")


def allow_only(
    logits: torch.Tensor,  # [R, V] float, modified in place
    allowed: torch.Tensor,  # [V] bool, True: the token may be sampled
) -> torch.Tensor:  # [R, V] the same tensor
    """Every token outside `allowed` at -inf."""
    return logits.masked_fill_(~allowed.to(logits.device)[None, :], NEG_INF)


def ban(
    logits: torch.Tensor,  # [R, V] float, modified in place
    rows: torch.Tensor,  # [N] int64 row of each banned token
    tokens: torch.Tensor,  # [N] int64 the banned token ids
) -> torch.Tensor:  # [R, V] the same tensor
    """logits[rows[i], tokens[i]] = -inf for every i."""
    if rows.numel():
        logits[rows.to(logits.device), tokens.to(logits.device)] = NEG_INF
    return logits


def add_bias(
    logits: torch.Tensor,  # [R, V] float, modified in place
    tokens: torch.Tensor,  # [N] int64 distinct token ids
    bias: torch.Tensor,  # [N] float32 added to those tokens' logits in every row
) -> torch.Tensor:  # [R, V] the same tensor
    if tokens.numel():
        tokens = tokens.to(logits.device)
        logits[:, tokens] += bias.to(logits.device, logits.dtype)[None, :]
    return logits


def apply_penalties(
    logits: torch.Tensor,  # [R, V] float
    prompt_mask: torch.Tensor,  # [R, V] bool, the token occurs in the row's prompt
    output_counts: torch.Tensor,  # [R, V] int, the token's count in the row's output
    presence: torch.Tensor,  # [R] float32, 0 = off
    frequency: torch.Tensor,  # [R] float32, 0 = off
    repetition: torch.Tensor,  # [R] float32, 1 = off
) -> torch.Tensor:  # [R, V] float32, a new tensor
    """vLLM's penalties: repetition over the prompt's and the output's tokens (a positive
    logit divided by it, any other multiplied), then frequency and presence over the
    output's: logit -= frequency * count + presence * (count > 0)."""
    logits = logits.float()
    dev = logits.device
    counts = output_counts.to(dev, torch.float32)
    seen = prompt_mask.to(dev) | (counts > 0)
    r = repetition.to(dev, torch.float32)[:, None].expand_as(logits)
    scaled = torch.where(logits > 0, logits / r, logits * r)
    logits = torch.where(seen, scaled, logits)
    logits = logits - frequency.to(dev, torch.float32)[:, None] * counts
    return logits - presence.to(dev, torch.float32)[:, None] * (counts > 0).float()


def apply_min_p(
    logits: torch.Tensor,  # [R, V] float, already divided by the temperature
    min_p: torch.Tensor,  # [R] float32 in [0, 1], 0 = off
) -> torch.Tensor:  # [R, V] a new tensor, or the same when every row is off
    """Drop (-inf) each token whose probability is below min_p times the row's largest."""
    min_p = min_p.to(logits.device, torch.float32)
    if not bool((min_p > 0).any()):
        return logits
    probs = logits.float().softmax(dim=-1)
    floor = probs.amax(dim=-1, keepdim=True) * min_p[:, None]
    return logits.masked_fill(probs < floor, NEG_INF)
