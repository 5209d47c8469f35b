"""Which proposal a session drafted in the verifier verifies each round; for
`speculation.method = "auto"`, the best of several.

Proposers, none behind a network hop:
- the token history (suffix decoding and n-gram lookup, verify_service/history.py), asked
  every round over the committed tokens;
- for auto, the Medusa heads when this verifier has them: they run after a step on the row
  that gave the round's last token (verify_service/features.py), only once the history has
  missed a few rounds in a row and not after a round that verified its drafts: a match that
  held, or one that just broke off, is usually there again next round, and the heads' pass
  would be wasted; a stretch without one is where the heads earn their few ms.

Proposals are compared by expected tokens per ms of verify cost, each at its best size
(tandem.spec.cost.best_rate): every node's estimated reach times the session's correction for
that source (Sequence.source_scale, learnt from its own rounds), so a proposer that keeps
over-promising loses the next comparisons.

Pure Python, like the scheduler.
"""
from __future__ import annotations

from tandem.spec import DraftToken, Method
from tandem.spec.cost import best_rate, choose_tree_size
from verify_service.history import HISTORY_SOURCES
from verify_service.scheduler import Scheduler
from verify_service.sequence import Proposal, Sequence

# Rounds in a row the token history must find nothing before the heads are asked: on copy
# work a miss is usually one round between two matches, and a heads' pass then (3-4 ms on
# this CPU, a sixth of a round) is wasted when the next round matches again.
HEADS_AFTER_MISSES = 2
# What a grammar-forced draft is expected to reach: the grammar allows it alone, but the
# target may spell the same text in other tokens (`{"` or `{` then `"`).
FORCED_REACH = 0.95


def wants_heads(seq: Sequence, num_drafts: int) -> bool:
    """Whether an auto session's step should also run the heads for its next round: not when
    this round verifies the history's drafts, nor until the history has missed a few rounds
    in a row (see the module docstring)."""
    return (seq.params.method is Method.AUTO and seq.history_misses >= HEADS_AFTER_MISSES
            and not (num_drafts and seq.draft_source in HISTORY_SOURCES))


def heads_proposal(scheduler: Scheduler, seq: Sequence, drafts, parents) -> Proposal:
    """The heads' drafts as a proposal, with their held-out reach per node."""
    reach = scheduler.heads_reach(seq)
    return Proposal(list(drafts), tuple(parents), [float(r) for r in reach[:len(drafts)]])


def head_nodes(scheduler: Scheduler, seq: Sequence, heads_ms: float = 0.0) -> int:
    """Nodes of the heads' proposal worth drafting for the next round: 0 when none pays
    for the verify cost plus the heads' own pass (heads_ms, spent whether or not their
    proposal is then picked), so heads that do not pay for themselves are not run."""
    return choose_tree_size(seq.scaled_reach(Method.MEDUSA, scheduler.heads_reach(seq)),
                            scheduler.k_max(seq), scheduler.cost, heads_ms)


def pick(scheduler: Scheduler, seq: Sequence) -> None:
    """Take the proposal that promises the most tokens per ms into the session's drafts
    (the only one, for a single-source session); the others are dropped."""
    proposals, seq.proposals = seq.proposals, {}
    seq.draft_source = None
    seq.history_misses = 0 if any(m in proposals for m in HISTORY_SOURCES) else \
        seq.history_misses + 1
    if not proposals or seq.finished:
        return
    k_max = scheduler.k_max(seq)
    source = max(proposals, key=lambda m: best_rate(
        seq.scaled_reach(m, proposals[m].reach), k_max, scheduler.cost))
    chosen = proposals[source]
    seq.drafts, seq.draft_parents = list(chosen.drafts), chosen.parents
    seq.draft_reach, seq.draft_source = list(chosen.reach), source


def grammar_forced(seq: Sequence, k_max: int) -> None:
    """Structured output: the tokens the grammar allows alone from here (a key, its quotes
    and `": "`) are drafts of confidence ~1 at no cost; they replace the round's proposal
    unless it already starts with them."""
    forced = seq.grammar.forced[:k_max] if seq.grammar is not None else []
    if not forced or [d.token_id for d in seq.drafts[:len(forced)]] == forced:
        return
    seq.drafts, seq.draft_parents = [DraftToken(t) for t in forced], None
    seq.draft_reach, seq.draft_source = [FORCED_REACH ** (i + 1) for i in
                                         range(len(forced))], None
