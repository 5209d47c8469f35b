"""A step's grammar masks, off the event loop and in parallel.

A mask walks llguidance's matcher through the round's drafts: milliseconds per position
for a hard grammar, times (k + 1) positions. On the event loop that would stall every
session's stream and the draft link; here each session's masks run on a small pool
(llguidance computes masks without the GIL), and a failure, even a native panic, is that
session's outcome alone (the caller ends it), never the step's.
"""
from __future__ import annotations

import asyncio
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tandem.errors import recoverable

if TYPE_CHECKING:
    import torch

    from tandem.grammar.state import GrammarState


# How long a step waits for a session's masks before it goes on without that session: a
# benign grammar's masks take well under a millisecond a position; a hostile one's first
# mask alone can take 0.3 s (1,500 optional properties), and every session in the batch
# would wait for it. The late session sits the step out; its masks go on being made.
MASK_WAIT_S = 0.025


@dataclass(frozen=True)
class MaskJob:
    grammar: GrammarState  # the session's matcher at its committed text (rolled back after)
    drafts: list[int]  # the round's draft tokens, a chain or a tree's nodes
    parents: tuple[int, ...] | None  # a tree's parent per node (-1 = root); None = a chain
    session_id: str = ""  # set: the job may outlive the step that asked (PENDING)
    deferrable: bool = False  # a decode round, which can sit a step out (not a prefill's)


class Pending:
    """A session's masks are still being made: it sits this step out."""


PENDING = Pending()


class MaskPool:
    def __init__(self, workers: int | None = None):
        n = workers or max(1, min(4, os.cpu_count() or 1))
        self._pool = ThreadPoolExecutor(n, thread_name_prefix="verify-masks")
        self._late: dict[str, tuple[MaskJob, asyncio.Future]] = {}  # session -> its late job

    def busy(self, session_id: str) -> bool:
        """A job of the session's is still walking its matcher (nothing else may touch it)."""
        late = self._late.get(session_id)
        return late is not None and not late[1].done()

    def forget(self, session_id: str) -> None:
        late = self._late.pop(session_id, None)
        if late is not None and late[1].done() and not late[1].cancelled():
            late[1].exception()  # retrieved: a late job's error is no one's now

    async def compute(self, jobs: list[MaskJob | None], wait_s: float | None = None
                      ) -> list[torch.Tensor | BaseException | Pending | None]:
        """Per job: its [len(drafts) + 1, words] masks, the error it raised, None for no job,
        or PENDING for a deferrable job not done within `wait_s` (None: wait for all). Each
        session's matcher is used by one thread at a time: one job each, a late one kept
        for the session's next step (whose drafts it covers, or which waits for it)."""
        loop = asyncio.get_running_loop()
        futures = [None if j is None else self._submit(loop, j) for j in jobs]
        must = [f for j, f in zip(jobs, futures) if f is not None and f is not PENDING
                and not (j.deferrable and wait_s is not None)]
        may = [f for f in futures if f is not None and f is not PENDING and f not in must]
        if may:
            await asyncio.wait(may, timeout=wait_s)
        out: list[torch.Tensor | BaseException | Pending | None] = []
        for job, fut in zip(jobs, futures):
            if fut is None or fut is PENDING or not (fut in must or fut.done()):
                out.append(None if fut is None else PENDING)
                continue
            self._late.pop(job.session_id, None)
            try:
                out.append((await fut)[:len(job.drafts) + 1])
            except BaseException as exc:  # a pyo3 panic is a BaseException, not an Exception
                if not recoverable(exc):
                    raise
                out.append(exc)
        return out

    def _submit(self, loop, job: MaskJob) -> asyncio.Future | Pending:
        late = self._late.get(job.session_id) if job.session_id else None
        if late is not None:
            if _covers(late[0], job):
                return late[1]
            if not late[1].done():
                return PENDING  # its matcher is in use: next step
            self.forget(job.session_id)
        fut = loop.run_in_executor(self._pool, _masks, job)
        if job.session_id:
            self._late[job.session_id] = (job, fut)
        return fut

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _covers(made: MaskJob, job: MaskJob) -> bool:
    """Masks made for `made` hold `job`'s: the same matcher, `job`'s drafts a prefix (the
    rows of a position depend only on the drafts up to it)."""
    n = len(job.drafts)
    return (made.grammar is job.grammar and made.drafts[:n] == job.drafts
            and (made.parents is None) == (job.parents is None)
            and (job.parents is None or made.parents[:n] == job.parents))


def _masks(job: MaskJob) -> torch.Tensor:
    return job.grammar.masks(job.drafts, job.parents)
