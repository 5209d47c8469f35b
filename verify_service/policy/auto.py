"""Which proposal a session drafted in the verifier verifies each round; for
`speculation.method = "auto"`, the best of several.

Proposers:
- the token history (suffix decoding and n-gram lookup, verify_service/drafts/history.py), asked
  every round over the committed tokens;
- for auto, the Medusa heads when this verifier has them: they run after a step on the row
  that gave the round's last token (verify_service/forward/features.py), only once the history has
  missed a few rounds in a row and not after a round that verified its drafts: a match that
  held, or one that just broke off, is usually there again next round, and the heads' pass
  would be wasted; a stretch without one is where the heads earn their few ms;
- for auto linked to a draft worker's model method (GenerateParams.auto_draft, chosen by the
  gateway), that worker's chain (Sequence.remote, apart from the others' drafts): asked for
  drafts (run-ahead > 0) only on the same terms as the heads, and only as many as pay for
  their verify cost plus their expected wait (remote_run_ahead); the link opens with the
  first ask (until then it costs nothing), then gets every commit, paused (run-ahead 0)
  while the worker is not asked, with a probe now and then that is
  never waited for. Only drafts that arrived within the step's wait bound compete
  (verify_service/drafts/waits.py: none is waited for in a round the history proposes); a worker
  fault only empties the chain (speculation fails open).

Proposals are compared by expected tokens per ms of verify cost, each at its best size
(tandem.spec.cost.best_rate): every node's estimated reach times the session's correction for
that source (Sequence.est.source_scale, learnt from its own rounds), so a proposer that keeps
over-promising loses the next comparisons. A worker's chain is estimated as draft-worker
chains are: its k-th token reaches with the session's measured acceptance of that worker's
drafts (Sequence.est.acceptance_ema) to the k-th power.

Pure Python, like the scheduler.
"""
from __future__ import annotations

from tandem.proposers.prediction import FREE_SOURCES
from tandem.spec import DraftToken, Method
from tandem.spec.cost import best_rate, choose_tree_size
from verify_service.policy.batch import draft_bar, plan_curve
from verify_service.policy.feedback import note_link_round
from verify_service.policy.scheduler import EXPLORE_EVERY, Scheduler
from verify_service.session.sequence import LocalProposal, Sequence

# Rounds in a row the token history must find nothing before the heads are asked: on copy
# work a miss is usually one round between two matches, and a heads' pass then (3-4 ms on
# this CPU, a sixth of a round) is wasted when the next round matches again.
HEADS_AFTER_MISSES = 2
# Rounds between probes of a draft worker whose chain does not pay.
PROBE_EVERY = 8 * EXPLORE_EVERY
# What a grammar-forced draft is expected to reach: the grammar allows it alone, but the
# target may spell the same text in other tokens (`{"` or `{` then `"`).
FORCED_REACH = 0.95


def wants_heads(seq: Sequence, num_drafts: int) -> bool:
    """Whether an auto session's step should also run the heads for its next round: not when
    this round verifies the history's drafts, nor until the history has missed a few rounds
    in a row (see the module docstring)."""
    return (seq.params.method is Method.AUTO and seq.local.history_misses >= HEADS_AFTER_MISSES
            and not (num_drafts and seq.local.source in FREE_SOURCES))


def heads_proposal(scheduler: Scheduler, seq: Sequence, drafts, parents) -> LocalProposal:
    """The heads' drafts as a proposal, with their held-out reach per node."""
    reach = scheduler.heads_reach(seq)
    return LocalProposal(list(drafts), tuple(parents), [float(r) for r in reach[:len(drafts)]])


def head_nodes(scheduler: Scheduler, seq: Sequence, heads_ms: float = 0.0) -> int:
    """Nodes of the heads' proposal worth drafting for the next round: 0 when none pays
    for the verify cost plus the heads' own pass (heads_ms, spent whether or not their
    proposal is then picked), so heads that do not pay for themselves are not run. Under a
    batch plan also none where their first node cannot clear the step's bar (batch.draft_bar):
    the plan would cut its drafts after the pass was paid (at 16 sessions through the gateway,
    auto drafted nothing in most runs and ran 10% under plain: its heads' passes)."""
    reach = seq.scaled_reach(Method.MEDUSA, scheduler.heads_reach(seq))
    plan = plan_curve(scheduler.step_cost, scheduler.num_sessions)
    if plan is not None and (not reach or reach[0] <= draft_bar(plan, len(scheduler.running))):
        return 0
    return choose_tree_size(reach, scheduler.k_allowed(seq), scheduler.cost_of(seq), heads_ms)


def remote_reach(seq: Sequence, n: int) -> list[float]:
    """A draft worker's chain of n: its k-th token reaches with the session's measured
    acceptance of that worker's drafts to the k-th power (before source_scale)."""
    return [seq.est.acceptance_ema ** (i + 1) for i in range(n)]


def remote_run_ahead(scheduler: Scheduler, seq: Sequence, first_ms: float,
                     gap_ms: float) -> int:
    """Drafts to ask an auto session's draft worker for, for its next round: none while the
    history matches or its drafts are verified, nor before it missed HEADS_AFTER_MISSES
    rounds (the worker then drafts nothing: the link costs a commit message); else the chain
    that pays for its verify cost plus its expected wait (first_ms to the first draft, gap_ms
    per further one), and one more that may match the bonus token. When none pays, a probe
    now and then (PROBE_EVERY rounds, rarer than the scheduler's: a probe makes the worker
    catch up on what it skipped, which on a host it shares with the verifier costs the
    verifier), so that the estimates can move.
    Called after the round was recorded: stats.rounds counts the next round."""
    remote = seq.params.auto_draft
    if remote is None or seq.finished or seq.local.source in FREE_SOURCES or (
            seq.local.history_misses < HEADS_AFTER_MISSES and seq.local.source is not remote):
        return 0
    k_allowed = scheduler.k_allowed(seq)
    k = choose_tree_size(seq.scaled_reach(remote, remote_reach(seq, k_allowed)), k_allowed,
                         scheduler.cost_of(seq), first_ms, gap_ms)  # a chain: a gap a draft
    if k == 0 and k_allowed and seq.stats.rounds % PROBE_EVERY == EXPLORE_EVERY - 1:
        k = 1  # a probe (never waited for: verify_service/drafts/waits.py)
    return k + 1 if k else 0


def pick(scheduler: Scheduler, seq: Sequence, asked: int = 0) -> None:
    """Take the proposal that promises the most tokens per ms into the session's drafts
    (the only one, for a single-source session); the others are dropped. An auto session's
    worker chain competes when some of it arrived (`asked`: the run-ahead its link was asked
    for; waited for and none came is a late round)."""
    proposals, seq.local.proposals = seq.local.proposals, {}
    seq.local.source = None
    matched = any(m in proposals for m in FREE_SOURCES)
    seq.local.history_misses = 0 if matched else seq.local.history_misses + 1
    k_allowed = scheduler.k_allowed(seq)
    if seq.remote and seq.params.auto_draft is not None:
        drafts = seq.remote[:k_allowed]
        proposals[seq.params.auto_draft] = LocalProposal(list(drafts), None,
                                                    remote_reach(seq, len(drafts)))
        note_link_round(seq, arrived=True)
    elif asked and not matched:  # waited for (verify_service/drafts/waits.py), and none came
        note_link_round(seq, arrived=False)
    if not proposals or seq.finished:
        return
    _join_agreeing(proposals)
    source = max(proposals, key=lambda m: best_rate(
        seq.scaled_reach(m, proposals[m].reach), k_allowed, scheduler.cost_of(seq)))
    chosen = proposals[source]
    seq.take_drafts(chosen.drafts, chosen.parents, chosen.reach)
    seq.local.source = source


def _join_agreeing(proposals: dict) -> None:
    """Where one history proposal is the start of a longer one, the shorter is dropped: the
    longer drafts the same tokens and more. On a copy they agree (suffix decoding stops at
    its match's length, n-gram lookup drafts on, with its copy estimates): compared apart,
    the shorter's surer-looking start won, and a copy under way was verified a few tokens a
    round where n-gram lookup alone went to the cap. (Two alike are left to the rates.)"""
    history = [m for m in FREE_SOURCES if m in proposals and proposals[m].parents is None]
    if len(history) < 2:
        return
    long, short = sorted(history, key=lambda m: -len(proposals[m].drafts))[:2]
    a, b = proposals[long].drafts, proposals[short].drafts
    if len(b) < len(a) and [d.token_id for d in b] == [d.token_id for d in a[:len(b)]]:
        del proposals[short]


def grammar_forced(seq: Sequence, k_allowed: int) -> None:
    """Structured output: the tokens the grammar allows alone from here (a key, its quotes
    and `": "`) are drafts of confidence ~1 at no cost; they replace the round's proposal
    unless it already starts with them."""
    forced = seq.grammar.forced[:k_allowed] if seq.grammar is not None else []
    if not forced:
        return
    if [d.token_id for d in seq.drafts[:len(forced)]] == forced:
        _forced_q(seq, len(forced))
        return
    seq.local.source = None
    seq.take_drafts([DraftToken(t) for t in forced], None,
                    [FORCED_REACH ** (i + 1) for i in range(len(forced))])


def _forced_q(seq: Sequence, n: int) -> None:
    """A proposal that already starts with the n forced tokens keeps its drafts, but their q
    is one-hot: whatever the proposer sampled, the round verifies the forced token there
    (any other would have been replaced), so that is the distribution it was drawn from."""
    parents = seq.draft_parents or tuple(range(-1, len(seq.drafts) - 1))
    lead = next((j for j in range(n) if parents[j] != j - 1), n)  # the chain part
    if all(not d.q_ids for d in seq.drafts[:lead]):
        return
    drafts = [DraftToken(d.token_id) for d in seq.drafts[:lead]] + seq.drafts[lead:]
    seq.take_drafts(drafts, seq.draft_parents)
