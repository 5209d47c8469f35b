"""A draft worker's per-connection and per-session state (the worker's loop is in worker.py).

Session state: `committed` (prompt + committed tokens) and `drafts` (tokens proposed and sent
under the current epoch, not yet committed). The next draft's position is
len(committed) + len(drafts).
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from kernels.sampling import keyed_seed, make_generator
from tandem.sampling_params import SamplingParams
from tandem.spec import DraftRequest, ErrorCode, Method, Proposal, SessionError


class SessionFailure(Exception):
    """Raised inside the worker to report a per-session error and drop the session."""

    def __init__(self, code: ErrorCode, message: str):
        super().__init__(message)
        self.code = code


class Stream:
    """One verifier connection: its sessions and its outbox of proposals and errors."""

    def __init__(self) -> None:
        self.sessions: dict[str, Session] = {}
        self._outbox: asyncio.Queue[Proposal | SessionError | None] = asyncio.Queue()

    def put(self, item: Proposal | SessionError | None) -> None:
        self._outbox.put_nowait(item)

    @property
    def pending(self) -> int:
        """Messages produced but not yet taken by the transport."""
        return self._outbox.qsize()

    async def get(self) -> Proposal | SessionError | None:
        """The next message; None means the worker ended the stream (draining)."""
        return await self._outbox.get()


@dataclass(eq=False)
class Session:
    key: int
    session_id: str
    stream: Stream
    method: Method
    committed: list[int]
    epoch: int
    sampling: SamplingParams
    max_run_ahead: int
    top_n: int
    max_ngram_size: int
    seed: int | None  # the request seed, salted for the draft; None = unseeded
    drafts: list[int] = field(default_factory=list)
    generation: int = 0  # bumped whenever outstanding drafts are discarded
    stalled: bool = False  # the proposer had nothing for this exact sequence

    @property
    def length(self) -> int:
        return len(self.committed) + len(self.drafts)

    def request(self) -> DraftRequest:
        """The drafting work for this session's next step."""
        # Keyed by position, so a seeded request drafts the same tokens however its rounds,
        # commits and batches interleave in time (the verifier keys its randomness likewise).
        generator = None if self.seed is None else make_generator(
            keyed_seed(self.seed, self.length))
        return DraftRequest(
            key=self.key, token_ids=self.committed + self.drafts,
            num_committed=len(self.committed), max_tokens=self.max_run_ahead - len(self.drafts),
            sampling=self.sampling, top_n=self.top_n, max_ngram_size=self.max_ngram_size,
            generator=generator)
