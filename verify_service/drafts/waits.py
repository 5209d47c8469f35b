"""How long a step may wait for draft tokens that are on their way (verify_service/engine.py
asks before each step). Pure Python, like the scheduler."""
from __future__ import annotations

from tandem.proposers.prediction import FREE_SOURCES
from verify_service.drafts.side import DraftSide
from verify_service.policy import auto
from verify_service.policy.batch import from_worker, late_probe, plan_curve
from verify_service.policy.scheduler import Scheduler, probing
from verify_service.session.sequence import Sequence

# After this many rounds in a row without the drafts it wanted, a session is no longer waited
# for (a draft worker that is partitioned or overloaded); drafts that do come are still used,
# and its periodic probe rounds are waited for again: a worker that was only slow at first
# (its prompt to read, its kernels cold) drafts after each commit while the verifier already
# runs the next round, so its drafts never came in time again and the session drafted nothing
# for good.
LATE_ROUNDS_NO_WAIT = 2


def missing(seq: Sequence, scheduler: Scheduler, drafts: DraftSide) -> int:
    """Draft tokens the session's next round could use that have not arrived. An auto
    session waits only for its draft worker's chain, only when it asked for one
    (verify_service/policy/auto.py) and only in a round its token history has nothing for: what
    it would not use is never waited for, nor a probe's (its chain did not pay its wait)."""
    if seq.local.in_verifier:
        asked = drafts.asked(seq)
        if not asked or probing(seq) or any(m in seq.local.proposals for m in FREE_SOURCES):
            return 0
        # the one past k is for the bonus token (unless the run-ahead cap took it)
        return max(1, asked - 1) - len(seq.remote)
    if seq.tree_complete or late_probe(seq) or planned_probe(seq, scheduler):
        return 0  # (a worker probe beside others: its drafts verified when they come)
    return scheduler.desired_k(seq) - len(seq.drafts)


def planned_probe(seq: Sequence, scheduler: Scheduler) -> bool:
    """A worker session's probe where a batch plan prices the step: not waited for (every
    session of the step would wait); its drafts are verified in the round they come by
    (policy/batch.py late_probe)."""
    return (from_worker(seq) and plan_curve(scheduler.step_cost, scheduler.num_sessions)
            is not None and scheduler.probes(seq))  # (the cheap tests first: a hot path)


def draft_wait_limit_ms(running: list[Sequence], scheduler: Scheduler, drafts: DraftSide,
                        max_wait_ms: float) -> float:
    """How long this step may wait for drafts: what the slowest session needs, scaled by
    the share of the batch that is waiting, since everyone else waits for nothing (one
    session's late drafts cost seven others 1/8 of its allowance, not all of it)."""
    limit_ms, waiting, d = 0.0, 0, drafts
    for seq in running:
        linked = d.linked(seq) or seq.local.in_verifier and d.coming(seq)  # (auto opens on asking)
        if not linked or (n := missing(seq, scheduler, d)) <= 0 or (
                seq.est.late_rounds >= LATE_ROUNDS_NO_WAIT and not probing(seq)):
            continue  # (drafts of a session that stopped being waited for still count)
        waiting += 1  # the first draft after a commit takes longer than the next ones
        if seq.params.tree and not seq.local.in_verifier:  # a tree comes at once, when drafted
            expected = max(seq.est.tree_wait_ms, d.first.ms)
        else:
            have = len(seq.link_drafts)
            expected = n * d.arrival.ms if have else d.first.ms + (n - 1) * d.arrival.ms
        limit_ms = max(limit_ms, min(max_wait_ms, 1.5 * expected))
    return limit_ms * waiting / len(running) if running else 0.0


def run_ahead(seq: Sequence, scheduler: Scheduler, drafts: DraftSide, ahead: int = 0) -> int:
    """Drafts worth having ready for the session's next round (`ahead` rounds later): its k,
    plus one that may match the bonus token; none while its speculation is off (k = 0) until
    a probe round. Drafting more only burns the draft worker's time (on a shared host, the
    verifier's). A session with no link yet (policy/batch.py: none until asked) asks a round
    before its probe: the link opens and the worker reads the text while the verifier does
    a plain round (never waited for: missing() counts the round's k), so the probe waits for
    its drafts, not for the worker's prefill, and its drafts come in time to say something."""
    if seq.local.in_verifier:  # auto's draft worker: only when its chain may be picked
        return auto.remote_run_ahead(scheduler, seq, drafts.first.ms, drafts.arrival.ms)
    k = scheduler.desired_k(seq, ahead)
    if seq.params.tree and k:  # a whole tree: the verifier sizes it once it arrives
        return scheduler.k_allowed(seq)
    if not k and not drafts.coming(seq) and scheduler.desired_k(seq, ahead + 1):
        return run_ahead(seq, scheduler, drafts, ahead + 1)  # what the probe will ask
    return k + 1 if k else 0
