"""The verifier's engine loop: schedule, wait briefly for drafts, verify, commit, stream.

Lives on the asyncio event loop; the torch step runs in a single worker thread. Draft workers
are optional at every moment: a session without proposals simply decodes plainly.
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from tandem.spec.methods import METHOD_TO_PB
from tandem.telemetry import VerifierMetrics
from tandem.v1 import common_pb2, draft_pb2
from verify_service.draft_link import DraftLink, DraftPool
from verify_service.engine import EngineCore, RoundOutcome, StepInput
from verify_service.scheduler import ScheduledSeq, Scheduler
from verify_service.sequence import DraftToken, GenerateParams, Sequence
from tandem.spec.cost import update_acceptance

log = logging.getLogger(__name__)


class EngineFullError(Exception):
    """No room for another session (gRPC RESOURCE_EXHAUSTED)."""


@dataclass(frozen=True)
class EngineConfig:
    max_sessions: int = 64
    max_draft_wait_ms: float = 25.0  # longest a step waits for missing draft tokens
    # Seeded sampling is reproducible only with a fixed round shape, so those sessions wait
    # longer for their k drafts (still failing open when the draft worker is gone or stuck).
    seeded_draft_wait_ms: float = 1000.0
    top_n: int = 8  # size of the sparse q asked from draft workers

    def __post_init__(self):
        if self.max_sessions < 1 or self.max_draft_wait_ms < 0 or self.top_n < 1:
            raise ValueError(f"invalid EngineConfig {self}")


@dataclass(frozen=True)
class RoundOutput:
    token_ids: list[int]
    num_committed: int
    drafted: int
    accepted: int
    bonus: bool
    draft_wait_ms: float
    verify_ms: float
    rejection_ms: float
    rounds: int
    drafted_total: int
    accepted_total: int
    finish_reason: str | None


class AsyncEngine:
    def __init__(self, core: EngineCore, scheduler: Scheduler, drafts: DraftPool | None,
                 config: EngineConfig, vocab_size: int, metrics: VerifierMetrics | None = None):
        self.core, self.scheduler, self.config = core, scheduler, config
        self.metrics = metrics
        self.vocab_size = vocab_size
        self.drafts = drafts
        self.sessions: dict[str, Sequence] = {}
        self._queues: dict[str, asyncio.Queue[RoundOutput]] = {}
        self._links: dict[str, DraftLink] = {}
        self._attaching: set[str] = set()
        self._carried: dict[str, torch.Tensor] = {}  # [vocab] probs of carried sessions
        self._wakeup = asyncio.Event()
        self._arrived = asyncio.Event()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="verify-forward")
        self._arrival_ms = 5.0  # EMA of the gap between draft tokens, for the wait bound
        self._last_arrival = 0.0

    # ---- requests -------------------------------------------------------------------------
    def submit(self, params: GenerateParams) -> asyncio.Queue[RoundOutput]:
        if params.session_id in self.sessions:
            raise ValueError(f"session {params.session_id!r} is already generating here")
        if len(self.sessions) >= self.config.max_sessions:
            raise EngineFullError(f"verifier is full ({self.config.max_sessions} sessions)")
        blocks = self.scheduler.blocks
        need = -(-(len(params.prompt) + params.max_new_tokens) // blocks.block_size)
        if need > blocks.num_blocks:  # would wait forever: refuse, another verifier may fit it
            raise EngineFullError(
                f"the session needs {need} KV blocks, this verifier's cache has "
                f"{blocks.num_blocks} (of {blocks.block_size} tokens)")
        seq = Sequence(params)
        self.scheduler.add(seq)  # raises ValueError if it cannot fit the context
        self.sessions[seq.seq_id] = seq
        self._queues[seq.seq_id] = queue = asyncio.Queue()
        self._wakeup.set()
        if seq.speculating and self.drafts is not None:
            asyncio.get_running_loop().create_task(self._attach_draft(seq))
        return queue

    def abort(self, seq_id: str) -> None:
        seq = self.sessions.get(seq_id)
        if seq is not None and not seq.finished:
            self.scheduler.abort(seq_id)
            self._release(seq)

    @property
    def load(self) -> int:
        return len(self.sessions)

    # ---- draft side -----------------------------------------------------------------------
    async def _attach_draft(self, seq: Sequence) -> None:
        if seq.draft_attaches_left <= 0 or seq.seq_id in self._attaching:
            return  # decodes plainly from now on / an attach is already under way
        seq.draft_attaches_left -= 1
        self._attaching.add(seq.seq_id)
        try:
            link = await self.drafts.get(seq.params.draft_address)
        finally:
            self._attaching.discard(seq.seq_id)
        if link is None or seq.finished or seq.seq_id not in self.sessions:
            return
        self._links[seq.seq_id] = link
        seq.drafts = []
        p = seq.params
        link.send(draft_pb2.DraftControl(open=draft_pb2.OpenSession(
            session_id=seq.seq_id, token_ids=seq.tokens, epoch=seq.epoch,
            trace_context=dict(p.trace_context),
            method=METHOD_TO_PB[p.method], max_run_ahead=self.scheduler.config.max_spec_tokens,
            top_n=self.config.top_n,
            sampling=common_pb2.SamplingParams(
                temperature=p.sampling.temperature, top_k=p.sampling.top_k,
                top_p=p.sampling.top_p, seed=p.sampling.seed))))

    def on_draft_message(self, link: DraftLink, msg: draft_pb2.DraftProposal) -> None:
        seq = self.sessions.get(msg.session_id)
        if seq is None or self._links.get(msg.session_id) is not link or seq.finished:
            return  # closed session or one that moved to another link: harmless
        if msg.HasField("error"):
            log.info("draft %s gave up on %s: %s", link.address, seq.seq_id, msg.error.message)
            self._links.pop(seq.seq_id, None)
            seq.drafts = []
            return
        if msg.epoch != seq.epoch:
            return  # drafted before the last divergence
        token = self._checked_draft(seq, msg)
        if token is None:  # malformed or out of order: resynchronise this session only
            self._links.pop(seq.seq_id, None)
            link.send(draft_pb2.DraftControl(close=draft_pb2.CloseSession(session_id=seq.seq_id)))
            seq.drafts = []
            return
        seq.drafts.append(token)
        now = time.perf_counter()
        gap_ms = (now - self._last_arrival) * 1e3
        if gap_ms < 200:  # gaps across idle periods say nothing about drafting speed
            self._arrival_ms = 0.8 * self._arrival_ms + 0.2 * gap_ms
        self._last_arrival = now
        self._arrived.set()

    def _checked_draft(self, seq: Sequence, msg) -> DraftToken | None:
        v = self.vocab_size
        if msg.position != seq.next_draft_position() or not 0 <= msg.token_id < v:
            return None
        ids, probs = tuple(msg.q.token_ids), tuple(msg.q.probs)
        if ids or probs:
            if len(ids) != len(probs) or any(not 0 <= i < v for i in ids):
                return None
            if any(not math.isfinite(p) or p < 0 for p in probs) or abs(sum(probs) - 1) > 1e-3:
                return None
            if msg.token_id not in ids or probs[ids.index(msg.token_id)] <= 0:
                return None
        return DraftToken(msg.position, msg.token_id, ids, probs)

    def on_link_broken(self, link: DraftLink) -> None:
        if self.drafts is not None:
            self.drafts.mark_failed(link.address)
        for seq_id, owner in list(self._links.items()):
            if owner is link:
                del self._links[seq_id]
                seq = self.sessions.get(seq_id)
                if seq is not None:
                    seq.drafts, seq.epoch = [], seq.epoch + 1

    def _send_commit(self, seq: Sequence, start: int, tokens: list[int]) -> None:
        link = self._links.get(seq.seq_id)
        if link is None:
            if (seq.speculating and self.drafts is not None and not seq.finished
                    and seq.draft_attaches_left > 0):
                asyncio.get_running_loop().create_task(self._attach_draft(seq))
            return
        link.send(draft_pb2.DraftControl(commit=draft_pb2.CommitTokens(
            session_id=seq.seq_id, epoch=seq.epoch, start_position=start, token_ids=tokens)))

    def _release(self, seq: Sequence) -> None:
        link = self._links.pop(seq.seq_id, None)
        if link is not None:
            link.send(draft_pb2.DraftControl(close=draft_pb2.CloseSession(session_id=seq.seq_id)))
        self.sessions.pop(seq.seq_id, None)
        self._carried.pop(seq.seq_id, None)
        queue = self._queues.pop(seq.seq_id, None)
        if queue is not None and seq.finish_reason == "abort":
            queue.put_nowait(self._output(seq, [], 0, 0, 0.0, 0.0, 0.0))

    # ---- the loop -------------------------------------------------------------------------
    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self.sessions:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            wait_ms = await self._wait_for_drafts()
            sched = self.scheduler.schedule()
            for seq in sched.preempted:  # its draft session restarts after re-admission
                self._send_commit(seq, seq.num_tokens, [])
            if sched.empty:
                await asyncio.sleep(0.005)  # blocks are held by sessions about to finish
                continue
            inputs = [self._snapshot(s) for s in sched.scheduled]
            try:
                outcomes, timings = await loop.run_in_executor(
                    self._executor, self.core.execute, inputs)
            except Exception:  # a bug in one step must not kill the server: fail the batch
                log.exception("verification step failed")
                for s in sched.scheduled:
                    self.scheduler.finish(s.seq, "abort")
                    self._release(s.seq)
                continue
            only = sched.scheduled[0]
            if len(inputs) == 1 and not only.is_prefill:
                # The whole round, drafting wait and sampling included: what k really costs.
                self.scheduler.cost.observe(only.num_drafts + 1, wait_ms + timings.forward_ms
                                            + timings.rejection_ms)
            for s, outcome in zip(sched.scheduled, outcomes):
                self._apply(s, outcome, wait_ms, timings)

    def _snapshot(self, s: ScheduledSeq) -> StepInput:
        seq = s.seq
        return StepInput(s.token_ids, s.start_pos, list(self.scheduler.blocks.block_table(
            seq.seq_id)), list(seq.drafts[: s.num_drafts]), seq.params.sampling,
            carried=self._carried.get(seq.seq_id) if seq.carried else None,
            sample_bonus=not self._may_carry(seq, s.num_drafts))

    def _may_carry(self, seq: Sequence, k: int) -> bool:
        """Skip the bonus token when the draft's next token is already here (stochastic only:
        greedy is identical either way, and seeded runs keep a fixed round shape)."""
        s = seq.params.sampling
        return (k >= 1 and len(seq.drafts) > k and not s.is_greedy and s.seed is None
                and seq.seq_id in self._links
                and len(seq.output) + k < seq.params.max_new_tokens)

    async def _wait_for_drafts(self) -> float:
        """Wait (bounded) until speculating sessions have the drafts they could use."""
        start = time.perf_counter()
        while True:
            limit_ms = 0.0
            for seq in self.scheduler.running:
                missing = self.scheduler.desired_k(seq) - len(seq.drafts)
                if seq.seq_id not in self._links or missing <= 0:
                    continue
                s = seq.params.sampling
                # n-gram drafts are instant or absent: only a draft model is worth the wait.
                seeded = s.seed is not None and not s.is_greedy
                allowed = (self.config.seeded_draft_wait_ms
                           if seeded and seq.params.method == "draft_model" else
                           min(self.config.max_draft_wait_ms, missing * self._arrival_ms * 1.5))
                limit_ms = max(limit_ms, allowed)
            now = time.perf_counter()
            budget = start + limit_ms / 1e3 - now
            if budget <= 0:
                return (now - start) * 1e3
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), budget)
            except asyncio.TimeoutError:
                return (time.perf_counter() - start) * 1e3

    def _apply(self, s: ScheduledSeq, outcome: RoundOutcome, wait_ms, timings) -> None:
        seq = s.seq
        if seq.finished or seq.seq_id not in self.sessions:
            return  # aborted while the step ran; its blocks are already freed
        accepted, next_token = outcome.accepted, outcome.next_token
        self.scheduler.update_from_output(s, len(accepted))
        start = seq.num_tokens
        new = seq.commit(accepted, next_token)
        seq.carried = next_token is None and not seq.finished
        if seq.carried:
            self._carried[seq.seq_id] = outcome.carry
        else:
            self._carried.pop(seq.seq_id, None)
        st = seq.stats
        st.rounds += 1
        st.drafted += s.num_drafts
        st.accepted += len(accepted)
        if s.num_drafts:
            seq.acceptance_ema = update_acceptance(seq.acceptance_ema, s.num_drafts,
                                                   len(accepted))
        if self.metrics is not None:
            self.metrics.observe_round(s.num_drafts, len(accepted), wait_ms,
                                       timings.forward_ms, timings.rejection_ms)
        out = self._output(seq, new, s.num_drafts, len(accepted), wait_ms,
                           timings.forward_ms, timings.rejection_ms,
                           bonus=next_token is not None and len(accepted) == s.num_drafts)
        self._queues[seq.seq_id].put_nowait(out)
        if seq.finished:
            self.scheduler.finish(seq)
            self._release(seq)
        else:
            self._send_commit(seq, start, new)

    @staticmethod
    def _output(seq: Sequence, new: list[int], drafted: int, accepted: int,
                wait_ms: float, verify_ms: float, rejection_ms: float,
                bonus: bool = False) -> RoundOutput:
        st = seq.stats
        return RoundOutput(
            token_ids=new, num_committed=len(seq.output), drafted=drafted, accepted=accepted,
            bonus=bonus, draft_wait_ms=wait_ms,
            verify_ms=verify_ms, rejection_ms=rejection_ms, rounds=st.rounds,
            drafted_total=st.drafted, accepted_total=st.accepted,
            finish_reason=seq.finish_reason)

    async def close(self) -> None:
        for seq_id in list(self.sessions):
            self.abort(seq_id)
        if self.drafts is not None:
            await self.drafts.close()
        self._executor.shutdown(wait=False, cancel_futures=True)
