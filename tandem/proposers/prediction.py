"""Predicted Outputs (OpenAI's `prediction`), no model: the text the client expects, e.g. the
file a code edit rewrites, proposed as drafts. Free: nothing is drafted, the tokens are
already there.

Each session keeps where its output stands in the prediction. While the output follows it,
the next tokens of the prediction are the proposal. After a mismatch (the model renamed a
variable, added a docstring) the position is lost; each round then looks for the output's
recent tokens in the prediction, as suffix decoding does: the longest match of the output's
tail wins, and among equally long ones the nearest after the spot where the output last
followed the prediction (an edit usually goes on where it left off), else the nearest before
it. A match of fewer than MIN_MATCH tokens counts only within NEAR tokens after that spot. The
proposal follows the match.

Each token's reach (its estimated chance to be accepted) is p^(i+1), p growing with the
tokens the output has followed the prediction since the last (re)alignment: a fresh
1-token re-alignment is a guess (p = 2/3), a long run is nearly certain (p <= 0.97); halved
for each time the output already went elsewhere from the same spot (a model caught in a loop
comes back to it and leaves it again).
Proposals are deterministic, so q is one-hot: they go through the normal rejection path and
the output stays the target's (greedy: identical; sampled: distributed as plain decoding).
"""
from __future__ import annotations

import enum
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import numpy as np

from tandem.spec import DraftRequest, DraftResult, DraftToken
from tandem.spec.cost import DEFAULT_MAX_SPEC_TOKENS
from tandem.spec.methods import HISTORY_SOURCES


class Source(str, enum.Enum):
    """A verifier session's local proposal source that is no speculation method (keys of
    LocalProposals.proposals and Estimates.source_scale beside the Methods): not on the
    wire, it rides on any method."""

    PREDICTION = "prediction"

    @property
    def api_name(self) -> str:
        return self.value


PREDICTION = Source.PREDICTION
# The local sources that cost no drafting (no model, no wait): the token history and the
# prediction. While one of them proposes, auto neither runs its heads nor asks its worker.
FREE_SOURCES = (*HISTORY_SOURCES, PREDICTION)
MAX_MATCH = 32  # longest tail compared when re-aligning
# A re-alignment needs this many matching tokens, or fewer (down to 1) within NEAR tokens
# after where the output last followed the prediction: there a short match is the edit's
# own end (a renamed word, then the text goes on), elsewhere it is chance (prose that
# shares a " the" with the code).
MIN_MATCH = 3
NEAR = 16
MAX_CONFIDENCE = 0.97


@dataclass
class Alignment:
    """Where one session's output stands in its prediction."""

    prediction: np.ndarray  # [P] token ids
    start: int  # where the output begins in the session's tokens (the prompt's length)
    seen: int = 0  # output tokens consumed so far
    pos: int = 0  # the prediction's index of the next expected output token
    aligned: bool = True  # the output follows the prediction at pos (at first: from its start)
    run: int = 0  # tokens followed since the last (re)alignment (the match length included)
    last: int = 0  # the prediction's index where the output last followed it
    misses: dict[int, int] = field(default_factory=dict)  # prediction index -> diverged there

    def consume(self, output: Sequence[int]) -> None:
        """Follow the output tokens committed since the last call."""
        pred, n = self.prediction, len(self.prediction)
        for tok in output[self.seen:]:
            if self.aligned and self.pos < n and pred[self.pos] == tok:
                self.pos, self.run = self.pos + 1, self.run + 1
                self.last = self.pos
            else:
                if self.aligned:
                    self.misses[self.pos] = self.misses.get(self.pos, 0) + 1
                self.aligned, self.run = False, 0
        self.seen = len(output)
        if not self.aligned:
            self.realign(output)

    def realign(self, output: Sequence[int]) -> None:
        """Find the output's tail in the prediction: the longest match, nearest after `last`
        (then nearest before it); stays unaligned when even its last token is not there."""
        if not output:
            return
        pred = self.prediction
        ends = np.flatnonzero(pred[:-1] == output[-1]) + 1  # [n] positions right after a match
        if len(ends) == 0:
            return
        depth = min(MAX_MATCH, len(output))
        tail = np.asarray(output[-depth:], dtype=np.int64)[::-1][1:]  # output[-2], output[-3]..
        idx = ends[:, None] - 2 - np.arange(depth - 1)  # [n, depth - 1]
        ok = (idx >= 0) & (pred[np.maximum(idx, 0)] == tail)
        match = 1 + np.cumprod(ok, axis=1).sum(axis=1) if depth > 1 else np.ones(len(ends), int)
        near = (ends >= self.last) & (ends <= self.last + NEAR)
        valid = (match >= MIN_MATCH) | near
        if not valid.any():
            return
        ends, match = ends[valid], match[valid]
        best = ends[match == match.max()]
        after = best[best >= self.last]
        self.pos = int(after[0] if len(after) else best[-1])
        self.aligned, self.run = True, int(match.max())
        self.last = self.pos

    def proposal(self, max_tokens: int) -> tuple[list[int], list[float]]:
        """The next tokens of the prediction and each one's reach; none when unaligned."""
        if not self.aligned or max_tokens < 1:
            return [], []
        tokens = self.prediction[self.pos:self.pos + max_tokens].tolist()
        p = min(MAX_CONFIDENCE, 1.0 - 1.0 / (self.run + 2)) * 0.5 ** self.misses.get(self.pos, 0)
        return tokens, [p ** (i + 1) for i in range(len(tokens))]


class PredictionProposer:
    """Each open session's prediction and alignment (opened with its prediction; a session
    without one proposes nothing)."""

    method = PREDICTION

    def __init__(self, max_spec_tokens: int = DEFAULT_MAX_SPEC_TOKENS):
        if max_spec_tokens < 1:
            raise ValueError(f"max_spec_tokens must be >= 1, got {max_spec_tokens}")
        self.max_spec_tokens = max_spec_tokens
        self._sessions: dict[Hashable, Alignment] = {}

    def open(self, session_key: Hashable, prediction: Sequence[int], start: int) -> None:
        """The session's prediction; its output begins at token `start` (the prompt's end)."""
        if session_key not in self._sessions and len(prediction) > 0:
            self._sessions[session_key] = Alignment(np.asarray(prediction, dtype=np.int64),
                                                    start)

    def propose(self, requests: list[DraftRequest]) -> list[DraftResult]:
        return [self._propose_one(req) for req in requests]

    def _propose_one(self, req: DraftRequest) -> DraftResult:
        state = self._sessions.get(req.session_key)
        if state is None:
            return DraftResult([])
        state.consume(req.token_ids[state.start:req.num_committed])
        tokens, reach = state.proposal(min(req.max_tokens, self.max_spec_tokens))
        return DraftResult([DraftToken(t) for t in tokens], scores=tuple(reach))

    def release(self, session_key: Hashable) -> None:
        self._sessions.pop(session_key, None)
