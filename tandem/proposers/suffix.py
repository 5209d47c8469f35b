"""Suffix decoding (ArcticInference's SuffixDecoding, vLLM's `suffix` method), no model.

Two corpora are searched for the longest earlier occurrence of the sequence's tail: the
session's own committed tokens (prompt and output so far, as prompt lookup does) and a cache of
earlier finished sequences (prompt and output), global or per tenant, bounded in tokens and
evicted oldest first. Every occurrence of that longest match votes for its continuation: the
proposal follows the most frequent token at each step, and stops once the estimated chance that
the whole proposal is right (the product of the vote shares) falls below `min_prob`, or at
`spec_factor` x the match length, so a long confident match drafts far and a short or
ambiguous one drafts little. Of the two corpora's proposals the one with the larger expected
accepted length wins. Strong where outputs repeat: the same question asked again, agent loops,
code edits. Proposals are deterministic, so q is one-hot (as for ngram).

Occurrences are found through an index from each `anchor`-gram to the positions that follow it,
then extended backwards (vectorised over occurrences) to measure each match's length.
"""
from __future__ import annotations

import math
from collections import Counter, OrderedDict, deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np

from tandem.proposers.ngram import confidences, propose_copy
from tandem.spec import DraftRequest, DraftResult, DraftToken, Method
from tandem.spec.cost import DEFAULT_MAX_SPEC_TOKENS

_SEP = -1  # between sequences in a corpus: no match or continuation crosses it


class TokenLog:
    """Token sequences laid end to end, with an index from each anchor-gram to the positions
    right after its occurrences (ascending). Appending is amortised O(anchor) per token."""

    def __init__(self, anchor: int):
        self.anchor = anchor
        self.buf = np.full(1024, _SEP, dtype=np.int64)
        self.length = 0
        self.index: dict[tuple[int, ...], list[int]] = {}

    @property
    def tokens(self) -> np.ndarray:  # [length]
        return self.buf[:self.length]

    def extend(self, tokens: Sequence[int]) -> None:
        """Append tokens to the current sequence and index the anchor-grams they complete."""
        n, start = len(tokens), self.length
        if n == 0:
            return
        if start + n > len(self.buf):
            grown = np.full(max(2 * len(self.buf), start + n), _SEP, dtype=np.int64)
            grown[:start] = self.buf[:start]
            self.buf = grown
        self.buf[start:start + n] = tokens
        self.length = start + n
        a, lo = self.anchor, max(0, start - self.anchor + 1)
        window = self.buf[lo:self.length].tolist()
        for end in range(max(start, a - 1), self.length):  # the gram ending at position end
            gram = tuple(window[end - a + 1 - lo:end + 1 - lo])
            if _SEP not in gram:
                self.index.setdefault(gram, []).append(end + 1)

    def end_sequence(self) -> None:
        self.extend([_SEP])

    def candidates(self, tail: tuple[int, ...], limit: int, live_start: int = 0) -> np.ndarray:
        """Positions after the most recent `limit` occurrences of tail that have a continuation."""
        found = self.index.get(tail)
        if not found:
            return np.empty(0, dtype=np.int64)
        pos = np.asarray(found[-limit:], dtype=np.int64)
        pos = pos[(pos >= live_start + self.anchor) & (pos < self.length)]
        return pos[self.buf[pos] != _SEP] if len(pos) else pos


@dataclass(frozen=True)
class Speculation:
    tokens: list[int]
    score: float  # expected accepted tokens: the sum of the prefix probabilities
    match_len: int
    probs: tuple[float, ...] = ()  # each token's prefix probability (its chance to be reached)


_NOTHING = Speculation([], 0.0, 0)


def speculate(log: TokenLog, context: Sequence[int], max_tokens: int, *, max_match: int = 32,
              min_prob: float = 0.1, spec_factor: float = 1.0, max_candidates: int = 256,
              live_start: int = 0) -> Speculation:
    """Up to max_tokens tokens continuing context, voted by its longest matches in log."""
    a = log.anchor
    if max_tokens < 1 or len(context) < a:
        return _NOTHING
    pos = log.candidates(tuple(context[-a:]), max_candidates, live_start)
    if len(pos) == 0:
        return _NOTHING
    match = _match_lengths(log, context, pos, max_match, live_start)
    best = int(match.max())
    pos = pos[match == best]  # [n] the longest matches' continuation starts
    limit = min(max_tokens, max(1, math.ceil(spec_factor * best)))
    cols = pos[:, None] + np.arange(limit)  # [n, limit]
    rows = np.where(cols < log.length, log.buf[np.minimum(cols, len(log.buf) - 1)], _SEP)
    tokens, probs = _vote(rows.tolist(), min_prob)
    # No surer than an n-gram match of the same length (ngram.confidences, measured on this
    # target): one earlier occurrence votes 1.0 for every token it continues with, which under
    # load priced a 3-token chat match as certain (gains 1.0; 78% accepted, rows at 0.85 of a
    # token at 16 sessions) and lost 3-4% of plain's throughput.
    probs = [min(p, c) for p, c in zip(probs, confidences(best, len(probs)))]
    return Speculation(tokens, sum(probs), best, tuple(probs))


def _vote(rows: list[list[int]], min_prob: float) -> tuple[list[int], list[float]]:
    """Follow the most frequent next token among the rows (the continuations of the longest
    matches, oldest first) that agree so far; each token's probability is the product of its
    vote shares. In plain Python: the rows are few and short, where numpy's per-call overhead
    made this loop most of a lookup (0.6 ms, a few % of a copy round)."""
    tokens: list[int] = []
    probs: list[float] = []
    prob = 1.0
    for j in range(len(rows[0]) if rows else 0):
        col = [row[j] for row in rows]
        counts = Counter(v for v in col if v != _SEP)
        if not counts:
            break
        top = max(counts.values())
        tied = [v for v, c in counts.items() if c == top]
        # Ties go to the most recent occurrence's token: recent text predicts better.
        token = tied[0] if len(tied) == 1 else next(v for v in reversed(col) if v in tied)
        prob *= top / len(col)  # sequences that ended here vote for stopping
        if prob < min_prob:
            break
        tokens.append(token)
        probs.append(prob)
        rows = [row for row in rows if row[j] == token]
    return tokens, probs


def _match_lengths(log: TokenLog, context: Sequence[int], pos: np.ndarray, max_match: int,
                   live_start: int) -> np.ndarray:
    """[n] how many tokens before each position in pos agree with context's tail (at least
    the anchor, which the index already matched), all depths compared at once."""
    a = log.anchor
    depth = min(max_match, len(context))
    if depth <= a:
        return np.full(len(pos), a, dtype=np.int64)
    tail = np.asarray(context[-depth:], dtype=np.int64)[::-1][a:]  # [depth - a] context[-1 - i]
    idx = pos[:, None] - 1 - np.arange(a, depth)  # [n, depth - a]
    ok = (idx >= live_start) & (log.buf[np.maximum(idx, 0)] == tail)
    return a + np.cumprod(ok, axis=1).sum(axis=1)


class SequenceCache:
    """Finished sequences, oldest evicted first once more than max_tokens are held."""

    def __init__(self, anchor: int, max_tokens: int):
        self.anchor, self.max_tokens = anchor, max_tokens
        self.log = TokenLog(anchor)
        self.live_start = 0
        self._spans: deque[tuple[int, int]] = deque()  # [start, end) of each held sequence

    @property
    def held_tokens(self) -> int:
        return self.log.length - self.live_start

    def add(self, tokens: Sequence[int]) -> None:
        tokens = list(tokens)[-self.max_tokens:]
        if len(tokens) <= self.anchor:
            return
        start = self.log.length
        self.log.extend(tokens)
        self.log.end_sequence()
        self._spans.append((start, self.log.length))
        while self.held_tokens > self.max_tokens and self._spans:
            self._spans.popleft()
            self.live_start = self._spans[0][0] if self._spans else self.log.length
        if self.live_start > self.max_tokens:  # dead space as big as the budget: compact
            self._compact()

    def _compact(self) -> None:
        held = [self.log.buf[s:e - 1].tolist() for s, e in self._spans]
        self.log, self.live_start, self._spans = TokenLog(self.anchor), 0, deque()
        for seq in held:
            start = self.log.length
            self.log.extend(seq)
            self.log.end_sequence()
            self._spans.append((start, self.log.length))


@dataclass(frozen=True)
class SuffixConfig:
    """Suffix decoding's knobs (flags `--suffix-*` on `tandem draft`)."""

    anchor: int = 3  # tokens an occurrence must share with the tail before it is a candidate
    max_match: int = 32  # longest match measured
    min_prob: float = 0.1  # stop a proposal once its estimated chance falls below this
    spec_factor: float = 1.0  # draft at most this many tokens per matched token
    max_candidates: int = 256  # most recent occurrences considered per lookup
    cache_tokens: int = 262_144  # finished tokens held per scope (0 = no cross-request cache)
    per_tenant: bool = False  # one cache per tenant instead of one shared by all
    max_tenants: int = 64  # per_tenant: caches held, least recently used dropped

    def __post_init__(self) -> None:
        for name in ("anchor", "max_match", "max_candidates", "max_tenants"):
            value = getattr(self, name)
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
                raise ValueError(f"suffix {name} must be an int >= 1, got {value!r}")
        if not (isinstance(self.cache_tokens, int) and self.cache_tokens >= 0):
            raise ValueError(f"suffix cache_tokens must be an int >= 0, got "
                             f"{self.cache_tokens!r}")
        if self.max_match < self.anchor:
            raise ValueError(f"suffix max_match {self.max_match} is below anchor {self.anchor}")
        if not (isinstance(self.min_prob, (int, float)) and 0.0 <= self.min_prob <= 1.0):
            raise ValueError(f"suffix min_prob must be in [0, 1], got {self.min_prob!r}")
        factor = self.spec_factor
        if not (isinstance(factor, (int, float)) and math.isfinite(factor) and factor > 0):
            raise ValueError(f"suffix spec_factor must be a finite number > 0, got {factor!r}")


def _shorter_match(context: Sequence[int], anchor: int, k: int) -> Speculation:
    """Prompt lookup below the anchor: where no occurrence shares `anchor` tokens with the
    tail (the first decode step, whose tail is the chat template's and the first token; the
    round after a copy broke off), the most recent one sharing fewer, with n-gram lookup's
    estimates, or the copy resumed past one added token (tandem/proposers/ngram.py
    propose_copy): a short match drafts little, and the session's correction for suffix
    learns what such matches are worth."""
    if anchor < 2 or len(context) < 2:
        return _NOTHING
    tokens, held, probs = propose_copy(context, anchor - 1, k)
    return Speculation(tokens, sum(probs), held, probs) if tokens else _NOTHING


class SuffixProposer:
    """Suffix decoding behind the Proposer (and Learner) interface. State: each open session's
    own token log, and per scope a cache of finished sessions' text (fed by learn())."""

    method = Method.SUFFIX

    def __init__(self, config: SuffixConfig | None = None,
                 max_spec_tokens: int = DEFAULT_MAX_SPEC_TOKENS):
        if max_spec_tokens < 1:
            raise ValueError(f"max_spec_tokens must be >= 1, got {max_spec_tokens}")
        self.config = config or SuffixConfig()
        self.max_spec_tokens = max_spec_tokens
        self._own: dict[Hashable, TokenLog] = {}  # session_key -> its committed tokens
        self._caches: OrderedDict[str, SequenceCache] = OrderedDict()

    def propose(self, requests: list[DraftRequest]) -> list[DraftResult]:
        return [self._propose_one(req) for req in requests]

    def _propose_one(self, req: DraftRequest) -> DraftResult:
        c = self.config
        own = self._own.setdefault(req.session_key, TokenLog(c.anchor))
        if own.length < req.num_committed:  # committed tokens never change: index the new ones
            own.extend(req.token_ids[own.length:req.num_committed])
        k = min(req.max_tokens, self.max_spec_tokens)
        knobs = dict(max_match=c.max_match, min_prob=c.min_prob, spec_factor=c.spec_factor,
                     max_candidates=c.max_candidates)
        best = speculate(own, req.token_ids, k, **knobs)
        scope = self._scope(req.tenant)
        cache = self._caches.get(scope)
        if cache is not None:
            self._caches.move_to_end(scope)
            other = speculate(cache.log, req.token_ids, k, live_start=cache.live_start, **knobs)
            if other.score > best.score:
                best = other
        if not best.tokens and k > 0:
            best = _shorter_match(req.token_ids, c.anchor, k)
        return DraftResult([DraftToken(t) for t in best.tokens], scores=best.probs)

    def release(self, session_key: Hashable) -> None:
        self._own.pop(session_key, None)

    def learn(self, tenant: str, token_ids: list[int]) -> None:
        """Cache a finished session's text (prompt and output) in its scope."""
        c = self.config
        if c.cache_tokens == 0:
            return
        scope = self._scope(tenant)
        cache = self._caches.get(scope)
        if cache is None:
            cache = self._caches[scope] = SequenceCache(c.anchor, c.cache_tokens)
            while len(self._caches) > c.max_tenants:
                self._caches.popitem(last=False)
        self._caches.move_to_end(scope)
        cache.add(token_ids)

    def _scope(self, tenant: str) -> str:
        """The cache a tenant reads and feeds: its own, or the one all share."""
        return tenant if self.config.per_tenant else ""
