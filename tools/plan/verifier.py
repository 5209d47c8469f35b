"""One verifier on a virtual clock: the REAL scheduler (batch, k per session, chunked prefill,
preemption), block manager, cost model, batch plan, auto.pick and the acceptance feedback
(verify_service/policy/*) drive each step; only the forward (a cost from the profile) and the
verdicts (accepted lengths drawn from the acceptance model) are modelled.

Left out: grammar masks, logprobs, trees, the Medusa heads, and the draft-wait rule's
estimates (the wait here is bounded the same way but knows when the drafts will come).
"""
from __future__ import annotations

import random
from types import SimpleNamespace

import simpy

from tandem.engine.block_manager import BlockManager
from tandem.sampling_params import SamplingParams
from tandem.spec import DraftToken, Method
from tandem.spec.cost import CostModel, StepCost
from tools.plan import drafts as dp
from tools.plan.acceptance import MethodAcceptance
from tools.plan.config import HISTORY_METHODS, LINKED_METHODS, SimConfig
from tools.plan.profile import Profile
from tools.plan.session import SimSession
from verify_service.config import SchedulerConfig
from verify_service.policy import auto
from verify_service.policy.calibration import STEP_CALIBRATION_COUNTS, calibration_counts
from verify_service.policy.feedback import learn_acceptance, observe_cost
from verify_service.policy.scheduler import ScheduledSeq, Scheduler
from verify_service.session.params import GenerateParams
from verify_service.session.sequence import LocalProposal, LocalProposals, Sequence

LATE_ROUNDS_NO_WAIT = 2  # verify_service/drafts/waits.py: a late session stops being waited for


def make_scheduler(cfg: SimConfig, profile: Profile) -> Scheduler:
    """The verifier's scheduler as verify_service/assemble.py builds it, its cost curves from
    the profile as start-up calibration would time them (one session, q tokens)."""
    blocks = BlockManager(max(1, profile.kv_tokens // profile.block_size), profile.block_size)
    sched_cfg = SchedulerConfig(
        max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
        max_spec_tokens=cfg.max_spec_tokens, prefill_chunk_tokens=cfg.prefill_chunk_tokens,
        max_model_len=max(8192, cfg.prompt_tokens + cfg.max_tokens + cfg.max_spec_tokens + 2),
        features_cached=True)
    solo = calibration_counts(cfg.max_spec_tokens)
    curve = {q: profile.step_ms(q, 1, 64) for q in sorted({*solo, *STEP_CALIBRATION_COUNTS})}
    step = StepCost(calibrated=curve) if cfg.batch_plan else StepCost()
    return Scheduler(blocks, sched_cfg, CostModel({q: curve[q] for q in solo}), step_cost=step)


class SimVerifier:
    """A verifier's engine loop: draft -> wait -> schedule -> forward -> apply, per step."""

    def __init__(self, env: simpy.Environment, cfg: SimConfig, profile: Profile,
                 acceptance: MethodAcceptance, rng: random.Random, ids, stats):
        self.env, self.cfg, self.profile, self.acc, self.rng = env, cfg, profile, acceptance, rng
        self.ids, self.stats = ids, stats  # token id counter; the run's SimStats
        self.scheduler = make_scheduler(cfg, profile)
        self.sessions: dict[str, SimSession] = {}
        self.colocated: list[dp.DraftWorker] = []  # drafts on this device: their time is ours
        self._charged_ms = 0.0
        self._wake = env.event()
        env.process(self._run())

    @property
    def load(self) -> int:
        return self.scheduler.num_sessions

    def submit(self, sess: SimSession) -> None:
        m = Method.parse(self.cfg.method)
        params = GenerateParams(
            session_id=sess.sid, prompt=sess.prompt, committed=(),
            sampling=SamplingParams(temperature=0.0), max_new_tokens=sess.request.max_tokens,
            stop_token_ids=frozenset(), method=m,
            num_speculative_tokens=self.cfg.num_speculative_tokens)
        local = LocalProposals(in_verifier=self.cfg.method in HISTORY_METHODS)
        sess.seq = Sequence(params, local=local)
        self.sessions[sess.sid] = sess
        self.scheduler.add(sess.seq)
        if not self._wake.triggered:
            self._wake.succeed()

    def _run(self):
        while True:
            if not self.scheduler.num_sessions:
                self._wake = self.env.event()
                yield self._wake
                continue
            self._draft_locally()
            wait = self._draft_wait_ms()
            if wait > 0:
                yield self.env.timeout(wait)
            self._collect()
            out = self.scheduler.schedule()
            for seq in out.preempted:
                self.stats.preemptions += 1
                self._restart_lane(self.sessions[seq.session_id])
            if out.empty:
                yield self.env.timeout(5.0)  # blocks held by sessions about to finish
                continue
            ms = self._step_ms(out.scheduled, wait)
            yield self.env.timeout(ms)
            self.stats.steps += 1
            self.stats.busy_ms += ms
            self.stats.waiting_sum += len(self.scheduler.waiting)  # what the HPA scales on
            self.stats.kv_usage_sum += self.scheduler.blocks.usage
            observe_cost(self.scheduler, out.scheduled, wait,
                         SimpleNamespace(forward_ms=ms, rejection_ms=0.0, heads_ms=0.0))
            for s in out.scheduled:
                self._apply(s, wait)

    def _step_ms(self, scheduled: list[ScheduledSeq], wait_ms: float) -> float:
        """The forward; on a device shared with drafts (colocated), also the drafting done
        since the last step that the wait for drafts did not already cover (one device runs
        one at a time)."""
        tokens = sum(len(s.token_ids) for s in scheduled)
        context = sum(s.start_pos for s in scheduled)
        ms = self.profile.step_ms(tokens, len(scheduled), context)
        drafted = sum(w.busy_ms for w in self.colocated)
        ms += max(0.0, drafted - self._charged_ms - wait_ms)
        self._charged_ms = drafted
        return ms

    def _draft_locally(self) -> None:
        """ngram / suffix: the history proposes (at the measured rate), auto.pick takes it."""
        if self.cfg.method not in HISTORY_METHODS:
            return
        source = Method.parse(self.cfg.method)
        for seq in self.scheduler.running:
            if seq.drafts or seq.sched.prefill_left or seq.finished:
                continue
            k = self.scheduler.k_allowed(seq)
            if k and self.rng.random() < self.acc.propose_rate:
                toks = [DraftToken(next(self.ids)) for _ in range(k)]
                seq.local.offer(source, LocalProposal(toks, None, self.acc.reach(k)))
            auto.pick(self.scheduler, seq, 0)

    def _collect(self) -> None:
        for seq in self.scheduler.running:
            lane = self.sessions[seq.session_id].lane
            if lane is not None:
                dp.collect(seq, lane, self.env.now)

    def _draft_wait_ms(self) -> float:
        """verify_service/drafts/waits.py's bound (the slowest session's allowance scaled by
        the share of the batch that waits), but ending when the drafts really come."""
        if self.cfg.method not in LINKED_METHODS or not self.scheduler.running:
            return 0.0
        self._collect()
        now, until, waiting = self.env.now, 0.0, 0
        for seq in self.scheduler.running:
            lane = self.sessions[seq.session_id].lane
            need = self.scheduler.desired_k(seq)
            if (seq.sched.prefill_left or need <= len(seq.drafts)
                    or seq.est.late_rounds >= LATE_ROUNDS_NO_WAIT):
                continue
            waiting += 1
            at = dp.arrival_of(seq, lane, need)
            until = max(until, float("inf") if at is None else at - now)
        if not waiting:
            return 0.0
        limit = self.cfg.max_draft_wait_ms * waiting / len(self.scheduler.running)
        return max(0.0, min(until, limit))

    def _apply(self, s: ScheduledSeq, wait_ms: float) -> None:
        seq = s.seq
        sess = self.sessions.get(seq.session_id)
        if sess is None or seq.finished:
            return
        if s.partial:
            self.scheduler.update_from_output(s, 0)
            return
        k = s.num_drafts
        n_acc = self.acc.sample(k, self.rng) if k else 0
        accepted = [d.token_id for d in seq.drafts[:n_acc]]
        nxt = self._next_token(seq, k, n_acc)
        self.scheduler.update_from_output(s, n_acc)
        reach = self.scheduler.reach(seq) if k else None
        new = seq.commit(accepted, nxt)
        self.scheduler.carry(seq, nxt is None and not seq.finished)
        learn_acceptance(seq, s, n_acc, reach, lambda q: sess.lane is not None)
        seq.stats.rounds += 1
        seq.stats.drafted += k
        seq.stats.accepted += min(n_acc, len(new))
        sess.emit(len(new), self.env.now + self.profile.hop_ms(), k, n_acc)
        if seq.finished:
            self.scheduler.finish(seq)
            self.sessions.pop(seq.session_id)
            if sess.lane is not None and sess.lane.worker is not None:
                sess.lane.worker.release(seq.session_id)
            sess.done(self.env)
        elif sess.lane is not None:
            want = self._run_ahead(seq)
            payload = len(new) * self.profile.feature_bytes_per_token
            dp.on_commit(seq, sess.lane, self.env.now, want, payload, self.profile)

    def _next_token(self, seq: Sequence, k: int, n_acc: int) -> int | None:
        """The round's last token: none when every draft was accepted and the next one is
        already waiting (the run-ahead carry, brief step 5); else the bonus or recovered
        token, equal to the next draft with that draft's acceptance chance."""
        if k and n_acc == k and len(seq.drafts) > k and not seq.local.in_verifier:
            return None
        if n_acc == k and len(seq.drafts) > k and self.rng.random() < self.acc.rate(k):
            return seq.drafts[k].token_id
        return next(self.ids)

    def _run_ahead(self, seq: Sequence) -> int:
        """verify_service/engine.py's _run_ahead: the session's k plus one for the bonus."""
        k = self.scheduler.desired_k(seq)
        return k + 1 if k else 0

    def _restart_lane(self, sess: SimSession) -> None:
        if sess.lane is not None:
            dp.on_commit(sess.seq, sess.lane, self.env.now, sess.lane.want, 0, self.profile)
