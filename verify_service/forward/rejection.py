"""The round, judged in one place: a step's inputs and the target's logits rows in, one
Verdict per session out (accepted drafts, then the recovered or bonus token, or the bonus row
carried), for every path a round can take.

    judge(inputs, logits)
      1. grammar masks on the raw rows (forbidden tokens -inf, as plain constrained sampling),
         then the sampling controls, each row over its own prefix (forward/controls.py)
      2. the step's SamplingMetadata, batched once: per row for the distributions, per session
         for the verdicts
      3. a step where every session is greedy and emits: argmax matching, no distributions
      4. otherwise the rows as distributions (carried rows spliced in), then per session:
         typical   Medusa's LOSSY typical acceptance       kernels.tree_rejection.typical
         seeded    the target's own keyed sample per position, drafts kept while equal
         tree      recursive rejection over siblings         kernels.tree_rejection.reject
         chain     the batched rejection sampler, one call   kernels.rejection.rejection_sample

Nothing here calls back into the executor: it runs the forward, this module judges its rows.
Row layout of the distributions: session i owns len(drafts_i) + 1 rows (one per draft
position, then the bonus row), a carried row counting as its first.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kernels import tree_rejection as tree
from kernels.rejection import rejection_sample
from kernels.rejection_types import RejectionOutput, SparseDraftProbs
from kernels.sampling import keyed_seed, logits_to_probs, make_generator, sample
from tandem.grammar.masks import apply_masks
from tandem.sampling_params import SamplingParams
from tandem.spec import DraftToken
from verify_service.forward.controls import apply_controls
from verify_service.forward.step import StepInput


@dataclass(frozen=True)
class Verdict:
    """One session's round: what it emits and which draft nodes' KV it keeps."""

    accepted: list[int]  # accepted draft tokens, root to leaf
    next_token: int | None  # recovered (first rejection) or bonus token; None: row carried
    carry: torch.Tensor | None  # [vocab] the unsampled bonus row when next_token is None
    path: list[int]  # the accepted drafts' indices among the round's drafts


@dataclass(frozen=True)
class SamplingMetadata:
    """A step's sampling controls, batched once (vLLM's SamplingMetadata)."""

    temperature: torch.Tensor  # [num_rows] float32, each session's logits rows in order
    top_k: torch.Tensor  # [num_rows] int64, 0 = off
    top_p: torch.Tensor  # [num_rows] float32, 1 = off
    min_p: torch.Tensor  # [num_rows] float32, 0 = off
    is_greedy: torch.Tensor  # [batch_size] bool
    seeds: tuple[int | None, ...]  # [batch_size]
    first_sampled_pos: tuple[int, ...]  # [batch_size] absolute position of the first token

    @classmethod
    def build(cls, params: Sequence[SamplingParams], first_sampled_pos: Sequence[int],
              num_rows: Sequence[int]) -> SamplingMetadata:
        """Per session: its params, where its round starts (keys a seeded session's noise, so
        the text does not depend on the round's shape or the batch) and its logits rows."""
        def per_row(values, dtype):
            return torch.tensor([v for v, n in zip(values, num_rows) for _ in range(n)],
                                dtype=dtype)

        return cls(per_row([p.temperature for p in params], torch.float32),
                   per_row([p.top_k for p in params], torch.int64),
                   per_row([p.top_p for p in params], torch.float32),
                   per_row([p.min_p for p in params], torch.float32),
                   torch.tensor([p.is_greedy for p in params], dtype=torch.bool),
                   tuple(p.seed for p in params), tuple(first_sampled_pos))

    @classmethod
    def of(cls, inputs: Sequence[StepInput]) -> SamplingMetadata:
        return cls.build([s.sampling for s in inputs], [s.first_sampled_pos for s in inputs],
                         [s.num_logits for s in inputs])

    def generator(self, i: int, depth: int = 0) -> torch.Generator | None:
        """Session i's generator for its round's position `depth`; None when unseeded."""
        seed = self.seeds[i]
        if seed is None:
            return None
        return make_generator(keyed_seed(seed, self.first_sampled_pos[i] + depth))

    def is_coupled(self, i: int) -> bool:
        """A seeded sampled session: each position's token is the target's own keyed sample."""
        return self.seeds[i] is not None and not bool(self.is_greedy[i])


@dataclass(frozen=True)
class SpecDecodeMetadata:
    """The chains' drafts for the batched rejection sampler (vLLM's SpecDecodeMetadata):
    sequence i owns draft tokens cu[i]:cu[i+1] and target rows cu[i] + i .. cu[i+1] + i."""

    draft_token_ids: torch.Tensor  # [num_draft_tokens] int64, sequences concatenated
    cu_num_draft_tokens: torch.Tensor  # [batch_size + 1] int64, cu[0] = 0
    draft_probs: SparseDraftProbs | None  # sparse q per draft; None: every q one-hot
    sample_bonus: torch.Tensor  # [batch_size] bool, False: carry the bonus row instead

    @classmethod
    def build(cls, drafts: list[list[DraftToken]], sample_bonus: list[bool]
              ) -> SpecDecodeMetadata:
        counts = torch.tensor([0] + [len(d) for d in drafts], dtype=torch.int64)
        return cls(torch.tensor([t.token_id for d in drafts for t in d], dtype=torch.int64),
                   torch.cumsum(counts, 0), _sparse_q([t for d in drafts for t in d]),
                   torch.tensor(sample_bonus, dtype=torch.bool))


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


def verify_chains(
    spec: SpecDecodeMetadata,
    sampling: SamplingMetadata,
    target_probs: torch.Tensor,  # [num_draft_tokens + batch_size, vocab] after sampling params
    sessions: list[int] | None = None,  # spec's sequences among sampling's (None: all, in order)
) -> RejectionOutput:
    """Accepted, recovered and bonus tokens for every chain, losslessly."""
    idx = list(range(len(sampling.seeds))) if sessions is None else sessions
    return rejection_sample(
        draft_token_ids=spec.draft_token_ids, cu_num_draft_tokens=spec.cu_num_draft_tokens,
        target_probs=target_probs, draft_probs=spec.draft_probs,
        is_greedy=sampling.is_greedy[idx], generators=[sampling.generator(i) for i in idx],
        sample_bonus=spec.sample_bonus)


def judge(
    inputs: list[StepInput],
    logits: torch.Tensor | None,  # [sum(num_logits), vocab] raw rows; None: no forward ran
) -> list[Verdict]:
    """Every session's verdict on its round (see the module docstring)."""
    if not inputs:
        return []
    if logits is not None:
        logits = apply_masks(logits, [s.mask for s in inputs], [s.num_logits for s in inputs])
        logits = apply_controls(logits, inputs)
    if all(s.sampling.is_greedy and s.sample_bonus and s.carried is None and s.token_ids
           for s in inputs):
        return _greedy(inputs, logits)
    meta = SamplingMetadata.of(inputs)
    return _sampled(inputs, _target_probs(inputs, logits, meta), meta)


def _target_probs(
    inputs: list[StepInput],
    logits: torch.Tensor | None,  # [sum(num_logits), vocab] masked
    meta: SamplingMetadata,
) -> torch.Tensor:  # [sum(k_i + 1), vocab] carried rows spliced in before their session's rows
    if logits is None:  # carried sessions whose drafts vanished: no forward
        return torch.stack([s.carried for s in inputs])
    probs = logits_to_probs(logits, meta.temperature, meta.top_k, meta.top_p, meta.min_p)
    if all(s.carried is None for s in inputs):
        return probs
    parts, at = [], 0
    for s in inputs:
        if s.carried is not None:
            parts.append(s.carried[None])
        parts.append(probs[at:at + s.num_logits])
        at += s.num_logits
    return torch.cat(parts)


def _sampled(inputs: list[StepInput], probs: torch.Tensor, meta: SamplingMetadata
             ) -> list[Verdict]:
    """Typical, seeded and tree sessions one by one, then every chain in one batched call."""
    starts = [0]
    for s in inputs:  # each session owns len(drafts) + 1 rows (a carried row included)
        starts.append(starts[-1] + len(s.drafts) + 1)
    found: list[Verdict | None] = []
    for i, s in enumerate(inputs):
        rows = probs[starts[i]:starts[i + 1]]
        if s.typical is not None and s.carried is None:
            parents = s.parents or tuple(range(-1, len(s.drafts) - 1))
            found.append(_from_path(tree.typical(s.drafts, parents, rows, *s.typical,
                                                 meta.generator(i))))
        elif meta.is_coupled(i):
            found.append(_coupled(s, rows, lambda depth, i=i: meta.generator(i, depth)))
        elif s.is_tree:
            found.append(_from_path(tree.reject(s.drafts, s.parents, rows)))
        else:
            found.append(None)
    chains = [i for i, f in enumerate(found) if f is None]
    if chains:
        rows = probs if len(chains) == len(inputs) else probs[torch.cat(
            [torch.arange(starts[i], starts[i + 1], device=probs.device) for i in chains])]
        for i, verdict in zip(chains, _chains([inputs[i] for i in chains], rows, meta,
                                              chains)):
            found[i] = verdict
    return found


def _chains(inputs: list[StepInput], probs: torch.Tensor, meta: SamplingMetadata,
            sessions: list[int]) -> list[Verdict]:
    """The batched rejection sampler's verdicts; a session that accepted every draft and may
    not sample a bonus carries its bonus row instead."""
    spec = SpecDecodeMetadata.build([s.drafts for s in inputs], [s.sample_bonus for s in inputs])
    out = verify_chains(spec, meta, probs, sessions)
    tokens, accepted = out.output_token_ids.tolist(), out.num_accepted.tolist()
    found, last_row = [], -1
    for s, row, a, e in zip(inputs, tokens, accepted, out.num_emitted.tolist()):
        last_row += len(s.drafts) + 1
        if e > a:
            found.append(Verdict(row[:a], row[a], None, list(range(a))))
        else:
            found.append(Verdict(row[:a], None, probs[last_row].clone(), list(range(a))))
    return found


def _coupled(s: StepInput, probs: torch.Tensor, generator) -> Verdict:
    """A seeded session's round (probs [k + 1, vocab]): the token at each position is the
    target's own sample with that position's keyed noise (kernels.sampling.position_noise),
    whatever was drafted. Drafts are accepted while they equal it, so the text depends only on
    the seed and the target: the same with speculation on or off, at any k, in any batch.
    Exact (each token is a sample of p), and a draft that shares the noise is accepted often.
    A tree takes the child carrying that token, so the text is again the same."""
    if s.is_tree:
        return _from_path(tree.walk(s.drafts, s.parents, lambda row, depth: int(
            sample(probs[row:row + 1], [generator(depth)]))))
    tokens: list[int] = []  # drawn lazily: a row after the first mismatch is never read, and
    for depth in range(probs.shape[0]):  # each draw (49k keyed noises) costs about a ms here
        tokens.append(int(sample(probs[depth:depth + 1], [generator(depth)])))
        if depth == len(s.drafts) or s.drafts[depth].token_id != tokens[-1]:
            break
    return _match(s.drafts, tokens)


def _greedy(inputs: list[StepInput], logits: torch.Tensor) -> list[Verdict]:
    """Greedy rounds need only the target's argmax: accept drafts while they equal it, then
    emit the argmax at the first mismatch (recovered) or after the last draft (bonus). The
    same tokens the rejection sampler gives greedy rows, without distributions over the
    vocabulary."""
    top = logits.argmax(dim=-1).tolist()  # [sum(k_i + 1)]
    found, at = [], 0
    for s in inputs:
        row = top[at:at + len(s.drafts) + 1]
        at += len(row)
        found.append(_from_path(tree.walk(s.drafts, s.parents, lambda r, _d, row=row: row[r]))
                     if s.is_tree else _match(s.drafts, row))
    return found


def _from_path(p: tree.TreePath) -> Verdict:
    return Verdict(p.accepted, p.next_token, None, p.nodes)


def _match(drafts: list[DraftToken], tokens: list[int]) -> Verdict:
    """The target's own tokens of a round ([k + 1]) against the drafts: accepted while they
    agree, then the target's token at the first mismatch (recovered) or after the last."""
    a = 0
    while a < len(drafts) and drafts[a].token_id == tokens[a]:
        a += 1
    return Verdict(tokens[:a], tokens[a], None, list(range(a)))
