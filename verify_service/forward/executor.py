"""Execute one verification step on torch: the target forward over every session's new
tokens (one flattened batch), the verdicts on its rows (verify_service/forward/rejection.py judges
every round), and what the kept positions carry out. The "execute" of the round
(verify_service/engine.py is the round itself).

Runs in a worker thread on immutable snapshots (verify_service/forward/step.py), so the event loop
keeps serving health checks and draft streams during the forward. What a session asks for
beside its tokens is read off the same forward elsewhere: logprobs.py, features.py.
"""
from __future__ import annotations

import time
from dataclasses import replace

import torch

from tandem.device import synchronize
from tandem.engine.model_runner import ModelRunner, SeqChunk
from tandem.proposers.medusa import MedusaProposer
from verify_service.forward.features import (
    as_float16,
    eagle_features,
    kept_hidden,
    propose_trees,
)
from verify_service.forward.logprobs import emitted_logprobs
from verify_service.forward.rejection import Verdict, judge
from verify_service.forward.step import RoundOutcome, StepInput, StepTimings


class Executor:
    def __init__(self, runner: ModelRunner, medusa=None, graphs=None):
        self.runner = runner
        # Proposers hosted in the forward step (the hidden state they read was just computed):
        # Medusa's heads, given tandem.engine.medusa.MedusaHeads; None: no heads
        self.heads = None if medusa is None else MedusaProposer(medusa)
        # tandem.engine.cuda_graphs.GraphDecoder over runner (decode steps replayed), or None
        self.graphs = graphs
        self.heads_ms = 0.0  # the last step's pass of the heads

    def execute(self, inputs: list[StepInput]) -> tuple[list[RoundOutcome], StepTimings]:
        """One forward over every input, then verification of the rounds. Prefill chunks
        that are not a prompt's last ride along at the end of the forward (no logits rows)
        and come back as empty outcomes."""
        chunks = [s for s in inputs if s.partial]
        if not chunks:
            return self._execute(inputs, [])
        rounds = [s for s in inputs if not s.partial]
        if not rounds:
            _, _, forward_ms = self._forward([s.chunk() for s in chunks], False)
            return [RoundOutcome([], None)] * len(inputs), StepTimings(forward_ms, 0.0)
        outcomes, timings = self._execute(rounds, [s.chunk() for s in chunks])
        found = iter(outcomes)
        return [RoundOutcome([], None) if s.partial else next(found) for s in inputs], timings

    def _execute(self, inputs: list[StepInput], extra: list[SeqChunk]
                 ) -> tuple[list[RoundOutcome], StepTimings]:
        t0 = time.perf_counter()
        with_hidden = any(s.want_features or s.propose_tree for s in inputs)
        # extra (prefill chunks) add KV but no rows; carried sessions whose drafts vanished
        # have no tokens, and a step of only those runs no forward
        chunks = [s.chunk() for s in inputs if s.token_ids] + list(extra)
        logits, hidden, forward_ms = None, None, 0.0
        if chunks:
            logits, hidden, forward_ms = self._forward(chunks, with_hidden)
        outcomes = self._outcomes(inputs, judge(inputs, logits), logits, hidden)
        total_ms = (time.perf_counter() - t0) * 1e3
        return outcomes, StepTimings(forward_ms, total_ms - forward_ms, self.heads_ms)

    def _outcomes(self, inputs: list[StepInput], found: list[Verdict],
                  logits: torch.Tensor | None,  # [sum(num_logits), vocab] raw, or None
                  hidden: torch.Tensor | None,  # [sum(len(token_ids)), hidden] or None
                  ) -> list[RoundOutcome]:
        """Each session's outcome: a tree's accepted path moved into place in the KV, then
        what it asked for beside its tokens (logprobs, EAGLE features, Medusa's next drafts)."""
        logprobs = emitted_logprobs(inputs, found, logits)
        outcomes, hidden_at, heads = [], 0, []
        hidden16 = (as_float16(hidden) if hidden is not None and any(
            s.want_features and s.token_ids for s in inputs) else None)
        for s, v, lps in zip(inputs, found, logprobs):
            path = v.path
            if path != list(range(len(path))):  # a tree's path, in place
                root = s.first_sampled_pos - 1
                self.runner.move_kv(s.block_table, [root + 1 + j for j in path],
                                    list(range(root + 1, root + 1 + len(path))))
            feats = None
            if hidden16 is not None and s.want_features and s.token_ids:
                feats = eagle_features(self.runner, s, path, hidden16, hidden_at)
            propose = s.propose_tree and self.heads is not None and v.next_token is not None
            h = kept_hidden(s, path, hidden, hidden_at) if propose else None
            if h is not None:
                heads.append((len(outcomes), h[-1]))
            outcome = RoundOutcome(v.accepted, v.next_token, v.carry, feats)
            outcomes.append(replace(outcome, logprobs=lps) if lps else outcome)
            hidden_at += len(s.token_ids)
        self.heads_ms = 0.0
        if heads:  # Medusa: every session's next tree from one pass of the heads
            t0 = time.perf_counter()
            propose_trees(self.heads, inputs, outcomes, heads)
            self.heads_ms = (time.perf_counter() - t0) * 1e3
        return outcomes

    def _forward(self, chunks: list[SeqChunk], with_hidden: bool):
        """(logits [sum(num_logits), vocab], hidden states [sum(len(token_ids)), hidden] or
        None, forward ms)."""
        t0 = time.perf_counter()
        hidden = None
        forward = self.runner.forward if self.graphs is None else self.graphs.forward
        if with_hidden:
            logits, hidden = forward(chunks, with_hidden=True)
        else:
            logits = forward(chunks)
        synchronize(self.runner.device)  # forward_ms feeds the cost model: the real time
        return logits, hidden, (time.perf_counter() - t0) * 1e3
