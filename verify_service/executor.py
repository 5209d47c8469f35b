"""Execute one verification step on torch: the target forward over every session's new
tokens (one flattened batch), the sampling distributions, and the verdict on the drafts. The
"execute" of the round (verify_service/engine.py is the round itself).

Runs in a worker thread on immutable snapshots (verify_service/step.py), so the event loop
keeps serving health checks and draft streams during the forward. What a session asks for
beside its tokens is read off the same forward elsewhere: logprobs.py, features.py.
"""
from __future__ import annotations

import time
from dataclasses import replace

import torch

from kernels.sampling import keyed_seed, logits_to_probs, make_generator, sample
from tandem.device import synchronize
from tandem.engine.model_runner import ModelRunner, SeqChunk
from tandem.grammar.masks import apply_masks
from tandem.spec import DraftToken
from verify_service import tree
from verify_service.features import eagle_features, kept_hidden, propose_trees
from verify_service.logprobs import emitted_logprobs
from verify_service.rejection import SpecDecodeMetadata, verify
from verify_service.step import RoundOutcome, StepInput, StepTimings


class Executor:
    def __init__(self, runner: ModelRunner, medusa=None, graphs=None):
        self.runner = runner
        self.medusa = medusa  # tandem.engine.medusa.MedusaHeads, or None
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
        if all(s.sampling.is_greedy and s.sample_bonus and s.carried is None and s.token_ids
               for s in inputs):
            logits, hidden, forward_ms = self._forward([s.chunk() for s in inputs] + extra,
                                                       with_hidden)
            found = _greedy_verify(inputs, _masked(inputs, logits))
        else:
            probs, logits, hidden, forward_ms = self._target_probs(inputs, with_hidden, extra)
            found = self._verify(inputs, probs)
        outcomes = self._outcomes(inputs, found, logits, hidden)
        total_ms = (time.perf_counter() - t0) * 1e3
        return outcomes, StepTimings(forward_ms, total_ms - forward_ms, self.heads_ms)

    def _outcomes(self, inputs: list[StepInput], found, logits: torch.Tensor | None,
                  hidden: torch.Tensor | None) -> list[RoundOutcome]:
        """Each session's outcome: a tree's accepted path moved into place in the KV, then
        what it asked for beside its tokens (logprobs, EAGLE features, Medusa's next drafts)."""
        logprobs = emitted_logprobs(inputs, found, logits)
        outcomes, hidden_at, heads = [], 0, []
        for s, (accepted, next_token, carry, path), lps in zip(inputs, found, logprobs):
            if path is not None and path != list(range(len(path))):  # a tree's path, in place
                root = s.first_sampled_pos - 1
                self.runner.move_kv(s.block_table, [root + 1 + j for j in path],
                                    list(range(root + 1, root + 1 + len(path))))
            h = kept_hidden(s, path, hidden, hidden_at)
            feats = None
            if h is not None and s.want_features:
                feats = eagle_features(self.runner, s, h)
            propose = s.propose_tree and self.medusa is not None and next_token is not None
            if h is not None and propose:
                heads.append((len(outcomes), h[-1]))
            outcome = RoundOutcome(accepted, next_token, carry, feats)
            outcomes.append(replace(outcome, logprobs=lps) if lps else outcome)
            hidden_at += len(s.token_ids)
        self.heads_ms = 0.0
        if heads:  # Medusa: every session's next tree from one pass of the heads
            t0 = time.perf_counter()
            propose_trees(self.medusa, inputs, outcomes, heads)
            self.heads_ms = (time.perf_counter() - t0) * 1e3
        return outcomes

    @staticmethod
    def _verify(inputs: list[StepInput], probs: torch.Tensor):
        """(accepted, next token or None, carried row, kept draft indices) per input: seeded
        sessions by _coupled_verify, trees by tree.reject, the rest (chains) by the batched
        rejection sampler."""
        starts = [0]
        for s in inputs:  # each input owns len(drafts) + 1 rows (a carried row included)
            starts.append(starts[-1] + len(s.drafts) + 1)
        coupled = [s.sampling.seed is not None and not s.sampling.is_greedy for s in inputs]
        found: list = [_coupled_verify(s, probs[a:b]) if c else None
                       for s, c, a, b in zip(inputs, coupled, starts, starts[1:])]
        for i, s in enumerate(inputs):
            rows = probs[starts[i]:starts[i + 1]]
            if s.typical is not None and s.carried is None:
                parents = s.parents or tuple(range(-1, len(s.drafts) - 1))
                gen = None if s.sampling.seed is None else make_generator(
                    keyed_seed(s.sampling.seed, s.first_sampled_pos))
                found[i] = _from_path(tree.typical(s.drafts, parents, rows, *s.typical, gen))
            elif found[i] is None and s.is_tree:
                found[i] = _from_path(tree.reject(s.drafts, s.parents, rows))
        rest = [i for i, f in enumerate(found) if f is None]
        if rest:
            rows = probs if len(rest) == len(inputs) else probs[torch.cat(
                [torch.arange(starts[i], starts[i + 1], device=probs.device) for i in rest])]
            for i, f in zip(rest, Executor._reject([inputs[i] for i in rest], rows)):
                found[i] = f
        return found

    @staticmethod
    def _reject(inputs: list[StepInput], probs: torch.Tensor):
        """The batched rejection sampler: (accepted, next token or None, carried row)."""
        meta = SpecDecodeMetadata.build([s.drafts for s in inputs], [s.sampling for s in inputs],
                                        [s.first_sampled_pos for s in inputs],
                                        [s.sample_bonus for s in inputs])
        out = verify(meta, probs)
        tokens, accepted = out.output_token_ids.tolist(), out.num_accepted.tolist()
        emitted = out.num_emitted.tolist()
        found, last_row = [], -1
        for s, row, a, e in zip(inputs, tokens, accepted, emitted):
            last_row += len(s.drafts) + 1
            if e > a:
                found.append((row[:a], row[a], None, list(range(a))))
            else:  # every draft accepted and no bonus sampled: carry the bonus row
                found.append((row[:a], None, probs[last_row].clone(), list(range(a))))
        return found

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

    def _target_probs(self, inputs: list[StepInput], with_hidden: bool,
                      extra: list[SeqChunk] = ()):
        """([sum(k_i + 1), vocab] probs: carried rows (if any) then each forward's rows;
        the forward's logits [sum(rows), vocab] or None; [sum(len(token_ids)), hidden] final
        hidden states if any input wants them, else None; forward ms)."""
        rows = [len(s.drafts) + (0 if s.carried is not None else 1) for s in inputs]
        chunks = [s.chunk() for s in inputs if s.token_ids]
        if not chunks and not extra:  # carried sessions whose drafts vanished: no forward
            return torch.stack([s.carried for s in inputs]), None, None, 0.0
        # [sum(rows), vocab]; extra (prefill chunks) add KV but no rows
        logits, hidden, forward_ms = self._forward(chunks + list(extra), with_hidden)

        def per_row(values, dtype):
            return torch.tensor([v for v, n in zip(values, rows) for _ in range(n)], dtype=dtype,
                                device=logits.device)

        probs = logits_to_probs(
            _masked(inputs, logits),
            per_row([s.sampling.temperature for s in inputs], torch.float32),
            per_row([s.sampling.top_k for s in inputs], torch.int64),
            per_row([s.sampling.top_p for s in inputs], torch.float32),
        )
        if all(s.carried is None for s in inputs):
            return probs, logits, hidden, forward_ms
        parts, at = [], 0
        for s, n in zip(inputs, rows):
            if s.carried is not None:
                parts.append(s.carried[None])
            parts.append(probs[at:at + n])
            at += n
        return torch.cat(parts), logits, hidden, forward_ms


def _coupled_verify(
    s: StepInput,
    probs: torch.Tensor,  # [k + 1, vocab] target probs of the round's positions
):
    """A seeded session's round: the token at each position is the target's own sample with
    that position's keyed noise (kernels.sampling.position_noise), whatever was drafted.
    Drafts are accepted while they equal it, so the text depends only on the seed and the
    target: the same with speculation on or off, at any k, in any batch. Exact (each token is
    a sample of p), and a draft that shares the noise is accepted often. A tree takes the
    child carrying that token, so the text is again the same."""
    def keyed(row: int, depth: int) -> int:
        gen = make_generator(keyed_seed(s.sampling.seed, s.first_sampled_pos + depth))
        return int(sample(probs[row:row + 1], [gen]))

    if s.is_tree:
        return _from_path(tree.walk(s.drafts, s.parents, keyed))
    gens = [make_generator(keyed_seed(s.sampling.seed, s.first_sampled_pos + j))
            for j in range(probs.shape[0])]
    return _match(s.drafts, sample(probs, gens).tolist())


def _greedy_verify(inputs: list[StepInput], logits: torch.Tensor):
    """Greedy rounds need only the target's argmax: accept drafts while they equal it, then
    emit the argmax at the first mismatch (recovered) or after the last draft (bonus). The
    same tokens the rejection sampler gives greedy rows, without probabilities over the
    vocabulary."""
    top = logits.argmax(dim=-1).tolist()  # [sum(k_i + 1)]
    found, at = [], 0
    for s in inputs:
        row = top[at:at + len(s.drafts) + 1]
        at += len(row)
        found.append(_from_path(tree.walk(s.drafts, s.parents, lambda r, _d, row=row: row[r]))
                     if s.is_tree else _match(s.drafts, row))
    return found


def _masked(inputs: list[StepInput], logits: torch.Tensor) -> torch.Tensor:
    """The logits with each structured-output session's forbidden tokens at -inf (before
    temperature, top-k and top-p, as plain constrained sampling does)."""
    return apply_masks(logits, [s.mask for s in inputs], [s.num_logits for s in inputs])


def _from_path(p: tree.TreePath):
    return p.accepted, p.next_token, None, p.nodes


def _match(drafts: list[DraftToken], tokens: list[int]):
    """The target's own tokens of a round ([k + 1]) against the drafts: accepted while they
    agree, then the target's token at the first mismatch (recovered) or after the last (bonus)."""
    a = 0
    while a < len(drafts) and drafts[a].token_id == tokens[a]:
        a += 1
    return tokens[:a], tokens[a], None, list(range(a))
