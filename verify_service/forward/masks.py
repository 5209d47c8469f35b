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


@dataclass(frozen=True)
class MaskJob:
    grammar: GrammarState  # the session's matcher at its committed text (rolled back after)
    drafts: list[int]  # the round's draft tokens, a chain or a tree's nodes
    parents: tuple[int, ...] | None  # a tree's parent per node (-1 = root); None = a chain


class MaskPool:
    def __init__(self, workers: int | None = None):
        n = workers or max(1, min(4, os.cpu_count() or 1))
        self._pool = ThreadPoolExecutor(n, thread_name_prefix="verify-masks")

    async def compute(self, jobs: list[MaskJob | None]
                      ) -> list[torch.Tensor | BaseException | None]:
        """Per job: its [len(drafts) + 1, words] masks, the error it raised, or None for
        no job. Each session's matcher is used by one thread at a time: one job each."""
        loop = asyncio.get_running_loop()
        futures = [None if j is None else loop.run_in_executor(self._pool, _masks, j)
                   for j in jobs]
        out: list[torch.Tensor | BaseException | None] = []
        for fut in futures:
            if fut is None:
                out.append(None)
                continue
            try:
                out.append(await fut)
            except BaseException as exc:  # a pyo3 panic is a BaseException, not an Exception
                if not recoverable(exc):
                    raise
                out.append(exc)
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _masks(job: MaskJob) -> torch.Tensor:
    return job.grammar.masks(job.drafts, job.parents)
