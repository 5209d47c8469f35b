"""A draft worker's per-connection and per-session state (the worker's loop is in worker.py).

Session state: `committed` (prompt + committed tokens) and `drafts` (tokens proposed and sent
under the current epoch, not yet committed). The next draft's position is
len(committed) + len(drafts).
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from kernels.sampling import keyed_seed, make_generator
from tandem.sampling_params import SamplingParams
from tandem.spec import DraftRequest, ErrorCode, Features, Method, Proposal, SessionError


class SessionFailure(Exception):
    """Raised inside the worker to report a per-session error and drop the session."""

    def __init__(self, code: ErrorCode, message: str):
        super().__init__(message)
        self.code = code


# Messages a stream's outbox holds at most. Drafting pauses at half of it (a verifier that
# reads slowly gets fewer drafts, not a longer queue); past it the peer has stopped reading
# while still sending (its control messages keep producing errors): the stream is ended.
MAX_PENDING = 4096


class Stream:
    """One verifier connection: its sessions and its outbox of proposals and errors."""

    def __init__(self, max_pending: int = MAX_PENDING, on_room=None) -> None:
        self.sessions: dict[str, Session] = {}
        self.max_pending = max_pending
        self._on_room = on_room  # called when a backed-up outbox has room again
        self.overflowed = False
        self._outbox: asyncio.Queue[Proposal | SessionError | None] = asyncio.Queue()

    def put(self, item: Proposal | SessionError | None) -> None:
        if item is not None and self._outbox.qsize() >= self.max_pending:
            if not self.overflowed:  # end it after what is queued; drop everything else
                self.overflowed = True
                self._outbox.put_nowait(None)
            return
        self._outbox.put_nowait(item)

    @property
    def pending(self) -> int:
        """Messages produced but not yet taken by the transport."""
        return self._outbox.qsize()

    @property
    def backed_up(self) -> bool:
        """Whether drafting for this stream's sessions should wait for the transport."""
        return self.pending >= self.max_pending // 2

    async def get(self) -> Proposal | SessionError | None:
        """The next message; None means the worker ended the stream (draining)."""
        item = await self._outbox.get()
        if self._on_room is not None and self.pending == self.max_pending // 2 - 1:
            self._on_room()  # just dropped below backed_up: drafting may go on
        return item


class FeatureStore:
    """The target's features of a session's positions [0, rows) (EAGLE sessions only).

    Grows by reallocation, never in place, so a step running on the forward thread keeps a
    consistent view while the event loop stores the next commit's rows.
    """

    def __init__(self, hidden_size: int, max_rows: int | None = None):
        self.hidden_size = hidden_size
        self.max_rows = max_rows  # the context length: what a peer can make us hold
        self._buf = torch.empty(0, hidden_size)
        self.rows = 0

    def put(self, f: Features) -> None:
        problem = f.problem()
        if problem is None and f.hidden_size != self.hidden_size:
            problem = (f"features.hidden_size is {f.hidden_size}, this worker's head reads "
                       f"{self.hidden_size} (an EAGLE-3 head reads three target layers: the "
                       "verifier's --eagle-feature-layers must be eagle3 or the head's layer "
                       "ids for it, final for other heads)")
        if problem is not None:
            raise SessionFailure(ErrorCode.INVALID_ARGUMENT, problem)
        if f.start_position > self.rows:
            raise SessionFailure(ErrorCode.OUT_OF_SYNC, f"features start at position "
                                 f"{f.start_position}, beyond the {self.rows} held")
        new = torch.from_numpy(np.frombuffer(f.data, dtype="<f2").astype(np.float32))
        new = new.view(-1, self.hidden_size)  # [n, hidden]
        if not torch.isfinite(new).all():
            raise SessionFailure(ErrorCode.INVALID_ARGUMENT, "features are not all finite")
        end = f.start_position + len(new)
        if self.max_rows is not None and end > self.max_rows:
            raise SessionFailure(ErrorCode.RESOURCE_EXHAUSTED, f"features reach position {end}, "
                                 f"beyond the context length {self.max_rows}")
        if end > len(self._buf):
            grown = torch.empty(max(end, 2 * len(self._buf), 64), self.hidden_size)
            grown[:self.rows] = self._buf[:self.rows]
            self._buf = grown
        self._buf[f.start_position:end] = new
        self.rows = max(self.rows, end)

    def view(self) -> torch.Tensor:  # [rows, hidden] float32
        return self._buf[:self.rows]


@dataclass(eq=False)
class Session:
    session_key: int
    session_id: str
    stream: Stream
    method: Method
    committed: list[int]
    epoch: int
    sampling: SamplingParams
    max_run_ahead: int
    top_n: int
    max_ngram_size: int
    seed: int | None  # the request's seed (the verifier's own); None = unseeded
    drafts: list[int] = field(default_factory=list)
    generation: int = 0  # bumped whenever outstanding drafts are discarded
    stalled: bool = False  # the proposer had nothing for this exact sequence
    features: FeatureStore | None = None  # EAGLE sessions: the target's features so far
    tenant: str = ""
    tree: bool = False  # one token tree per epoch instead of a chain
    # Structured output (draft_model): a tandem.grammar.state.GrammarState at the committed
    # tokens, and whether it is still being compiled (no drafts until it is).
    grammar: Any = None
    grammar_pending: bool = False
    prompt_len: int = 0  # committed[:prompt_len] is the prompt (the controls' output after it)

    @property
    def length(self) -> int:
        return len(self.committed) + len(self.drafts)

    def request(self) -> DraftRequest:
        """The drafting work for this session's next step, without its grammar mask (see
        grammar_view: the mask is computed on the forward thread)."""
        # The verifier's noise for the drafted position (keyed by seed and position): a
        # seeded session's token there is the target's sample under that noise, so a draft
        # drawn with the same noise matches it whenever q ranks tokens like p does.
        generator = None if self.seed is None else make_generator(
            keyed_seed(self.seed, self.length))
        return DraftRequest(
            session_key=self.session_key, token_ids=self.committed + self.drafts,
            num_committed=len(self.committed), max_tokens=self.max_run_ahead - len(self.drafts),
            sampling=self.sampling, top_n=self.top_n, max_ngram_size=self.max_ngram_size,
            generator=generator,
            features=None if self.features is None else self.features.view(),
            tenant=self.tenant, tree=self.tree, prompt_len=self.prompt_len)

    def grammar_view(self) -> GrammarView | None:
        """The session's grammar as this step needs it (None: free text). Taken on the event
        loop, whose commits advance the session's own matcher: a copy of it is cheap, and the
        forward thread walks the copy alone."""
        if self.grammar is None:
            return None
        return GrammarView(self.grammar.copy_after([]), tuple(self.drafts), self.tree)


@dataclass(frozen=True)
class GrammarView:
    """A copy of a session's matcher at its committed text, and the drafts beyond it."""

    state: Any  # tandem.grammar.state.GrammarState, this view's own
    drafts: tuple[int, ...]
    tree: bool

    def apply(self, req: DraftRequest) -> DraftRequest:
        """Forward thread: `req` with the mask of its next draft and, for a tree, a grammar
        past the drafts whose mask_after(path) masks each node (the heavy part: mask
        computation walks the whole vocabulary)."""
        if not self.tree:
            return replace(req, mask=self.state.next_mask(list(self.drafts)))
        grammar = self.state.copy_after(list(self.drafts))
        return replace(req, mask=grammar.next_mask([]), grammar=grammar)
