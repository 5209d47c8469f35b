"""The verifier's open sessions and their bookkeeping: admission (a free place, a KV cache
that can hold the session), each session's output queue and carried target row, release;
and what each round streams to the client (RoundOutput), counted in the session's stats and
the Prometheus metrics as it goes out.

The round (verify_service/engine.py) decides what a session commits; this is where it lands.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

import torch

from tandem.errors import AlreadyExists, ResourceExhausted
from tandem.proposers.prediction import PREDICTION
from tandem.telemetry import VerifierMetrics
from verify_service.forward.step import StepTimings, TokenLogprob
from verify_service.policy.scheduler import Scheduler
from verify_service.session.params import GenerateParams
from verify_service.session.sequence import Sequence


@dataclass(frozen=True)
class RoundOutput:
    """What one round gave one session (streamed to the gateway)."""

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
    error: str = ""  # finish_reason "error" / "fault": why (the servicer ends the call with it)
    lossy: bool = False  # typical acceptance was used: not the target's distribution
    prediction_accepted: int = 0  # the session's prediction drafts kept so far (SessionStats)
    prediction_rejected: int = 0  # ... and verified but not kept
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token of token_ids, when asked for


class SessionTable:
    """The open sessions by id, and what each is owed between rounds."""

    def __init__(self, scheduler: Scheduler, max_sessions: int,
                 metrics: VerifierMetrics | None = None):
        self.scheduler, self.max_sessions, self.metrics = scheduler, max_sessions, metrics
        self.sessions: dict[str, Sequence] = {}
        self.queues: dict[str, asyncio.Queue[RoundOutput]] = {}
        self.carried: dict[str, torch.Tensor] = {}  # [vocab] probs of carried sessions

    def admit(self, params: GenerateParams, **records
              ) -> tuple[Sequence, asyncio.Queue[RoundOutput]]:
        """A new session (`records`: its Sequence's fields beside params), handed to the
        scheduler, and the queue its rounds go to. Refused
        when the id is taken here, the verifier is full, or the cache could never hold it."""
        if params.session_id in self.sessions:
            raise AlreadyExists(f"session {params.session_id!r} is already generating here")
        if len(self.sessions) >= self.max_sessions:
            raise ResourceExhausted(f"verifier is full ({self.max_sessions} sessions)")
        blocks = self.scheduler.blocks
        tokens = len(params.prompt) + params.max_new_tokens
        if window := self.scheduler.config.kv_window:  # blocks past it go back as it runs
            tokens = max(len(params.prompt), window + self.scheduler.config.max_spec_tokens + 1)
        need = -(-tokens // blocks.block_size) + (1 if window else 0)
        if need > blocks.num_blocks:  # would wait forever: refuse, another verifier may fit it
            raise ResourceExhausted(
                f"the session needs {need} KV blocks, this verifier's cache has "
                f"{blocks.num_blocks} (of {blocks.block_size} tokens)")
        seq = Sequence(params, **records)
        self.scheduler.add(seq)  # raises InvalidArgument if it cannot fit the context
        self.sessions[seq.session_id] = seq
        self.queues[seq.session_id] = queue = asyncio.Queue()
        return seq, queue

    def keep_carried(self, seq: Sequence, row: torch.Tensor | None) -> None:
        """A carried session (seq.sched.carried) keeps its round's unsampled bonus row for the
        next round; any other session drops what it kept."""
        if seq.sched.carried:
            self.carried[seq.session_id] = row
        else:
            self.carried.pop(seq.session_id, None)

    def record(self, seq: Sequence, new: list[int], drafted: int, accepted: int,
               wait_ms: float, timings: StepTimings, *, bonus: bool,
               logprobs: tuple[TokenLogprob, ...]) -> None:
        """Count a round (`new` committed tokens, `accepted` of `drafted` drafts) in the
        session's stats and the metrics, and stream it to the client."""
        st = seq.stats
        # Stats count the accepted drafts the session kept: a stop token or the length limit
        # may cut the round after some of them (the acceptance estimates still see them all).
        kept = min(accepted, len(new))
        st.rounds, st.drafted, st.accepted = (st.rounds + 1, st.drafted + drafted,
                                              st.accepted + kept)
        st.lossy |= bool(drafted) and seq.params.typical is not None \
            and not seq.params.sampling.is_greedy
        if drafted and seq.local.source is PREDICTION:  # (rejected: verified, not kept)
            st.prediction_accepted += kept
            st.prediction_rejected += drafted - kept
        if self.metrics is not None:
            self.metrics.observe_round(drafted, kept, wait_ms,
                                       timings.forward_ms, timings.rejection_ms)
        self.queues[seq.session_id].put_nowait(round_output(
            seq, new, drafted, kept, wait_ms, timings, bonus=bonus, logprobs=logprobs))

    def release(self, seq: Sequence) -> None:
        """Forget a finished or aborted session; an aborted (or failed) one's client gets a
        last, empty output that says so."""
        self.sessions.pop(seq.session_id, None)
        self.carried.pop(seq.session_id, None)
        queue = self.queues.pop(seq.session_id, None)
        if queue is not None and seq.finish_reason in ("abort", "error", "fault"):
            queue.put_nowait(round_output(seq, [], 0, 0, 0.0, StepTimings(0.0, 0.0)))


def round_output(seq: Sequence, new: list[int], drafted: int, accepted: int, wait_ms: float,
                 timings: StepTimings, bonus: bool = False,
                 logprobs: tuple[TokenLogprob, ...] = ()) -> RoundOutput:
    """A round's RoundOutput, with the session's running totals."""
    st = seq.stats
    return RoundOutput(
        token_ids=new, num_committed=len(seq.output), drafted=drafted, accepted=accepted,
        bonus=bonus, draft_wait_ms=wait_ms, verify_ms=timings.forward_ms,
        rejection_ms=timings.rejection_ms, rounds=st.rounds, drafted_total=st.drafted,
        accepted_total=st.accepted, finish_reason=seq.finish_reason, error=seq.error,
        lossy=st.lossy, prediction_accepted=st.prediction_accepted,
        prediction_rejected=st.prediction_rejected, logprobs=logprobs)
