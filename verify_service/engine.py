"""The verifier's speculation round, top to bottom: `Engine.step()`.

    wait for drafts -> schedule -> execute (target forward + rejection) -> apply and commit

Each phase has its own folder: drafts arrive in drafts/side.py, the batch is chosen by
policy/scheduler.py (pure Python), executed by forward/executor.py (torch, in one worker
thread so the event loop keeps serving health checks and draft streams), and the committed
tokens go back out here, to the client's queue and to the draft worker. The open sessions
live in sessions.py; what a round teaches the next ones' planning, in policy/feedback.py.
Draft workers are optional: a session without proposals simply decodes plainly."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from tandem.errors import recoverable
from tandem.grammar.state import GrammarFailed
from tandem.spec import Method
from tandem.telemetry import VerifierMetrics
from verify_service.drafts.history import HistoryDrafts
from verify_service.drafts.side import DraftSide
from verify_service.drafts.waits import draft_wait_limit_ms, run_ahead
from verify_service.forward.executor import Executor
from verify_service.forward.inputs import InputBuilder
from verify_service.forward.masks import MASK_WAIT_S, PENDING, MaskJob, MaskPool
from verify_service.forward.step import RoundOutcome, StepInput, StepTimings
from verify_service.policy import auto
from verify_service.policy.batch import drafts_may_pay
from verify_service.policy.feedback import learn_acceptance, observe_cost, observe_tree_wait
from verify_service.policy.scheduler import ScheduledSeq, Scheduler
from verify_service.session.params import GenerateParams
from verify_service.session.sequence import Estimates, LocalProposals, Sequence
from verify_service.sessions import RoundOutput, SessionTable

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineConfig:
    max_sessions: int = 64
    max_draft_wait_ms: float = 25.0  # longest a step waits for missing draft tokens
    top_n: int = 8  # size of the sparse q asked from draft workers
    forced_drafts: bool = True  # a grammar's forced tokens drafted (verify_service/policy/auto.py)

    def __post_init__(self):
        if self.max_sessions < 1 or self.max_draft_wait_ms < 0 or self.top_n < 1:
            raise ValueError(f"invalid EngineConfig {self}")


class Engine:
    def __init__(self, executor: Executor | None, scheduler: Scheduler, config: EngineConfig,
                 vocab_size: int, metrics: VerifierMetrics | None = None,
                 history: HistoryDrafts | None = None):
        self.executor, self.scheduler, self.config = executor, scheduler, config
        self.history = history  # ngram / suffix drafted here (None: by draft workers)
        self.table = SessionTable(scheduler, config.max_sessions, metrics)
        self.drafts = DraftSide(self.sessions, vocab_size, config.top_n,
                                scheduler.config.max_spec_tokens)
        self._wakeup = asyncio.Event()
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="verify-forward")
        self._masks = MaskPool()  # grammar masks: off the loop, in parallel
        self.inputs = InputBuilder(scheduler, self.table, self.drafts,
                                   has_heads=executor is not None and executor.heads is not None)
        self.heads_ms = 0.0  # a step's pass of the Medusa heads (EMA)

    @property
    def sessions(self) -> dict[str, Sequence]:
        """The open sessions by id (the table's; the draft side reads the same dict)."""
        return self.table.sessions

    # ---- requests -------------------------------------------------------------------------
    def submit(self, params: GenerateParams, grammar=None) -> asyncio.Queue[RoundOutput]:
        """Admit a session (`grammar`: its tandem.grammar.GrammarState, structured output)."""
        if params.prediction and self.history is None:  # drafted here or nowhere
            params = dataclasses.replace(params, prediction=())
        predicted = bool(params.prediction)
        local = self.history is not None and self.history.serves(params.method, predicted)
        scales = self.history.prior_scales(params.method, params.sampling.is_greedy,
                                           predicted) if local else {}
        seq, queue = self.table.admit(params, grammar=grammar,
                                      local=LocalProposals(in_verifier=local),
                                      est=Estimates(source_scale=scales))
        self._wakeup.set()
        # The Open asks for what the first decode round (after the prefill's) will verify:
        # where the method's pooled acceptance says drafts do not pay, one probe's, not 16.
        self.drafts.attach(seq, None if local else run_ahead(seq, self.scheduler, self.drafts, 1))
        return queue

    def abort(self, session_id: str) -> None:
        seq = self.sessions.get(session_id)
        if seq is not None and not seq.finished:
            self.scheduler.abort(session_id)
            self._release(seq)

    @property
    def load(self) -> int:
        return len(self.sessions)

    # ---- the loop -------------------------------------------------------------------------
    async def run(self) -> None:
        while True:
            if not self.sessions:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            try:
                await self.step()
            except BaseException as exc:  # a bug outside any one session's work: the loop
                if not recoverable(exc):  # must outlive it, or every session hangs
                    raise
                log.exception("verifier step failed; aborting its sessions")
                for seq in list(self.sessions.values()):
                    self._end(seq, "abort")

    async def step(self) -> None:
        """One round for every running session."""
        self.scheduler.draft_ms = (self.drafts.first.ms, self.drafts.arrival.ms)
        local = self._draft_locally()  # 1. drafts: the token-history ones made here, ...
        wait_ms = await self._wait_for_drafts()  # ... a bounded wait for arrivals, ...
        self._pick(local)  # ... and each local session's pick among its proposals
        sched = self.scheduler.schedule()  # 2. schedule: batch, k per session, preemption
        for seq in sched.preempted:  # its draft session restarts after re-admission
            self.drafts.commit(seq, seq.num_tokens, [])
        if sched.empty:
            await asyncio.sleep(0.005)  # blocks are held by sessions about to finish
            return
        scheduled, inputs = await self._step_inputs(sched.scheduled)
        if not scheduled:
            return
        try:  # 3. execute: one target forward over the flattened batch, then rejection
            outcomes, timings = await self._execute(inputs)
        except BaseException as exc:  # one session's bad row (or a bug) must not cost the
            if not recoverable(exc):  # others (a native panic is a BaseException)
                raise
            log.exception("verification step failed; retrying its sessions one by one")
            outcomes, timings = await self._execute_isolated(scheduled, inputs)
        else:
            observe_cost(self.scheduler, scheduled, wait_ms, timings)
            if timings.heads_ms:  # what an auto session's heads cost it (auto.head_nodes)
                self.heads_ms = (0.8 * self.heads_ms + 0.2 * timings.heads_ms
                                 if self.heads_ms else timings.heads_ms)
        for s, outcome in zip(scheduled, outcomes):  # 4. apply: commit, stream, tell
            if outcome is None:
                continue
            if s.partial:  # a prefill chunk: its KV is final, nothing to tell anyone yet
                if s.seq.session_id in self.sessions and not s.seq.finished:
                    self.scheduler.update_from_output(s, 0)
            else:
                self._apply(s, outcome, wait_ms, timings)

    def _draft_locally(self) -> list[Sequence]:
        if self.history is None or not drafts_may_pay(self.scheduler.step_cost,
                                                      len(self.scheduler.decoding())):
            return []
        seqs = [s for s in self.scheduler.running if s.local.in_verifier
                and not s.drafts and not s.sched.prefill_left and not s.finished]
        self.history.fill(seqs, self.scheduler.k_allowed)
        return seqs

    def _pick(self, seqs: list[Sequence]) -> None:
        for seq in seqs:  # one proposal each (auto: the best of several)
            auto.pick(self.scheduler, seq, self.drafts.asked(seq))
            if self.config.forced_drafts and not self._masks.busy(seq.session_id):
                auto.grammar_forced(seq, self.scheduler.k_allowed(seq))

    async def _execute(self, inputs: list[StepInput]):
        return await asyncio.get_running_loop().run_in_executor(
            self._thread, self.executor.execute, inputs)

    async def _execute_isolated(self, scheduled: list[ScheduledSeq], inputs: list[StepInput]
                                ) -> tuple[list[RoundOutcome | None], StepTimings]:
        """Each session of a failed step alone (safe: a retry writes the same KV slots, seeded
        draws are keyed by position). One failing again while another passes ends "fault"
        (its input: a 500, not replayed); if all fail the step is broken (a dead rank, the
        device): they are aborted, for the gateway to resume elsewhere."""
        outcomes: list[RoundOutcome | None] = []
        failed: list[tuple[ScheduledSeq, BaseException]] = []
        total = StepTimings(0.0, 0.0)
        for s, one in zip(scheduled, inputs):
            try:
                (outcome,), t = await self._execute([one])
            except BaseException as exc:
                if not recoverable(exc):
                    raise
                log.exception("session %s failed its verification step", s.seq.session_id)
                failed.append((s, exc))
                outcome, t = None, StepTimings(0.0, 0.0)
            outcomes.append(outcome)
            total = StepTimings(total.forward_ms + t.forward_ms,
                                total.rejection_ms + t.rejection_ms)
        alone = len(failed) < len(scheduled)  # others passed: these failed of themselves
        for s, exc in failed:
            self._end(s.seq, *(("fault", f"verification failed ({type(exc).__name__})")
                               if alone else ("abort",)))
        return outcomes, total

    async def _wait_for_drafts(self) -> float:
        """Wait (bounded) until speculating sessions have the drafts they could use."""
        start = time.perf_counter()
        while True:
            budget = start + self._draft_wait_limit_ms() / 1e3 - time.perf_counter()
            if budget <= 0:
                return (time.perf_counter() - start) * 1e3
            self.drafts.arrived.clear()
            try:
                await asyncio.wait_for(self.drafts.arrived.wait(), budget)
            except asyncio.TimeoutError:
                return (time.perf_counter() - start) * 1e3

    def _draft_wait_limit_ms(self) -> float:  # verify_service/drafts/waits.py
        return draft_wait_limit_ms(self.scheduler.running, self.scheduler, self.drafts,
                                   self.config.max_draft_wait_ms)

    async def _step_inputs(self, scheduled: list[ScheduledSeq]
                           ) -> tuple[list[ScheduledSeq], list[StepInput]]:
        """The step's inputs; a session whose grammar broke (or whose masks failed) ends
        here, alone, with why; one whose masks are late sits the step out."""
        drafts = [list(s.seq.drafts[:s.num_drafts]) for s in scheduled]
        masks = await self._masks.compute([
            MaskJob(s.seq.grammar, [d.token_id for d in ds], s.parents, s.seq.session_id,
                    deferrable=not s.is_prefill)
            if s.seq.grammar is not None and not s.partial else None
            for s, ds in zip(scheduled, drafts)], MASK_WAIT_S)
        kept, inputs = [], []
        for s, ds, mask in zip(scheduled, drafts, masks):
            if s.seq.finished or s.seq.session_id not in self.sessions:
                continue  # cancelled while the masks were made
            if mask is PENDING:  # its grammar is slow: the others do not wait for it
                self.scheduler.defer(s)
            elif isinstance(mask, GrammarFailed):
                log.info("session %s: %s", s.seq.session_id, mask)
                self._end(s.seq, "error", str(mask))
            elif isinstance(mask, BaseException):
                log.error("session %s: grammar masks failed: %r", s.seq.session_id, mask)
                self._end(s.seq, "fault", f"grammar masks failed ({type(mask).__name__})")
            else:
                kept.append(s)
                inputs.append(self.inputs.build(s, ds, mask, self.heads_ms))
        return kept, inputs

    def _apply(self, s: ScheduledSeq, outcome: RoundOutcome, wait_ms: float,
               timings: StepTimings) -> None:
        """4. apply: keep the round's KV, commit its tokens, learn from it, stream it to the
        client, then tell the draft worker (or finish the session)."""
        seq = s.seq
        if seq.finished or seq.session_id not in self.sessions:
            return  # aborted while the step ran; its blocks are already freed
        accepted, next_token = outcome.accepted, outcome.next_token
        # Roll back rejected KV (a tree's accepted path is already in place: name its tokens).
        self.scheduler.update_from_output(s, len(accepted), accepted if s.parents else None)
        reach = self.scheduler.reach(seq) if s.num_drafts else None  # before commit clears it
        observe_tree_wait(seq, s.num_drafts, wait_ms)  # ditto: reads the arrived tree
        start = seq.num_tokens
        new = seq.commit(accepted, next_token)  # may bump the epoch (the draft diverged)
        if seq.grammar is not None and not seq.grammar.commit(new):  # cannot happen: masked
            log.error("session %s: committed tokens the grammar forbids", seq.session_id)
        self.scheduler.carry(seq, next_token is None and not seq.finished)
        self.table.keep_carried(seq, outcome.carry)
        if outcome.tree is not None and not seq.finished:  # Medusa: the next round's tree
            if seq.local.in_verifier:  # auto: one of its proposals (auto.pick)
                seq.local.offer(Method.MEDUSA,
                                auto.heads_proposal(self.scheduler, seq, *outcome.tree))
            else:
                seq.take_drafts(*outcome.tree)
        learn_acceptance(seq, s, len(accepted), reach, self.drafts.linked)
        self.table.record(seq, new, s.num_drafts, len(accepted), wait_ms, timings,
                          bonus=next_token is not None and len(accepted) == s.num_drafts,
                          logprobs=outcome.logprobs[:len(new)])
        if seq.finished:
            self._end(seq)
        elif seq.speculating:  # (plain sessions have no draft side to tell)
            self.drafts.commit(seq, start, new, outcome.features,
                              run_ahead(seq, self.scheduler, self.drafts))

    def _end(self, seq: Sequence, reason: str | None = None, error: str = "") -> None:
        self.scheduler.finish(seq, reason, error)
        self._release(seq)

    def _release(self, seq: Sequence) -> None:
        self._masks.forget(seq.session_id)
        if seq.local.in_verifier:
            self.history.finish(seq)
        self.drafts.release(seq)
        self.table.release(seq)

    async def close(self) -> None:
        for session_id in list(self.sessions):
            self.abort(session_id)
        await self.drafts.close()
        self._thread.shutdown(wait=False, cancel_futures=True)
        self._masks.close()

