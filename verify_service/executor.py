"""Execute one verification step on torch: target forward, sampling distributions, batched
rejection. The "execute" of the round (verify_service/engine.py is the round itself).

Runs in a worker thread on immutable snapshots (StepInput), so the event loop keeps serving
health checks and draft streams during the forward.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch

from kernels.sampling import keyed_seed, logits_to_probs, make_generator, sample
from tandem.device import synchronize
from tandem.engine.model_runner import ModelRunner, SeqChunk
from tandem.sampling_params import SamplingParams
from tandem.spec import DraftToken, Features
from verify_service import tree
from verify_service.rejection import SpecDecodeMetadata, is_chain, verify

# Tokens per forward the verifier times at start-up (k + 1 of a round); past 8 the curve is
# near linear here, so two points cover up to 16 drafts.
CALIBRATION_COUNTS = (1, 2, 3, 4, 5, 6, 8, 12, 17)
# And the tokens of whole batch steps (one token per session plus their drafts), for the
# batch plan: how a step's time grows with its rows once it is compute-bound.
STEP_CALIBRATION_COUNTS = (16, 32, 64)


def calibration_counts(max_spec_tokens: int) -> tuple[int, ...]:
    """The counts a verifier with this k cap ever runs for one session."""
    return tuple(q for q in CALIBRATION_COUNTS if q <= max_spec_tokens + 1) or (1,)


@dataclass(frozen=True)
class StepInput:
    """One session's verification input: a chain of drafts, or a tree when `parents` describes
    one (index of each draft's parent among the drafts, -1 = the round's root)."""

    token_ids: list[int]  # [last committed token, *drafts], a prefill chunk, or carried: drafts
    start_pos: int
    block_table: list[int]
    drafts: list[DraftToken]  # the k draft tokens under verification
    sampling: SamplingParams
    carried: torch.Tensor | None = None  # [vocab] target probs of the first draft's position
    sample_bonus: bool = True  # False: if all drafts pass, carry the bonus row instead
    parents: tuple[int, ...] | None = None  # None = a chain
    want_features: bool = False  # EAGLE sessions: return the kept positions' hidden states
    propose_tree: int = 0  # Medusa sessions: nodes of the next round's tree drafted now
    propose_chain: bool = False  # ... a chain of the heads' top-1 tokens instead
    typical: tuple[float, float] | None = None  # LOSSY typical acceptance (threshold, alpha)
    logprobs: int | None = None  # the emitted tokens' target logprobs, with this many top
    partial: bool = False  # a prefill chunk before the last: computes KV, samples nothing
    prefill: bool = False  # a prompt's last (or only) chunk: features of all of it, if wanted

    def __post_init__(self):
        if self.logprobs is not None and self.carried is not None:
            raise ValueError("logprobs need the round's own logits: no carried row")
        if self.parents is not None:
            if len(self.parents) != len(self.drafts):
                raise ValueError(f"{len(self.parents)} parents for {len(self.drafts)} drafts")
            if self.is_tree and (self.carried is not None or not self.sample_bonus):
                raise ValueError("a token tree is verified from its root: no carried row")

    @property
    def is_tree(self) -> bool:
        return not is_chain(self.parents)

    def chunk(self) -> SeqChunk:
        """The forward's view: the new tokens, with the tree's shape (root first) if any."""
        parents = None
        if self.is_tree:
            parents = (-1, *(p + 1 for p in self.parents))
        return SeqChunk(self.token_ids, self.start_pos, self.block_table,
                        num_logits=self.num_logits, parents=parents)

    @property
    def num_logits(self) -> int:
        """Rows of the forward's logits this input gets (its drafts', plus the root's
        unless carried; none for a prefill chunk or an input that runs no forward)."""
        if self.partial or not self.token_ids:
            return 0
        return len(self.drafts) + (self.carried is None)

    @property
    def first_sampled_pos(self) -> int:
        """Absolute position of the first token this round may emit."""
        return self.start_pos + len(self.token_ids) - len(self.drafts)


@dataclass(frozen=True)
class TokenLogprob:
    """The target's raw log-probability of one emitted token (log-softmax of its logits,
    before the sampling parameters) and the `top` most likely tokens there."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class RoundOutcome:
    accepted: list[int]  # accepted draft tokens
    next_token: int | None  # recovered (first rejection) or bonus token; None when carried
    carry: torch.Tensor | None = None  # [vocab] the unsampled bonus row, when next_token is None
    features: Features | None = None  # hidden states of the positions whose KV was kept
    tree: tuple[list[DraftToken], tuple[int, ...]] | None = None  # Medusa: next round's drafts
    logprobs: tuple[TokenLogprob, ...] = ()  # one per emitted token, when asked for


@dataclass(frozen=True)
class StepTimings:
    forward_ms: float
    rejection_ms: float


class Executor:
    def __init__(self, runner: ModelRunner, medusa=None):
        self.runner = runner
        self.medusa = medusa  # tandem.engine.medusa.MedusaHeads, or None

    def calibrate(self, token_counts=CALIBRATION_COUNTS, reps: int = 3,
                  context: int = 64) -> dict[int, float]:
        """Median ms of a forward over q new tokens after `context` cached ones, per q: the
        verify-cost curve of this machine now. Runs before serving, in the cache's first
        blocks (nothing is allocated yet; later sessions overwrite them); {} if it is smaller
        than that."""
        q_max = max(token_counts)
        bs = self.runner.block_size
        table = list(range(-(-(context + q_max) // bs)))
        if len(table) > self.runner.num_blocks:
            return {}  # a cache this small: keep the built-in table
        ids = [(37 * i) % 1000 + 100 for i in range(context + q_max)]
        self.runner.forward([SeqChunk(ids[:context], 0, table)])
        times: dict[int, list[float]] = {q: [] for q in token_counts}
        for _ in range(reps + 1):  # the first pass warms up; interleaved, so noise is shared
            for q in token_counts:
                t0 = time.perf_counter()
                self.runner.forward([SeqChunk(ids[context:context + q], context, table, q)])
                synchronize(self.runner.device)  # a GPU forward returns before it is done
                times[q].append((time.perf_counter() - t0) * 1e3)
        return {q: sorted(ts[1:])[len(ts[1:]) // 2] for q, ts in times.items()}

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
            found = _greedy_verify(inputs, logits)
        else:
            probs, logits, hidden, forward_ms = self._target_probs(inputs, with_hidden, extra)
            found = self._verify(inputs, probs)
        logprobs = _emitted_logprobs(inputs, found, logits)
        outcomes, hidden_at, heads = [], 0, []
        for s, (accepted, next_token, carry, path), lps in zip(inputs, found, logprobs):
            if path is not None and path != list(range(len(path))):  # a tree's path, in place
                root = s.first_sampled_pos - 1
                self.runner.move_kv(s.block_table, [root + 1 + j for j in path],
                                    list(range(root + 1, root + 1 + len(path))))
            outcome, h_last = self._outcome(s, accepted, next_token, carry, path, hidden,
                                            hidden_at)
            if h_last is not None:
                heads.append((len(outcomes), h_last))
            outcomes.append(replace(outcome, logprobs=lps) if lps else outcome)
            hidden_at += len(s.token_ids)
        if heads:  # Medusa: every session's next tree from one pass of the heads
            trees = self.medusa.propose_batch(
                torch.stack([h for _, h in heads]),
                [(inputs[i].propose_tree, inputs[i].propose_chain) for i, _ in heads])
            for (i, _), tree_out in zip(heads, trees):
                outcomes[i] = replace(outcomes[i], tree=tree_out)
        total_ms = (time.perf_counter() - t0) * 1e3
        return outcomes, StepTimings(forward_ms, total_ms - forward_ms)

    def _outcome(self, s: StepInput, accepted, next_token, carry, path, hidden,
                 hidden_at: int) -> tuple[RoundOutcome, torch.Tensor | None]:
        """The round's result for one session, with the hidden states it asked for; and the
        last kept position's [hidden] state when Medusa heads are to propose from it."""
        if hidden is None or not s.token_ids:
            return RoundOutcome(accepted, next_token, carry), None
        before = len(s.token_ids) - len(s.drafts)  # rows of the committed part (root incl.)
        rows = list(range(before)) + [before + j for j in (path or [])]
        h = hidden[hidden_at:hidden_at + len(s.token_ids)][rows]
        feats = self._features(s, h) if s.want_features else None
        propose = s.propose_tree and self.medusa is not None and next_token is not None
        return RoundOutcome(accepted, next_token, carry, feats), h[-1] if propose else None

    def _features(self, s: StepInput, h: torch.Tensor) -> Features:
        """The kept positions' hidden states for the draft: a prompt's whole, its cached
        prefix and earlier chunks too, read back from the runner's kept features (which the
        forward just wrote this chunk's rows to)."""
        start, h = s.start_pos, h.to(torch.float16)
        if s.prefill and start:
            h = self.runner.features_at(s.block_table, 0, start + len(s.token_ids))
            start = 0
        return Features(start, h.shape[1], h.cpu().numpy().tobytes())

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
        if with_hidden:
            logits, hidden = self.runner.forward(chunks, with_hidden=True)
        else:
            logits = self.runner.forward(chunks)
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
            logits,
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


def _from_path(p: tree.TreePath):
    return p.accepted, p.next_token, None, p.nodes


def _match(drafts: list[DraftToken], tokens: list[int]):
    """The target's own tokens of a round ([k + 1]) against the drafts: accepted while they
    agree, then the target's token at the first mismatch (recovered) or after the last (bonus)."""
    a = 0
    while a < len(drafts) and drafts[a].token_id == tokens[a]:
        a += 1
    return tokens[:a], tokens[a], None, list(range(a))


def _emitted_logprobs(inputs: list[StepInput], found, logits: torch.Tensor | None):
    """Per input, a TokenLogprob for each token the round emits (accepted drafts, then the
    recovered or bonus token), or () when not asked for. A token at depth d was sampled from
    the row of its parent: the root's row 0, then row node + 1 along the accepted path."""
    out: list[tuple[TokenLogprob, ...]] = []
    if logits is None or all(s.logprobs is None for s in inputs):
        return [()] * len(inputs)
    at = 0  # the forward's logits rows: each input's num_logits, in order
    for s, (accepted, next_token, _carry, path) in zip(inputs, found):
        first, at = at, at + s.num_logits
        if s.logprobs is None:
            out.append(())
            continue
        tokens = list(accepted) + ([] if next_token is None else [next_token])
        rows = [first] + [first + p + 1 for p in (path or [])]
        lp = logits[rows[:len(tokens)]].float().log_softmax(-1)  # [emitted, vocab]
        chosen = lp[torch.arange(len(tokens), device=lp.device),
                    torch.tensor(tokens, device=lp.device)].tolist()
        tops = [()] * len(tokens)
        if s.logprobs:
            v, i = lp.topk(s.logprobs, dim=-1)
            tops = [tuple(zip(ii, vv)) for ii, vv in zip(i.tolist(), v.tolist())]
        out.append(tuple(TokenLogprob(t, c, top) for t, c, top in zip(tokens, chosen, tops)))
    return out
