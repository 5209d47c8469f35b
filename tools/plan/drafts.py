"""The draft pool, modelled (its proposers run models, which a simulation cannot): each draft
worker batches one token for every session that wants more run-ahead, at the profile's draft
step cost by batch size, and streams each token back over the network hop. A commit that
voids the drafts (new epoch) reaches the worker one hop later; drafting restarts then.

Left out: the draft's own KV cache and its capacity, top-N payload size (a few hundred bytes,
under the latency), EAGLE trees (chains only), stream reconnects and draft-worker failures.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import simpy

from tandem.spec import DraftToken
from tools.plan.profile import Profile


@dataclass
class DraftLane:
    """One session's stream to its draft worker. pending: (arrival ms, token) on the wire or
    arrived, in order; want: the run-ahead the verifier asked for (drafts at most);
    ready_ms: when the worker has heard of the session's latest epoch."""

    epoch: int = 0
    pending: list[tuple[float, DraftToken]] = field(default_factory=list)
    want: int = 1
    ready_ms: float = 0.0
    worker: DraftWorker | None = None


class DraftWorker:
    """One draft worker process of the pool: a SimPy process batching its sessions' steps."""

    def __init__(self, env: simpy.Environment, profile: Profile, ids):
        self.env, self.profile, self.ids = env, profile, ids
        self.lanes: dict[str, tuple[DraftLane, object]] = {}  # session id -> (lane, Sequence)
        self.busy_ms = 0.0  # drafting time so far (a colocated verifier pays it)
        self.steps = 0
        self.batch_sum = 0  # sessions per step, summed: the queue depth its HPA scales on
        self._wake = env.event()
        env.process(self._run())

    @property
    def load(self) -> int:
        return len(self.lanes)

    def attach(self, seq, lane: DraftLane) -> None:
        lane.worker = self
        self.lanes[seq.session_id] = (lane, seq)
        self.poke()

    def release(self, session_id: str) -> None:
        self.lanes.pop(session_id, None)

    def poke(self) -> None:
        if not self._wake.triggered:
            self._wake.succeed()

    def _needy(self) -> list[tuple[DraftLane, object]]:
        now = self.env.now
        return [(lane, seq) for lane, seq in self.lanes.values()
                if lane.ready_ms <= now and len(seq.drafts) + len(lane.pending) < lane.want]

    def _next_ready(self) -> float | None:
        later = [lane.ready_ms for lane, _ in self.lanes.values() if lane.ready_ms > self.env.now]
        return min(later) if later else None

    def _run(self):
        while True:
            batch = self._needy()
            if not batch:
                self._wake = self.env.event()
                nxt = self._next_ready()
                yield self._wake if nxt is None else (self._wake | self.env.timeout(
                    nxt - self.env.now))
                continue
            ms = self.profile.draft_step_ms(len(batch))  # one token for each session
            epochs = [lane.epoch for lane, _ in batch]
            yield self.env.timeout(ms)
            self.busy_ms += ms
            self.steps += 1
            self.batch_sum += len(batch)
            arrive = self.env.now + self.profile.hop_ms()
            for (lane, _), epoch in zip(batch, epochs):
                if lane.epoch == epoch:  # not voided while the step ran
                    lane.pending.append((arrive, DraftToken(next(self.ids))))


def collect(seq, lane: DraftLane, now: float) -> None:
    """Move the drafts that have arrived by `now` into the session's chain."""
    n = 0
    while n < len(lane.pending) and lane.pending[n][0] <= now:
        n += 1
    if n:
        seq.drafts.extend(tok for _, tok in lane.pending[:n])
        del lane.pending[:n]


def arrival_of(seq, lane: DraftLane, needed: int) -> float | None:
    """When the session will hold `needed` drafts (None: not drafted yet)."""
    missing = needed - len(seq.drafts)
    if missing <= 0:
        return 0.0
    if missing > len(lane.pending):
        return None
    return lane.pending[missing - 1][0]


def on_commit(seq, lane: DraftLane, now: float, want: int, payload_bytes: int,
              profile: Profile) -> None:
    """After the verifier's commit: a new epoch voids what was drafted; the worker hears of
    it (and of the new run-ahead) one hop later."""
    if seq.epoch != lane.epoch:
        lane.epoch = seq.epoch
        lane.pending.clear()
        lane.ready_ms = now + profile.hop_ms(payload_bytes)
    lane.want = want
    if lane.worker is not None:
        lane.worker.poke()
