"""What the batch plan (Scheduler.plan, tandem/spec/batch_plan.py) reads off the sessions: each
draft's expected gain, what a session's drafts make the step wait, and each method's
acceptance pooled over its sessions. Pure Python, like the scheduler.

Why pooled: a session's own acceptance starts at a prior (Estimates.acceptance_ema, 0.7) and
takes a dozen rounds to move, which is most of a short answer; under load every session of a
method at that prior made the plan verify drafts the method did not deliver. A fresh session
leans on what its method's other sessions measured, its own rounds weighing more as they come.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from tandem.spec import Method
from tandem.spec.cost import StepCost
from verify_service.session.sequence import Estimates, Sequence

POOL_DECAY = 0.98  # per round with drafts: the pool follows the current sessions
# Per verifier step with sessions of the method, drafting or not: evidence ages, so a pool
# nobody drafted into lately weighs less, and under one trial says nothing (the prior again).
AGE_DECAY = 0.995
# Trials in the pool (aged) that make a worker session's probe unneeded: probes feed the
# method's pool (one probe's draft moves a session's own estimate by 1/OWN_WEIGHT_DRAFTS),
# so how often a method is probed follows how fresh its evidence is, not how many sessions
# it has: about one probe in 45 of its steps at any load, not each session's every 16th round
# (each a wait for drafts, and for a session not yet linked, the worker's prefill).
FRESH_TRIALS = 4.0
PROBE_GRACE = 4  # rounds a worker probe whose drafts are late stays open for them (late_probe)
OWN_WEIGHT_DRAFTS = 16  # drafts of its own after which a session trusts its own estimate
PRIOR_ACCEPTANCE = Estimates().acceptance_ema  # what a session assumes before it measures


def from_worker(seq: Sequence) -> bool:
    """A session whose chain of drafts comes from a draft worker (the step waits for it)."""
    return not (seq.local.in_verifier or seq.params.method.in_verifier or seq.params.tree)


@dataclass
class AcceptancePool:
    """Per method, decayed sums over its sessions' rounds of accepted drafts and of accepted
    plus rejected (a round that stops short rejects one): accepted / that estimates the
    per-token acceptance, as update_acceptance does per session. Both sums also age with
    every step (age), which leaves the rate as it is but shrinks its weight: fresh() says
    whether probes are still needed, and a pool aged under one trial gives no rate (sessions
    fall back on the prior, draft, and it learns again)."""

    sums: dict[Method, tuple[float, float]] = field(default_factory=dict)

    def learn(self, method: Method, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        acc, n = self.sums.get(method, (0.0, 0.0))
        trials = accepted + (1 if accepted < drafted else 0)
        self.sums[method] = (POOL_DECAY * acc + accepted, POOL_DECAY * n + trials)

    def age(self, decoding: list[Sequence]) -> None:
        """A step went by, drafting or not: the methods of its worker sessions age (a method
        nobody uses keeps what it learnt until it is used again)."""
        for method in {s.params.method for s in decoding if from_worker(s)} & self.sums.keys():
            acc, n = self.sums[method]
            self.sums[method] = (AGE_DECAY * acc, AGE_DECAY * n)

    def rate(self, method: Method) -> float | None:
        acc, n = self.sums.get(method, (0.0, 0.0))
        return acc / n if n >= 1.0 else None

    def hopeful_rate(self, method: Method) -> float | None:
        """rate() with one more accepted trial: what a probe may still hope for (a pool
        of few trials hopes more)."""
        acc, n = self.sums.get(method, (0.0, 0.0))
        return (acc + 1.0) / (n + 1.0) if n >= 1.0 else None

    def fresh(self, method: Method) -> bool:
        return self.sums.get(method, (0.0, 0.0))[1] >= FRESH_TRIALS


def plan_curve(step_cost: StepCost, num_sessions: int) -> StepCost | None:
    """The step curve a batch plan prices the rounds by: once it is measured and more than one
    session shares the verifier; None otherwise (each session on its own cost curve)."""
    return step_cost if step_cost.known and num_sessions > 1 else None


def probe_round(seq: Sequence, pool: AcceptancePool, step_cost: StepCost, num_sessions: int,
                periodic: bool, ahead: int = 0, batch: int = 1) -> bool:
    """Whether a session's round `ahead` rounds from now probes (verifies a draft where its
    estimates say drafts do not pay). `periodic`: one of its every-EXPLORE_EVERY rounds; a
    worker session skips it while its method's pool is fresh (it would wait for drafts to tell
    the pool what it knows). Where a batch plan prices the rounds of `batch` sessions
    (plan_curve), which it does not cut a probe from, a probe must be able to pay
    (probe_pays). A worker session's first decode round (the prefill is round 0) probes
    whatever the pool says (no evidence of its own: it drafts), so sessions too short to reach
    a probe round still draft, unless a batch plan prices its rounds: there its Open (at
    admission, sessions of a burst too) would cost the worker a prefill for nothing. A probe
    whose drafts were late stays open (late_probe)."""
    if late_probe(seq, ahead):
        return True
    plan = plan_curve(step_cost, num_sessions)
    if from_worker(seq) and seq.stats.rounds + ahead == 1 and not seq.stats.drafted:
        return plan is None
    if not periodic or (from_worker(seq) and pool.fresh(seq.params.method)):
        return False
    return plan is None or probe_pays(seq, plan, batch, pool)


def unplanned_cap(seq: Sequence, step_cost: StepCost, num_sessions: int) -> int | None:
    """The cap on drafts of a worker session no plan has seen yet (just admitted: its Open
    would ask for its first round's drafts now): none where a batch plan will price its rounds
    (plan_curve), whose first plan then sizes them, and a probe opens the link a round ahead
    where the pool needs one (Scheduler.probes); else None (the session's own k). At 4
    sessions through the gateway every draft_model session opened at admission, each a
    prefill and drafts on the worker (on the verifier's cores) that the first plan then cut."""
    return 0 if from_worker(seq) and plan_curve(step_cost, num_sessions) is not None else None


def late_probe(seq: Sequence, ahead: int = 0) -> bool:
    """Whether the session's round `ahead` rounds from now is in an open probe's window: a
    worker probe whose drafts had not come by its round (probe_window) verifies them in any of
    the next PROBE_GRACE rounds, whenever they come, never waited for. Closed once it verified
    drafts (Scheduler.update_from_output). A probe that verified nothing told the pool nothing,
    so the next periodic round probed again: at 4 sessions through the gateway each session
    asked the worker every 16 rounds for drafts that came a step late, and 10 of 13 asks ended
    unverified, each a catch-up and drafts on the worker's (the verifier's) cores."""
    return from_worker(seq) and seq.stats.rounds + ahead <= seq.sched.probe_until


def probe_window(seq: Sequence, probing: bool, verified: int, planned: bool) -> int:
    """The session's Scheduling.probe_until after scheduling a round: a worker probe
    (`probing`, not already open) that verifies no draft (`verified`: none had come) stays open
    for PROBE_GRACE rounds (late_probe), where a batch plan prices the step (`planned`: the
    step does not wait for it). Alone, a probe waits for its drafts as any round does; a window
    there would stop the waits of a drafter slower than a step (layer skip's first drafts)."""
    if probing and planned and not verified and from_worker(seq) and not late_probe(seq):
        return seq.stats.rounds + PROBE_GRACE
    return seq.sched.probe_until


def probe_pays(seq: Sequence, plan: StepCost, batch: int,
               pool: AcceptancePool | None = None) -> bool:
    """Whether a probe's draft could pay in a step of `batch` sessions before the session's own
    correction: its prior (prior_reach) over the reach the step needs of a draft (draft_bar;
    on this CPU's int8 curve ~0.4 at 2 sessions, ~0.67 at 4, ~0.9 at 16, ~1.0 at 32, where a
    step is compute-bound). A probe tests that correction; below the
    bar no outcome changes the plan, and at 32 sessions the periodic probes were most of the
    drafted rows (one in 16 rounds of every session, each adding a row the plan had priced
    out)."""
    return prior_reach(seq, pool) > draft_bar(plan, batch)


def planned(step_cost: StepCost, decoding: int) -> bool:
    """Whether a batch plan sizes the drafts of a step of `decoding` sessions (Scheduler.plan):
    once the step curve is measured and more than one session decodes."""
    return decoding >= 2 and step_cost.known


def drafts_may_pay(step_cost: StepCost, decoding: int) -> bool:
    """Whether a step of `decoding` sessions could verify any draft: not where a batch plan
    prices it and a row costs at least a token there (draft_bar >= 1: no reach clears it, nor
    a probe's), as at 32 sessions on this CPU; the verifier then looks up no history drafts
    (Engine._draft_locally: about 1% of such a step went to proposals the plan cut)."""
    return not planned(step_cost, decoding) or draft_bar(step_cost, decoding) < 1.0


def draft_bar(plan: StepCost, batch: int) -> float:
    """The reach a draft needs in a step of `batch` sessions (gains): it pays for its row, and
    for that row once more where it is rejected. 0.67 at 4 sessions here, 1 once a row costs
    a token; near 0 where rows are nearly free (a GPU's small batches)."""
    bar = row_bar(plan, batch)
    return 2 * bar / (1 + bar)


def row_bar(plan: StepCost, batch: int) -> float:
    """What a draft must be worth (expected tokens) to pay for its row in a step of `batch`
    sessions: one row's cost over one token's there."""
    base = max(plan.cost(batch, anchor=batch), 1e-3)
    return max(0.0, plan.cost(batch + 1, anchor=batch) - base) * batch / base


def prior_reach(seq: Sequence, pool: AcceptancePool | None = None) -> float:
    """The session's next draft's estimated reach before what its rounds measured (which the
    probe tests): a history proposal's own estimate (Sequence.draft_reach, unscaled; none: 0),
    a worker chain's method's pooled acceptance with one more success (hopeful_rate), else the
    prior (Estimates' default: 0.7, which at 4 sessions cleared the bar for a draft model its
    pool had at 0.18: every probe then made the step wait for the worker, 8% of plain's
    throughput); heads and trees 1 (they probe as before)."""
    if seq.local.in_verifier:
        return seq.draft_reach[0] if seq.draft_reach else 0.0
    if not from_worker(seq):
        return 1.0
    pooled = pool.hopeful_rate(seq.params.method) if pool is not None else None
    return PRIOR_ACCEPTANCE if pooled is None else pooled


def chain_acceptance(seq: Sequence, pool: AcceptancePool) -> float:
    """The per-token acceptance the plan prices a worker chain at: the session's own EMA,
    leaning on its method's pool until it has drafted OWN_WEIGHT_DRAFTS tokens."""
    pooled = pool.rate(seq.params.method)
    if pooled is None:
        return seq.est.acceptance_ema
    w = min(1.0, seq.stats.drafted / OWN_WEIGHT_DRAFTS)
    return w * seq.est.acceptance_ema + (1 - w) * pooled


def gains(seq: Sequence, k: int, reach: list[float] | None, pool: AcceptancePool,
          bar: float = 0.0) -> list[float]:
    """What each of the session's first k drafts is worth to a shared step: its expected extra
    tokens (`reach`, its per-node estimates, Scheduler.reach; for a draft worker's chain, which
    has none, worker_reach) less, where it is rejected, its row once more at `bar` (row_bar:
    a row's cost in tokens). A rejected row delays every session beside it and saves nothing;
    where their asks end together (a burst, a benchmark's batch) that is all a session's drafts
    do unless it is the last to finish, so a shared step verifies a draft only where it pays
    for its row and, if rejected, for that row again: reach above draft_bar. At 4 sessions
    (in process, 4 reps of 4 chat prompts, 64 tokens each) plain's steps ran 64 per batch
    whatever the others drafted, and the rows the plan kept (42% rejected) cost ngram and
    suffix 4.5% of plain's throughput."""
    if not k:
        return []
    got = reach[:k] if reach is not None else worker_reach(seq, pool, k)
    return [g - bar * (1.0 - g) for g in got]


def worker_reach(seq: Sequence, pool: AcceptancePool, n: int) -> list[float]:
    """Each of the first n drafts of a worker's chain: reached with the acceptance the plan
    prices the chain at, to the power of its depth."""
    a = chain_acceptance(seq, pool)
    return [a ** (j + 1) for j in range(n)]


def wait_entry(seqs: list[Sequence], wait_ms: float) -> list[float]:
    """Each session's share of the step's wait for drafts, paid once if it verifies any: the
    verifier waits for the slowest session asked, scaled by the share of the batch asked
    (verify_service/drafts/waits.py), so each worker session asked adds wait_ms / batch."""
    share = wait_ms / max(1, len(seqs))
    return [share if from_worker(s) else 0.0 for s in seqs]


def asked_share(decoding: list[Sequence], desired_k: Callable[[Sequence], int]) -> float:
    """The share of the decoding sessions whose draft worker was asked for drafts (k > 0 by
    the last plan): who a step waits for (StepCost.observe learns the wait per whole batch)."""
    asked = sum(1 for s in decoding if from_worker(s) and desired_k(s) > 0)
    return asked / len(decoding) if decoding else 0.0
