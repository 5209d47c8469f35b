"""What a round teaches the planning of the next ones (verify_service/policy/scheduler.py reads it
back): the cost samples behind k and the batch plan, and each session's acceptance estimates
(its acceptance EMA, a tree's scale, its late rounds, how long its drafted trees take).

Pure Python, like the scheduler.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from tandem.spec.cost import update_acceptance, update_source_scale, update_tree_scale
from verify_service.policy.scheduler import ScheduledSeq, Scheduler
from verify_service.session.sequence import Sequence

if TYPE_CHECKING:  # torch stays out of the policy's imports
    from verify_service.forward.step import StepTimings


def observe_cost(scheduler: Scheduler, scheduled: list[ScheduledSeq], wait_ms: float,
                 timings: StepTimings) -> None:
    """Every decode step feeds the batch plan's step curve: its forward and rejection, and
    apart its wait for drafts (paid by the sessions asked for drafts, StepCost.wait_ms; on a
    shared host the draft worker's share of the cores shows up in both).
    Single-session rounds feed the cost model: the forward, rejection and sampling of q
    tokens, not the wait for drafts. Each kind of draft prices its own wait where it sizes
    k: a worker's chain by the draft side's latencies (Scheduler.draft_ms), a worker's tree by
    its own (Sequence.est.tree_wait_ms), auto's worker in remote_run_ahead. A curve that
    took the waits in mixed one method's rounds with another's (an n-gram round of 3 tokens
    waits for nothing) and forgot them once those sizes went unused, so the draft model was
    tried again, and lost again, every few hundred rounds."""
    if not any(x.is_prefill for x in scheduled):  # the batch plan's curve: whole steps
        scheduler.step_cost.observe(sum(len(x.token_ids) for x in scheduled),
                                    timings.forward_ms + timings.rejection_ms, wait_ms)
    s = scheduled[0]
    # Keyed by the tokens the forward really ran: a carried round runs only its drafts
    # (none at all when it samples straight from the carried row). A round whose drafts
    # came late waited for k but ran fewer: no sample of either cost (it counts as a miss).
    if (len(scheduled) == 1 and not s.is_prefill and s.token_ids
            and s.num_drafts >= s.wanted):
        scheduler.cost_of(s.seq).observe(len(s.token_ids),
                                         timings.forward_ms + timings.rejection_ms)


def observe_tree_wait(seq: Sequence, num_drafts: int, wait_ms: float) -> None:
    """A drafted tree's wait, from the commit to its last node (Sequence.est.tree_wait_ms): call
    it before the commit clears the tree."""
    if drafted_tree(seq) and num_drafts and seq.tree_complete:
        seq.est.tree_wait_ms = 0.7 * seq.est.tree_wait_ms + 0.3 * wait_ms


def learn_acceptance(seq: Sequence, s: ScheduledSeq, accepted: int,
                     reach: list[float] | None, linked: Callable[[Sequence], bool]) -> None:
    """The session's acceptance estimates after its round: `accepted` of s.num_drafts drafts
    (all of them, also those a stop token cut off); `reach`, for sessions sized node by
    node, the scheduler's estimate of each node (Scheduler.reach); `linked` says whether the
    session has a draft stream. A round whose wanted drafts had not come counts as a miss."""
    if s.num_drafts:
        seq.est.late_rounds = 0
    source = seq.local.source if seq.local.in_verifier else None
    if source is not None and source is seq.params.auto_draft:  # auto's draft worker chain
        if s.num_drafts:
            seq.est.acceptance_ema = update_acceptance(seq.est.acceptance_ema, s.num_drafts,
                                                       accepted)
            seq.est.drafted_from.add(source)
    elif reach is not None and source is not None:  # drafted here: that source's correction
        scale = seq.est.source_scale.get(source, 1.0)  # reach is scaled by it: undo that
        seq.est.source_evidence[source], seq.est.source_scale[source] = update_source_scale(
            seq.est.source_evidence.get(source), scale, sum(reach[:s.num_drafts]) / scale, accepted)
        seq.est.drafted_from.add(source)
    elif reach is not None:  # sized node by node: correct the nodes' estimates
        seq.est.tree_scale = update_tree_scale(seq.est.tree_scale, sum(reach[:s.num_drafts]),
                                           accepted)
    elif s.num_drafts:
        seq.est.acceptance_ema = update_acceptance(seq.est.acceptance_ema, s.num_drafts, accepted)
    elif s.wanted and linked(seq) and not seq.local.in_verifier:  # no draft came in time
        seq.est.late_rounds += 1
        seq.est.acceptance_ema = update_acceptance(seq.est.acceptance_ema, 1, 0)


def note_link_round(seq: Sequence, arrived: bool) -> None:
    """A round of a linked session: its link's drafts arrived (or a new stream opened, which
    gets waited for again), or they were waited for and none came."""
    seq.est.late_rounds = 0 if arrived else seq.est.late_rounds + 1


def drafted_tree(seq: Sequence) -> bool:
    """A session whose token trees come from a draft worker, drafted after each commit."""
    return bool(seq.params.tree) and not seq.params.method.in_verifier and not seq.local.in_verifier


class Latency:
    """A smoothed latency (ms) that climbs slowly and falls fast: one slow sample (or a slow
    spell of a faulty link) must not make every later round wait on drafts, and once the
    link is healthy the estimate is back within a few rounds (0.5 per sample down: 300 ms to
    under 25 in 5 healthy samples of 10 ms), where a plain EMA took a dozen."""

    UP, DOWN = 0.2, 0.5

    def __init__(self, initial_ms: float):
        self.ms = initial_ms

    def observe(self, sample_ms: float) -> None:
        w = self.DOWN if sample_ms < self.ms else self.UP
        self.ms = (1 - w) * self.ms + w * sample_ms
