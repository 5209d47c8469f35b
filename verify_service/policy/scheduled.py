"""What the scheduler (policy/scheduler.py) hands the engine for one step: each session's
part of the flattened forward, and who was preempted to make room. Pure Python."""
from __future__ import annotations

from dataclasses import dataclass

from verify_service.session.sequence import Sequence


@dataclass(frozen=True)
class ScheduledSeq:
    seq: Sequence
    token_ids: list[int]  # new tokens whose KV is computed now
    start_pos: int  # absolute position of token_ids[0]
    num_drafts: int  # draft tokens verified (0: prefill or plain decode)
    is_prefill: bool
    wanted: int = 0  # the k the session wanted; more than num_drafts when drafts were late
    parents: tuple[int, ...] | None = None  # the drafts' tree (None = a chain)
    partial: bool = False  # a prefill chunk before the last: KV only, nothing sampled


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq]
    preempted: list[Sequence]

    @property
    def empty(self) -> bool:
        return not self.scheduled
