"""`speculation.method = "auto"`: each round, the best proposal the verifier can make itself.

Two proposers, neither behind a network hop:
- the token history (suffix decoding and n-gram lookup, verify_service/history.py), asked
  every round over the committed tokens;
- the Medusa heads, when this verifier has them: they run after a step on the row that gave
  the round's last token (verify_service/features.py), and only when that round verified no
  history drafts. A match that held is usually there again next round, so the heads' pass
  would be wasted; a round without one is where the heads earn their few ms.

Proposals are compared by expected tokens per ms of verify cost, each at its best size
(tandem.spec.cost.best_rate): every node's estimated reach times the session's correction for
that proposer (tree_scale for the history's, head_scale for the heads'), so a proposer that
keeps over-promising loses the next comparisons.

Pure Python, like the scheduler.
"""
from __future__ import annotations

from tandem.spec import Method
from tandem.spec.cost import best_rate, choose_tree_size
from verify_service.scheduler import Scheduler
from verify_service.sequence import Sequence

HISTORY_SOURCES = frozenset({Method.SUFFIX, Method.NGRAM})


def wants_heads(seq: Sequence, num_drafts: int) -> bool:
    """Whether an auto session's step should also run the heads for its next round: not when
    this round verifies the history's drafts (see the module docstring)."""
    return (seq.params.method is Method.AUTO
            and not (num_drafts and seq.draft_source in HISTORY_SOURCES))


def head_reach(scheduler: Scheduler, seq: Sequence) -> list[float]:
    """The heads' per-node reach for the session (their tree's or chain's held-out
    estimates), corrected by what its head rounds measured."""
    base = scheduler.tree_reach if seq.params.tree else scheduler.chain_reach
    return [min(1.0, r * seq.head_scale) for r in base]


def head_nodes(scheduler: Scheduler, seq: Sequence) -> int:
    """Nodes of the heads' proposal worth drafting for the next round (0: none pays)."""
    return choose_tree_size(head_reach(scheduler, seq), scheduler.k_max(seq), scheduler.cost)


def pick(scheduler: Scheduler, seq: Sequence) -> None:
    """After the history drafted (or found nothing): take the heads' proposal instead when it
    promises more tokens per ms. Either way the heads' proposal is used up."""
    proposal, seq.head_proposal = seq.head_proposal, None
    if proposal is None or seq.finished:
        return
    drafts, parents = proposal
    k_max = scheduler.k_max(seq)
    heads = head_reach(scheduler, seq)[:len(drafts)]
    history = scheduler.reach(seq) or []
    if best_rate(heads, k_max, scheduler.cost) > best_rate(history, k_max, scheduler.cost):
        base = scheduler.tree_reach if seq.params.tree else scheduler.chain_reach
        seq.drafts, seq.draft_parents = list(drafts), tuple(parents)
        seq.draft_reach = [float(r) for r in base[:len(drafts)]]
        seq.draft_source = Method.MEDUSA
