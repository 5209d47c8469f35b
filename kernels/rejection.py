"""Batched lossless rejection sampler over a flattened, variable-length batch.

Sequence i has k_i draft tokens at draft_token_ids[cu[i]:cu[i+1]] and owns the k_i + 1
target rows cu[i] + i .. cu[i+1] + i: one per draft position plus the bonus row. A draft token
x with draft distribution q and target p is accepted with probability min(1, p(x) / q(x)); at
the first rejection the recovered token ~ norm(max(0, p - q)) is emitted; if all k_i are
accepted, the bonus token ~ the bonus row. The emitted tokens are then distributed exactly as
the target's alone (Leviathan et al. 2023). Greedy sequences reduce to exact argmax matching.

The argument and result types are in rejection_types.py, the argument checks in
rejection_checks.py.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels.rejection_checks import validate_inputs
from kernels.rejection_types import (
    PLACEHOLDER_TOKEN_ID,
    DraftProbs,
    RejectionOutput,
    SparseDraftProbs,
)
from kernels.sampling import sample


def _draft_prob_at(
    draft_token_ids: torch.Tensor,  # [T] int64
    draft_probs: DraftProbs,
) -> torch.Tensor:  # [T] float32, q(x) for each draft token
    if draft_probs is None:  # deterministic proposer: q is one-hot at x
        return torch.ones(draft_token_ids.shape, device=draft_token_ids.device)
    if isinstance(draft_probs, SparseDraftProbs):
        match = draft_probs.token_ids == draft_token_ids[:, None]
        return (draft_probs.probs.float() * match).sum(dim=-1)
    return draft_probs.float().gather(1, draft_token_ids[:, None]).squeeze(1)


def _residual(
    p: torch.Tensor,  # [R, V] float32 target rows at the first rejection
    draft_index: torch.Tensor,  # [R] int64 index of the rejected draft token
    draft_token_ids: torch.Tensor,  # [T] int64
    draft_probs: DraftProbs,
) -> torch.Tensor:  # [R, V] float32, unnormalised max(0, p - q); p where that has no mass
    if draft_probs is None:
        residual = p.scatter(1, draft_token_ids[draft_index, None], 0.0)
    elif isinstance(draft_probs, SparseDraftProbs):
        residual = p.scatter_add(1, draft_probs.token_ids[draft_index],
                                 -draft_probs.probs[draft_index].float()).clamp_min_(0)
    else:
        residual = (p - draft_probs[draft_index].float()).clamp_min_(0)
    # Zero mass means p <= q everywhere, i.e. p == q: rejection is then a float-rounding event.
    empty = residual.sum(dim=-1, keepdim=True) <= 0
    return torch.where(empty, p, residual)  # sample() does not need normalised rows


def _uniforms(
    cu_list: list[int],
    generators: Sequence[torch.Generator | None] | None,
    device: torch.device,
) -> torch.Tensor:  # [T] float32 in [0, 1)
    u = torch.rand(cu_list[-1], device=device)
    for i, gen in enumerate(generators or ()):
        lo, hi = cu_list[i], cu_list[i + 1]
        if gen is not None and hi > lo:  # a seeded sequence draws from its own generator
            # drawn on the generator's device (the CPU), so a seed means the same on any GPU
            u[lo:hi] = torch.rand(hi - lo, generator=gen, device=gen.device).to(device)
    return u


def _accept(
    draft_token_ids: torch.Tensor,  # [T] int64
    seq_of: torch.Tensor,  # [T] int64 owning sequence
    target_probs: torch.Tensor,  # [T + B, V] float32
    draft_probs: DraftProbs,
    is_greedy: torch.Tensor,  # [B] bool
    u: torch.Tensor,  # [T] float32 uniforms
) -> torch.Tensor:  # [T] bool
    """Whether each draft token is accepted, assuming every earlier one was."""
    rows = torch.arange(draft_token_ids.shape[0], device=seq_of.device) + seq_of
    p_x = target_probs[rows, draft_token_ids]
    q_x = _draft_prob_at(draft_token_ids, draft_probs)
    stochastic = ~is_greedy[seq_of]
    if draft_probs is not None and (stochastic & (q_x <= 0)).any():
        t = int((stochastic & (q_x <= 0)).nonzero()[0])
        raise ValueError(f"draft token {t} (id {int(draft_token_ids[t])}) has q(x) = 0 in its "
                         "draft distribution: the draft cannot have sampled it")
    # u * q < p  <=>  u < p / q without dividing; u < 1 so p >= q always accepts.
    stochastic_ok = u * q_x < p_x
    greedy_ok = draft_token_ids == target_probs[rows].argmax(dim=-1)
    return torch.where(stochastic, stochastic_ok, greedy_ok)


def _first_rejection(
    accepted: torch.Tensor,  # [T] bool
    seq_of: torch.Tensor,  # [T] int64 owning sequence
    pos: torch.Tensor,  # [T] int64 position within its sequence
    num_draft: torch.Tensor,  # [B] int64
    longest_draft: int,
) -> torch.Tensor:  # [B] int64
    """Number of leading accepted drafts per sequence."""
    batch_size = num_draft.shape[0]
    rejected = torch.zeros(batch_size, longest_draft + 1, dtype=torch.int8,
                           device=num_draft.device)
    rejected[seq_of, pos] = (~accepted).to(torch.int8)
    # A sentinel just past each sequence's drafts: "all accepted" finds it.
    rejected[torch.arange(batch_size, device=num_draft.device), num_draft] = 1
    return rejected.argmax(dim=1)  # first maximum


def _final_tokens(
    target_probs: torch.Tensor,  # [T + B, V] float32
    final_rows: torch.Tensor,  # [B] int64 row of the first rejection, or the bonus row
    draft_index: torch.Tensor,  # [B] int64 the rejected draft token (valid where rejected)
    rejected: torch.Tensor,  # [B] bool
    is_greedy: torch.Tensor,  # [B] bool
    draft_token_ids: torch.Tensor,  # [T] int64
    draft_probs: DraftProbs,
    generators: Sequence[torch.Generator | None] | None,
    emit: torch.Tensor,  # [B] bool whether a final token is emitted
) -> torch.Tensor:  # [B] int64
    """Recovered token (rejected) or bonus token (all accepted) per sequence."""
    probs = target_probs[final_rows].float()  # [B, V]
    stochastic_rejected = (rejected & ~is_greedy).nonzero().squeeze(1)
    if stochastic_rejected.numel():
        probs[stochastic_rejected] = _residual(
            probs[stochastic_rejected], draft_index[stochastic_rejected],
            draft_token_ids, draft_probs)
    tokens = probs.argmax(dim=-1)  # greedy: recovered and bonus are both the argmax
    to_sample = (emit & ~is_greedy).nonzero().squeeze(1)
    if to_sample.numel():
        gens = None if generators is None else [generators[i] for i in to_sample.tolist()]
        tokens[to_sample] = sample(probs[to_sample], gens)
    return tokens


def _draft_probs_to(draft_probs: DraftProbs, device: torch.device) -> DraftProbs:
    if isinstance(draft_probs, SparseDraftProbs):  # built on the CPU from the wire
        return SparseDraftProbs(draft_probs.token_ids.to(device), draft_probs.probs.to(device))
    return None if draft_probs is None else draft_probs.to(device)


def rejection_sample(
    draft_token_ids: torch.Tensor,  # [num_draft_tokens] int64, all sequences concatenated
    cu_num_draft_tokens: torch.Tensor,  # [batch_size + 1] int64 cumulative offsets, cu[0] = 0
    target_probs: torch.Tensor,  # [num_draft_tokens + batch_size, vocab] float32
    draft_probs: DraftProbs,  # None (q one-hot) | sparse | dense [num_draft_tokens, vocab]
    is_greedy: torch.Tensor,  # [batch_size] bool
    generators: Sequence[torch.Generator | None] | None = None,  # batch_size entries
    sample_bonus: torch.Tensor | None = None,  # [batch_size] bool, None = all True
) -> RejectionOutput:
    """Verify every sequence's drafts in one vectorised pass (see the module docstring).

    target_probs are already after temperature / top-k / top-p. A sequence with 0 drafts just
    samples its bonus token (a plain decode). With sample_bonus[i] False and every draft
    accepted, no bonus is emitted: the caller carries that row into the next round to verify
    a draft token that has already arrived.
    """
    validate_inputs(draft_token_ids, cu_num_draft_tokens, target_probs, draft_probs, is_greedy,
                    generators, sample_bonus)
    device = target_probs.device
    cu = cu_num_draft_tokens.to(device=device, dtype=torch.int64)
    draft_token_ids = draft_token_ids.to(device=device, dtype=torch.int64)
    is_greedy = is_greedy.to(device)
    draft_probs = _draft_probs_to(draft_probs, device)
    batch_size, num_draft_tokens = cu.shape[0] - 1, draft_token_ids.shape[0]
    arange_b = torch.arange(batch_size, device=device)
    num_draft = cu[1:] - cu[:-1]  # [B]
    longest_draft = int(num_draft.max()) if batch_size else 0
    seq_of = torch.repeat_interleave(arange_b, num_draft)  # [T] owning sequence
    pos = torch.arange(num_draft_tokens, device=device) - cu[seq_of]  # [T] position in seq

    u = _uniforms(cu.tolist(), generators, device)
    accepted = _accept(draft_token_ids, seq_of, target_probs, draft_probs, is_greedy, u)
    num_accepted = _first_rejection(accepted, seq_of, pos, num_draft, longest_draft)
    rejected = num_accepted < num_draft
    emit = torch.ones_like(rejected) if sample_bonus is None else rejected | sample_bonus.to(device)

    # Row cu[i] + i + a_i is the rejected position's row, or the bonus row when a_i == k_i.
    final_rows = cu[:-1] + arange_b + num_accepted
    draft_index = (cu[:-1] + num_accepted).clamp_max(max(num_draft_tokens - 1, 0))
    final = _final_tokens(target_probs, final_rows, draft_index, rejected, is_greedy,
                          draft_token_ids, draft_probs, generators, emit)

    out = torch.full((batch_size, longest_draft + 1), PLACEHOLDER_TOKEN_ID,
                     dtype=torch.int64, device=device)
    keep = pos < num_accepted[seq_of]
    out[seq_of[keep], pos[keep]] = draft_token_ids[keep]
    emit_idx = emit.nonzero().squeeze(1)
    out[emit_idx, num_accepted[emit_idx]] = final[emit_idx]
    return RejectionOutput(out, num_accepted, num_accepted + emit.long())


def accepted_per_position(output: RejectionOutput) -> torch.Tensor:
    """[longest_draft] int64: how many sequences accepted a draft at each position (metrics)."""
    width = output.output_token_ids.shape[1] - 1
    positions = torch.arange(width, device=output.num_accepted.device)
    return (positions[None, :] < output.num_accepted[:, None]).sum(dim=0)
