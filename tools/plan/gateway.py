"""The gateway's admission work on its one event loop: every request's share before the
verifier (tokenize, route, the session record, the gRPC call) interleaves with the others' at
each await, so concurrent admissions share the loop (processor sharing): 16 requests arriving
together each take 16 times as long and reach the verifier together, as the 2026-11-28b
validation's c=16 bursts did (15 of 16 sessions in the verifier's second step, ~90-120 ms
after the burst, at ~6 ms of admission each).

Left out: the loop's other work (relaying the streams' tokens, finishing sessions), which a
busy gateway also interleaves with admissions.
"""
from __future__ import annotations

import simpy


class SharedLoop:
    """A processor-sharing server: `admit(work_ms)` is an event that fires once the request
    has had work_ms of the loop, shared equally with every other request in it meanwhile."""

    def __init__(self, env: simpy.Environment):
        self.env = env
        self.jobs: list[list] = []  # [remaining ms, event]
        self._changed = env.event()
        self._since = env.now
        env.process(self._run())

    def admit(self, work_ms: float) -> simpy.Event:
        done = self.env.event()
        if work_ms <= 0:
            done.succeed()
            return done
        self._advance()
        self.jobs.append([work_ms, done])
        if not self._changed.triggered:
            self._changed.succeed()
        return done

    def _advance(self) -> None:
        """Charge the time since the last change to the jobs in the loop, equally."""
        if self.jobs:
            share = (self.env.now - self._since) / len(self.jobs)
            for job in self.jobs:
                job[0] -= share
        self._since = self.env.now

    def _run(self):
        while True:
            if not self.jobs:
                self._changed = self.env.event()
                yield self._changed
                continue
            self._changed = self.env.event()
            until = min(j[0] for j in self.jobs) * len(self.jobs)
            yield self.env.timeout(max(0.0, until)) | self._changed
            self._advance()
            for job in [j for j in self.jobs if j[0] <= 1e-9]:
                self.jobs.remove(job)
                job[1].succeed()
