"""One simulated request as the client sees it: when its tokens reach it, and its rounds."""
from __future__ import annotations

from dataclasses import dataclass, field

import simpy

from tools.plan.config import Request


@dataclass
class SimSession:
    """sid: the verifier's session id; prompt: token ids (shared prefix first); times in ms
    on the virtual clock; lane: its draft stream (None: no draft worker)."""

    sid: str
    request: Request
    prompt: tuple[int, ...]
    arrival_ms: float
    gateway_ms: float = 0.0  # the gateway's share of TTFT (added to every token's time)
    hold_ms: float = 0.0  # its first bytes' extra delay (a just-used kept-alive connection)
    seq: object = None  # verify_service.session.sequence.Sequence once submitted
    lane: object = None  # tools.plan.drafts.DraftLane
    first_ms: float | None = None
    last_ms: float = 0.0
    tokens: int = 0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    ks: dict[int, int] = field(default_factory=dict)  # drafts verified per round -> rounds
    finished: simpy.Event | None = None

    def emit(self, n: int, at_ms: float, k: int, accepted: int) -> None:
        """A round committed n tokens, which reach the client at at_ms."""
        self.rounds += 1
        self.drafted += k
        self.accepted += accepted
        self.ks[k] = self.ks.get(k, 0) + 1
        if n:
            at = at_ms + self.gateway_ms
            if self.first_ms is None:
                at += self.hold_ms
                self.first_ms = at
            at = max(at, self.first_ms)  # tokens made during the hold arrive with the first
            self.last_ms = at
            self.tokens += n

    def done(self, env: simpy.Environment) -> None:
        if self.finished is not None and not self.finished.triggered:
            self.finished.succeed()

    @property
    def ttft_ms(self) -> float:
        return (self.first_ms or self.last_ms) - self.arrival_ms

    @property
    def tpot_ms(self) -> float | None:
        """Time per output token after the first (None: a one-token answer)."""
        if self.tokens < 2 or self.first_ms is None:
            return None
        return (self.last_ms - self.first_ms) / (self.tokens - 1)
