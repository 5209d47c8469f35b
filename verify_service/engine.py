"""One verifier step on torch: target forward, sampling distributions, batched rejection.

Runs in a worker thread on immutable snapshots (StepInput), so the event loop keeps serving
health checks and draft streams during the forward.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from kernels.rejection import SparseDraftProbs, rejection_sample
from kernels.sampling import keyed_seed, logits_to_probs, make_generator
from tandem.sampling_params import SamplingParams
from tandem.engine.model_runner import ModelRunner, SeqChunk
from verify_service.sequence import DraftToken


@dataclass(frozen=True)
class StepInput:
    token_ids: list[int]  # [last committed token, *drafts], a prefill chunk, or carried: drafts
    start_pos: int
    block_table: list[int]
    drafts: list[DraftToken]  # the k draft tokens under verification
    sampling: SamplingParams
    carried: torch.Tensor | None = None  # [vocab] target probs of the first draft's position
    sample_bonus: bool = True  # False: if all drafts pass, carry the bonus row instead


@dataclass(frozen=True)
class RoundOutcome:
    accepted: list[int]  # accepted draft tokens
    next_token: int | None  # recovered (first rejection) or bonus token; None when carried
    carry: torch.Tensor | None = None  # [vocab] the unsampled bonus row, when next_token is None


@dataclass(frozen=True)
class StepTimings:
    forward_ms: float
    rejection_ms: float


def _draft_probs(inputs: list[StepInput]) -> SparseDraftProbs | None:
    """Sparse q for the batch; one-hot rows (greedy, n-gram) padded with zero-mass ids."""
    drafts = [d for s in inputs for d in s.drafts]
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


class EngineCore:
    def __init__(self, runner: ModelRunner):
        self.runner = runner

    def _target_probs(self, inputs: list[StepInput]) -> tuple[torch.Tensor, float]:
        """[sum(k_i + 1), vocab]: carried rows (if any) then each forward's rows; forward ms."""
        rows = [len(s.drafts) + (0 if s.carried is not None else 1) for s in inputs]
        chunks = [SeqChunk(s.token_ids, s.start_pos, s.block_table, num_logits=n)
                  for s, n in zip(inputs, rows) if s.token_ids]
        if not chunks:  # carried sessions whose drafts vanished: no forward needed
            return torch.stack([s.carried for s in inputs]), 0.0
        t0 = time.perf_counter()
        logits = self.runner.forward(chunks)  # [sum(rows), vocab]
        forward_ms = (time.perf_counter() - t0) * 1e3

        def per_row(values, dtype):
            return torch.tensor([v for v, n in zip(values, rows) for _ in range(n)], dtype=dtype)

        probs = logits_to_probs(
            logits,
            per_row([s.sampling.temperature for s in inputs], torch.float32),
            per_row([s.sampling.top_k for s in inputs], torch.int64),
            per_row([s.sampling.top_p for s in inputs], torch.float32),
        )
        if all(s.carried is None for s in inputs):
            return probs, forward_ms
        parts, at = [], 0
        for s, n in zip(inputs, rows):
            if s.carried is not None:
                parts.append(s.carried[None])
            parts.append(probs[at:at + n])
            at += n
        return torch.cat(parts), forward_ms

    def execute(self, inputs: list[StepInput]) -> tuple[list[RoundOutcome], StepTimings]:
        t0 = time.perf_counter()
        probs, forward_ms = self._target_probs(inputs)
        counts = torch.tensor([0] + [len(s.drafts) for s in inputs], dtype=torch.int64)
        out = rejection_sample(
            draft_token_ids=torch.tensor([d.token_id for s in inputs for d in s.drafts],
                                         dtype=torch.int64),
            cu_num_draft_tokens=torch.cumsum(counts, 0),
            target_probs=probs,
            draft_probs=_draft_probs(inputs),
            is_greedy=torch.tensor([s.sampling.is_greedy for s in inputs]),
            sample_bonus=torch.tensor([s.sample_bonus for s in inputs]),
            generators=[
                None if s.sampling.seed is None
                # keyed by the first position sampled: independent of prefix-cache hits
                else make_generator(keyed_seed(s.sampling.seed, s.start_pos + len(s.token_ids)
                                               - len(s.drafts)))
                for s in inputs
            ],
        )
        tokens, accepted = out.output_token_ids.tolist(), out.num_accepted.tolist()
        emitted = out.num_emitted.tolist()
        outcomes, last_row = [], -1
        for s, row, a, e in zip(inputs, tokens, accepted, emitted):
            last_row += len(s.drafts) + 1
            if e > a:
                outcomes.append(RoundOutcome(row[:a], row[a]))
            else:  # every draft accepted and no bonus sampled: carry the bonus row
                outcomes.append(RoundOutcome(row[:a], None, probs[last_row].clone()))
        total_ms = (time.perf_counter() - t0) * 1e3
        return outcomes, StepTimings(forward_ms, total_ms - forward_ms)
