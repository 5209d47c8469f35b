"""Argument checks for kernels/rejection.py's rejection_sample: shapes, offsets, id ranges and
that every probability row is a distribution. They raise ValueError; they never fix anything up.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels.rejection_types import DraftProbs, SparseDraftProbs

# Float32 softmax rows sum to 1 within ~1e-6; anything this far off is not a distribution.
_SUM_TOL = 1e-3


def _check_distribution(name: str, probs: torch.Tensor) -> None:
    sums = probs.float().sum(dim=-1)
    if not torch.isfinite(probs).all() or (probs < 0).any():
        raise ValueError(f"{name} must be finite and non-negative")
    bad = (sums - 1).abs() > _SUM_TOL
    if bad.any():
        row = int(bad.nonzero()[0])
        raise ValueError(f"{name} row {row} sums to {float(sums[row]):.6f}, not 1")


def _check_offsets(cu: torch.Tensor, num_draft_tokens: int) -> None:
    if cu.ndim != 1 or cu.shape[0] < 1 or cu.is_floating_point():
        raise ValueError(f"cu_num_draft_tokens must be a 1-D integer tensor, got {cu.shape}")
    if int(cu[0]) != 0:
        raise ValueError(f"cu_num_draft_tokens must start at 0, got {int(cu[0])}")
    if (cu[1:] < cu[:-1]).any():
        raise ValueError(f"cu_num_draft_tokens must be non-decreasing, got {cu.tolist()}")
    if int(cu[-1]) != num_draft_tokens:
        raise ValueError(
            f"cu_num_draft_tokens ends at {int(cu[-1])}, "
            f"but there are {num_draft_tokens} draft tokens"
        )


def _check_draft_probs(draft_probs: DraftProbs, num_draft_tokens: int, vocab: int) -> None:
    if not (draft_probs is None or isinstance(draft_probs, (SparseDraftProbs, torch.Tensor))):
        raise ValueError("draft_probs must be None, SparseDraftProbs or a tensor, got "
                         f"{type(draft_probs).__name__}")
    if isinstance(draft_probs, SparseDraftProbs):
        ids = draft_probs.token_ids
        if ids.shape[0] != num_draft_tokens:
            raise ValueError(
                f"sparse draft probs have {ids.shape[0]} rows, expected {num_draft_tokens}"
            )
        if ids.numel() and (ids.min() < 0 or ids.max() >= vocab):
            raise ValueError(f"sparse draft token ids must be in [0, {vocab})")
        _check_distribution("sparse draft probs", draft_probs.probs)
    elif isinstance(draft_probs, torch.Tensor):
        if tuple(draft_probs.shape) != (num_draft_tokens, vocab):
            raise ValueError(
                f"dense draft probs must be [{num_draft_tokens}, {vocab}], "
                f"got {tuple(draft_probs.shape)}"
            )
        _check_distribution("dense draft probs", draft_probs)


def validate_inputs(
    draft_token_ids: torch.Tensor,  # [T]
    cu: torch.Tensor,  # [B + 1]
    target_probs: torch.Tensor,  # [T + B, V]
    draft_probs: DraftProbs,
    is_greedy: torch.Tensor,  # [B]
    generators: Sequence[torch.Generator | None] | None,
    sample_bonus: torch.Tensor | None,  # [B]
) -> None:
    if draft_token_ids.ndim != 1 or draft_token_ids.is_floating_point():
        raise ValueError(f"draft_token_ids must be 1-D integer, got {draft_token_ids.shape}")
    num_draft_tokens = draft_token_ids.shape[0]
    _check_offsets(cu, num_draft_tokens)
    batch_size = cu.shape[0] - 1
    if target_probs.ndim != 2 or target_probs.shape[0] != num_draft_tokens + batch_size:
        raise ValueError(
            f"target_probs must be [num_draft_tokens + batch_size = "
            f"{num_draft_tokens + batch_size}, vocab], got {tuple(target_probs.shape)}"
        )
    vocab = target_probs.shape[1]
    if num_draft_tokens and (draft_token_ids.min() < 0 or draft_token_ids.max() >= vocab):
        raise ValueError(f"draft token ids must be in [0, {vocab}), got "
                         f"[{int(draft_token_ids.min())}, {int(draft_token_ids.max())}]")
    _check_distribution("target_probs", target_probs)
    _check_draft_probs(draft_probs, num_draft_tokens, vocab)
    for name, t in (("is_greedy", is_greedy), ("sample_bonus", sample_bonus)):
        if name == "sample_bonus" and t is None:
            continue
        if not isinstance(t, torch.Tensor) or t.dtype != torch.bool or t.shape != (batch_size,):
            got = f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}"
            raise ValueError(f"{name} must be a bool tensor [{batch_size}], got {got}")
    if generators is not None and len(generators) != batch_size:
        raise ValueError(f"generators has {len(generators)} entries, batch has {batch_size}")
