"""A round's drafts as one metadata object for the batched rejection sampler (vLLM's
SpecDecodeMetadata idea): built once from the scheduled inputs, handed whole to kernels/.

Layout is the flattened batch of kernels/rejection.py: sequence i owns draft tokens
cu[i]:cu[i+1] and target rows cu[i] + i .. cu[i+1] + i (one per draft, then the bonus row).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kernels.rejection import rejection_sample
from kernels.rejection_types import RejectionOutput, SparseDraftProbs
from kernels.sampling import keyed_seed, make_generator
from tandem.sampling_params import SamplingParams
from tandem.spec import DraftToken


def is_chain(parents: Sequence[int] | None) -> bool:
    """None or (-1, 0, 1, ...): each draft continues the one before (the chain case)."""
    return parents is None or all(p == i - 1 for i, p in enumerate(parents))


@dataclass(frozen=True)
class SpecDecodeMetadata:
    draft_token_ids: torch.Tensor  # [num_draft_tokens] int64, sequences concatenated
    cu_num_draft_tokens: torch.Tensor  # [batch_size + 1] int64, cu[0] = 0
    draft_probs: SparseDraftProbs | None  # sparse q per draft; None: every q one-hot
    is_greedy: torch.Tensor  # [batch_size] bool
    sample_bonus: torch.Tensor  # [batch_size] bool, False: carry the bonus row instead
    generators: list[torch.Generator | None]  # [batch_size], seeded sessions only

    @property
    def batch_size(self) -> int:
        return self.cu_num_draft_tokens.shape[0] - 1

    @classmethod
    def build(cls, drafts: list[list[DraftToken]], sampling: list[SamplingParams],
              first_sampled_pos: list[int], sample_bonus: list[bool]) -> SpecDecodeMetadata:
        """Per sequence: its drafts, its sampling params, the absolute position of its first
        sampled token (keys a seeded sequence's randomness, so it does not depend on the
        round's shape or the prefix cache), and whether a bonus token may be sampled."""
        counts = torch.tensor([0] + [len(d) for d in drafts], dtype=torch.int64)
        return cls(
            draft_token_ids=torch.tensor([t.token_id for d in drafts for t in d],
                                         dtype=torch.int64),
            cu_num_draft_tokens=torch.cumsum(counts, 0),
            draft_probs=_sparse_q([t for d in drafts for t in d]),
            is_greedy=torch.tensor([s.is_greedy for s in sampling], dtype=torch.bool),
            sample_bonus=torch.tensor(sample_bonus, dtype=torch.bool),
            generators=[None if s.seed is None else make_generator(keyed_seed(s.seed, pos))
                        for s, pos in zip(sampling, first_sampled_pos)])


def _sparse_q(drafts: list[DraftToken]) -> SparseDraftProbs | None:
    """Sparse q for the batch; one-hot rows (greedy, n-gram) padded with zero-mass ids."""
    if all(not d.q_ids for d in drafts):
        return None
    width = max(len(d.q_ids) or 1 for d in drafts)
    ids = torch.empty(len(drafts), width, dtype=torch.int64)
    probs = torch.zeros(len(drafts), width, dtype=torch.float32)
    for row, d in enumerate(drafts):
        q_ids, q_probs = (d.q_ids, d.q_probs) if d.q_ids else ((d.token_id,), (1.0,))
        ids[row] = d.token_id
        ids[row, : len(q_ids)] = torch.tensor(q_ids)
        probs[row, : len(q_probs)] = torch.tensor(q_probs)
    return SparseDraftProbs(ids, probs / probs.sum(-1, keepdim=True))


def verify(
    meta: SpecDecodeMetadata,
    target_probs: torch.Tensor,  # [num_draft_tokens + batch_size, vocab] after sampling params
) -> RejectionOutput:
    """Accepted, recovered and bonus tokens for every sequence, losslessly."""
    return rejection_sample(
        draft_token_ids=meta.draft_token_ids, cu_num_draft_tokens=meta.cu_num_draft_tokens,
        target_probs=target_probs, draft_probs=meta.draft_probs, is_greedy=meta.is_greedy,
        generators=meta.generators, sample_bonus=meta.sample_bonus)
