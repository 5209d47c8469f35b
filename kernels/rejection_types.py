"""The rejection sampler's argument and result types (the layout is in kernels/rejection.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

PLACEHOLDER_TOKEN_ID = -1


@dataclass(frozen=True)
class SparseDraftProbs:
    """Top-N truncated draft distribution q per draft token (what the wire carries)."""

    token_ids: torch.Tensor  # [num_draft_tokens, N] int64
    probs: torch.Tensor  # [num_draft_tokens, N] float32, rows sum to 1

    def __post_init__(self) -> None:
        ids, probs = self.token_ids, self.probs
        if ids.ndim != 2 or ids.shape != probs.shape or ids.is_floating_point() or \
                not probs.is_floating_point():
            raise ValueError(
                "SparseDraftProbs needs integer token_ids and float probs, both "
                f"[num_draft_tokens, N]; got {ids.dtype} {tuple(ids.shape)} and "
                f"{probs.dtype} {tuple(probs.shape)}"
            )


@dataclass(frozen=True)
class RejectionOutput:
    # accepted drafts, then the recovered or bonus token; PLACEHOLDER_TOKEN_ID padded
    # (longest_draft: the most drafts any sequence of the batch has)
    output_token_ids: torch.Tensor  # [batch_size, longest_draft + 1] int64
    num_accepted: torch.Tensor  # [batch_size] int64, draft tokens accepted per sequence
    num_emitted: torch.Tensor  # [batch_size] int64, tokens written per sequence


DraftProbs = SparseDraftProbs | torch.Tensor | None
