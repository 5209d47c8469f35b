"""Drafts that cost nothing on the critical path: n-gram prompt lookup and suffix decoding
run here, inside the verifier's own step, where the tokens already are (as vLLM does). A
session of these methods never opens a draft link and never waits for a network hop; each
round it gets a fresh proposal over its committed tokens, with every token's estimated chance
of being reached (`Sequence.draft_reach`), from which the scheduler sizes the round: long
drafts when the match is long and has held, none when nothing matches.

A request's prediction (Predicted Outputs, GenerateParams.prediction) is one more such
source (tandem/proposers/prediction.py), whatever the method: with `none` the only one, with
ngram, suffix and auto one proposal beside theirs (auto.pick takes the one that promises the
most tokens per ms). A model method's session with a prediction is run by the servicer as
auto (verify_service/server.py), so it lands here too.
"""
from __future__ import annotations

from collections.abc import Callable

from tandem.proposers.ngram import NgramProposer
from tandem.proposers.prediction import PREDICTION, PredictionProposer, Source
from tandem.proposers.suffix import SuffixConfig, SuffixProposer
from tandem.spec import DraftRequest, Method, Proposer
from tandem.spec.methods import HISTORY_SOURCES
from tandem.spec.proposer import Learner, propose_isolated
from verify_service.session.sequence import LocalProposal, Sequence

HISTORY_METHODS = frozenset({Method.NGRAM, Method.SUFFIX, Method.AUTO})


class HistoryDrafts:
    """The verifier's own ngram and suffix proposers. Called on the event loop between steps
    (a lookup is microseconds to a few ms; never a model forward)."""

    def __init__(self, max_tokens: int, suffix: SuffixConfig | None = None):
        # One suffix cache per tenant, as the draft worker's default: one API key's text never
        # drafts (or speeds up) another's.
        suffix = suffix or SuffixConfig(per_tenant=True)
        self.prediction = PredictionProposer(max_spec_tokens=max_tokens)
        self.proposers: dict[Method | Source, Proposer] = {
            Method.NGRAM: NgramProposer(max_spec_tokens=max_tokens),
            Method.SUFFIX: SuffixProposer(suffix, max_spec_tokens=max_tokens),
            PREDICTION: self.prediction}
        # What finished sessions measured of each source (accepted / expected: their
        # Sequence.est.source_scale), smoothed: a new session starts from it rather than from the
        # proposers' raw estimates, which a short request has no rounds to correct. Kept apart
        # for greedy and sampled sessions: a sampled one keeps a draft only with the target's
        # probability of it, so the same proposal reaches less far.
        self.scale: dict[tuple[Method, bool], float] = {}
        self.caps = RoundCaps()

    @staticmethod
    def serves(method: Method, prediction: bool = False) -> bool:
        """Whether a session of `method` (with a prediction or not) drafts here."""
        return method in HISTORY_METHODS or prediction

    def fill(self, seqs: list[Sequence], k_allowed: Callable[[Sequence], int]) -> None:
        """Each session's (local, speculating, with no drafts yet) proposals for this round,
        one per source it drafts from, into Sequence.proposals: drafts and their reach (the
        proposer's own confidence per token). verify_service/policy/auto.py picks among them. A
        proposer that fails or finds no match proposes nothing."""
        ks = {seq.session_id: k for seq in seqs if (k := k_allowed(seq)) > 0}
        caps = {seq.session_id: self.caps.update(seq) for seq in seqs}
        by_method: dict[Method | Source, list[Sequence]] = {}
        for seq in seqs:
            if seq.session_id in ks:
                if seq.params.prediction:  # (once: later calls find it open)
                    self.prediction.open(seq.session_id, seq.params.prediction,
                                         len(seq.params.prompt))
                for method in _sources(seq.params.method, bool(seq.params.prediction)):
                    by_method.setdefault(method, []).append(seq)
        for method, group in by_method.items():
            cap = (lambda seq: caps[seq.session_id]) if method in HISTORY_SOURCES else \
                (lambda seq: ks[seq.session_id])
            reqs = [DraftRequest(session_key=seq.session_id, token_ids=seq.tokens,
                                 num_committed=seq.num_tokens,
                                 max_tokens=min(ks[seq.session_id], cap(seq)),
                                 sampling=seq.params.sampling, tenant=seq.params.tenant)
                    for seq in group]
            for seq, res in zip(group, propose_isolated(self.proposers[method], reqs)):
                if res.error is None and res.tokens:
                    seq.local.offer(method, LocalProposal(
                        list(res.tokens), None, [float(r) for r in res.scores[:len(res.tokens)]]))

    def prior_scales(self, method: Method, greedy: bool = True, prediction: bool = False
                     ) -> dict[Method | Source, float]:
        """The corrections a new session of `method` (with a prediction or not) starts from,
        per source it drafts from (Sequence.est.source_scale)."""
        sources = _sources(method, prediction)
        sources = (*sources, Method.MEDUSA) if method is Method.AUTO else sources
        return {m: self.scale.get((m, greedy), 1.0) for m in sources}

    def finish(self, seq: Sequence) -> None:
        """The session is over: forget its state; suffix decoding learns its text; its
        measured correction moves the next sessions' start."""
        method = seq.params.method
        self.caps.forget(seq.session_id)
        for source, scale in seq.est.source_scale.items():
            if source in seq.est.drafted_from:  # a source never used says nothing new
                key = (source, seq.params.sampling.is_greedy)
                self.scale[key] = 0.7 * self.scale.get(key, 1.0) + 0.3 * scale
        for m in _sources(method, bool(seq.params.prediction)):
            proposer = self.proposers[m]
            proposer.release(seq.session_id)
            if isinstance(proposer, Learner) and seq.finish_reason != "abort":
                proposer.learn(seq.params.tenant, seq.tokens)


def _sources(method: Method, prediction: bool = False) -> tuple[Method | Source, ...]:
    """The proposers a session of `method` drafts from (auto: both; a prediction: it too)."""
    own = HISTORY_SOURCES if method is Method.AUTO else \
        (method,) if method in HISTORY_METHODS else ()
    return (*own, PREDICTION) if prediction else own


class RoundCaps:
    """k carried up fast on a run of acceptances and down fast on a miss, for the history's
    drafts: after a round whose history drafts were all kept the cap doubles (none at first:
    the proposal's own estimates size the opening rounds), after one that broke off it falls
    to two past what was kept. A broken copy (a quote that jumps to another sentence, a
    conversion between fields) then verifies a few drafts where its next match's estimates
    alone verified 11-16 and kept 1-3; a copy that resumes after one changed token (a rename)
    is back at the cap within three rounds."""

    UNCAPPED = 1 << 30

    def __init__(self):
        self._seen: dict[str, tuple[int, int, int]] = {}  # session -> drafted, accepted, cap

    def update(self, seq: Sequence) -> int:
        """The session's cap for this round, from its last round (Sequence.stats)."""
        drafted, accepted, cap = self._seen.get(seq.session_id, (0, 0, self.UNCAPPED))
        d, a = seq.stats.drafted - drafted, seq.stats.accepted - accepted
        if d > 0 and seq.local.source in HISTORY_SOURCES:
            cap = min(self.UNCAPPED, 2 * cap) if a >= d else a + 2
        self._seen[seq.session_id] = (seq.stats.drafted, seq.stats.accepted, cap)
        return cap

    def forget(self, session_id: str) -> None:
        self._seen.pop(session_id, None)
