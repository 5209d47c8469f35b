"""The draft side of a round: sessions, run-ahead, commit / rollback by epoch, drafting loop.

Per round, the verifier verifies the drafts this worker streamed for a session and answers with
a Commit (accepted + recovered/bonus tokens, and a new epoch if the sequence diverged); the
worker drops what the commit settled or voided and keeps drafting ahead, up to the session's
max_run_ahead, while the next verification is in flight.

Transport-agnostic: the gRPC servicer turns DraftControl messages into tandem.spec's Open /
Commit / Close / Invalid and sends back whatever a Stream yields (Proposal or SessionError).
Each step batches ALL sessions that want drafting into one proposer call per method, on one
executor thread: the loop stays free for streams and health checks, and only that thread
touches the proposers (and their KV caches) and computes the grammar masks (from copies of
the matchers: the loop commits to them). Open / Commit: control.py; Proposals: proposals.py.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

from draft_service.control import apply_commit, open_session
from draft_service.limits import Limits, WorkerStats
from draft_service.proposals import send_chain, send_tree
from draft_service.session import Session, SessionFailure, Stream
from draft_service.step import Jobs, fault, run_step
from tandem.errors import NotFound
from tandem.grammar.compiler import LazyCompiler
from tandem.grpc_limits import MAX_SESSION_ID_CHARS
from tandem.spec import (
    Close,
    Commit,
    Control,
    DraftRequest,
    DraftResult,
    ErrorCode,
    Invalid,
    Learner,
    Method,
    Open,
    Proposer,
    SessionError,
)
from tandem.spec.proposer import session_fault

log = logging.getLogger(__name__)
# Proposers that draft under a session's grammar (DraftRequest.mask: the draft model and
# layer skip share its proposer, MTP eagle's chains; not eagle's trees); the others' drafts
# are masked by the verifier only.
GRAMMAR_METHODS = frozenset({Method.DRAFT_MODEL, Method.EAGLE, Method.MTP, Method.LAYER_SKIP})


class DraftWorker:
    def __init__(self, proposers: Mapping[Method, Proposer], limits: Limits,
                 default_method: Method | None = None, grammars: LazyCompiler | None = None):
        if not proposers:
            raise ValueError("a draft worker needs at least one proposer")
        self.proposers = dict(proposers)
        self.limits = limits
        self.default_method = default_method or next(iter(self.proposers))
        self._sessions: dict[int, Session] = {}
        self._session_keys = itertools.count()
        self._streams: set[Stream] = set()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="tandem-draft")
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._closed = False
        self._tokens_drafted = 0
        self._steps = 0
        self.grammars = grammars  # structured output; None: sessions draft free text

    # --- streams and control messages (event loop) ------------------------------------------

    def open_stream(self) -> Stream:
        self._start_loop()
        stream = Stream(on_room=self._wake.set)
        self._streams.add(stream)
        return stream

    def close_stream(self, stream: Stream) -> None:
        """The verifier is gone: free every session it opened."""
        for session in list(stream.sessions.values()):
            self._drop(session)
        self._streams.discard(stream)

    def end_streams(self) -> None:
        """Draining: tell every stream to end (the transport ends it with UNAVAILABLE)."""
        for stream in list(self._streams):
            stream.put(None)

    def handle(self, stream: Stream, cmd: Control) -> None:
        """Apply one control message; problems are reported in-band, never raised."""
        session_id = getattr(cmd, "session_id", "")
        epoch = getattr(cmd, "epoch", 0)  # errors carry the epoch they answer
        if len(session_id) > MAX_SESSION_ID_CHARS:  # never a verifier's: answer without echoing it
            cmd = Invalid("", f"session_id has {len(session_id)} characters, more than "
                              f"{MAX_SESSION_ID_CHARS}")
            session_id = ""
        try:
            if isinstance(cmd, Invalid):
                raise SessionFailure(ErrorCode.INVALID_ARGUMENT, cmd.message)
            if not session_id:
                raise SessionFailure(ErrorCode.INVALID_ARGUMENT, "empty session_id")
            if isinstance(cmd, Open):
                self._open(stream, cmd)
            elif isinstance(cmd, Commit):
                self._commit(stream, cmd)
            elif isinstance(cmd, Close):
                if session_id in stream.sessions:
                    self._drop(stream.sessions[session_id])
            else:
                raise SessionFailure(ErrorCode.INVALID_ARGUMENT, f"unknown control {cmd!r}")
        except SessionFailure as exc:
            self._fail(stream, session_id, exc.code, str(exc), epoch)
        except NotFound as exc:  # NOT_FOUND, in-band: the stream carries on (draft.proto)
            self._fail(stream, session_id, ErrorCode.UNKNOWN_SESSION, str(exc), epoch)
        except BaseException as exc:  # a bug (or a panic) must cost one session, never the stream
            if not session_fault(exc):
                raise
            log.exception("control message for session %r failed", session_id)
            self._fail(stream, session_id, ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}",
                       epoch)

    def _open(self, stream: Stream, cmd: Open) -> None:
        if cmd.session_id in stream.sessions:  # reopening replaces the session completely
            self._drop(stream.sessions[cmd.session_id])
        session = open_session(stream, cmd, self.limits, self.proposers, self.default_method,
                               open_sessions=len(self._sessions), session_keys=self._session_keys)
        stream.sessions[cmd.session_id] = session
        self._sessions[session.session_key] = session
        if cmd.grammar is not None and self.grammars is not None and (
                session.method in GRAMMAR_METHODS):
            session.grammar_pending = True  # compiled off the loop, then it drafts
            asyncio.get_running_loop().create_task(self._attach_grammar(session, cmd))
        self._wake.set()

    async def _attach_grammar(self, session: Session, cmd: Open) -> None:
        """The session's grammar at its generated tokens; if it cannot be had (the verifier
        compiled it, so this is unexpected), the session drafts free text, still exact."""
        try:
            # (commits that came meanwhile are in `committed`, which only grows)
            state = await self.grammars.state(cmd.grammar, ())
            if state.commit(session.committed[cmd.grammar_start:]):
                session.grammar = state
        except BaseException as exc:  # a panic too: the session must not wait for good
            if not session_fault(exc):
                raise
            log.warning("session %r drafts without its grammar: %s", session.session_id, exc)
        session.grammar_pending = False
        self._wake.set()

    @staticmethod
    def session(stream: Stream, session_id: str) -> Session:
        """The session open on `stream` under this id; NotFound if there is none (never
        opened, closed, or dropped after an error)."""
        session = stream.sessions.get(session_id)
        if session is None:
            raise NotFound(f"session {session_id!r} is not open on this stream")
        return session

    def _commit(self, stream: Stream, cmd: Commit) -> None:
        session = self.session(stream, cmd.session_id)
        before = len(session.committed)
        apply_commit(session, cmd, self.limits)
        if session.grammar is not None and not session.grammar.commit(
                session.committed[before:]):
            session.grammar = None  # the matcher is lost: draft free text from here
        self._wake.set()

    def _fail(self, stream: Stream, session_id: str, code: ErrorCode, message: str,
              epoch: int) -> None:
        if session_id in stream.sessions:
            self._drop(stream.sessions[session_id])
        stream.put(SessionError(session_id, code, message, epoch))

    def _drop(self, session: Session) -> None:
        if session.stream.sessions.get(session.session_id) is session:
            del session.stream.sessions[session.session_id]
        if self._sessions.pop(session.session_key, None) is None:
            return
        proposer = self.proposers[session.method]
        # On the forward thread, after any step in flight that still uses the state; a
        # RuntimeError means the executor is shut down because the worker is closing.
        with contextlib.suppress(RuntimeError):
            if isinstance(proposer, Learner):  # the final text: commits since the last step too
                self._executor.submit(proposer.learn, session.tenant, list(session.committed))
            self._executor.submit(proposer.release, session.session_key)

    # --- drafting loop ------------------------------------------------------------------------

    def _wants_draft(self, s: Session) -> bool:
        return (not s.stalled and not s.grammar_pending and len(s.drafts) < s.max_run_ahead
                and s.length < self.limits.max_context_length and not s.stream.backed_up)

    def _start_loop(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._loop())
            self._task.add_done_callback(self._loop_ended)

    def _loop_ended(self, task: asyncio.Task) -> None:
        """A loop that ended while the worker serves (a bug no session's handling caught) is
        restarted: a dead one would leave every stream open and health SERVING with nothing
        drafted again, while the proposers are intact. Its sessions fail first (their
        verifiers re-attach them) so a bug their state triggers cannot make it spin."""
        if self._closed or task.cancelled():
            return
        log.critical("the drafting loop ended unexpectedly; failing its %d sessions and "
                     "restarting it", len(self._sessions), exc_info=task.exception())
        for session in list(self._sessions.values()):
            self._fail(session.stream, session.session_id, ErrorCode.INTERNAL,
                       "the draft worker's drafting loop failed", session.epoch)
        self._start_loop()

    async def _loop(self) -> None:
        """One step per pass: snapshot every ready session's request, run each method's
        proposer once over its batch on the forward thread, then hand the drafts out (a
        session that moved on meanwhile drops its own, see _apply). Sleeps while none is ready.
        """
        loop = asyncio.get_running_loop()
        while True:
            ready = [s for s in self._sessions.values() if self._wants_draft(s)]
            if not ready:
                self._wake.clear()
                await self._wake.wait()
                continue
            jobs = self._jobs(ready)
            if not jobs:
                continue  # every one failed (and was dropped)
            try:
                results = await loop.run_in_executor(self._executor, self._run_step, jobs)
            except RuntimeError:
                if self._closed:  # executor shut down under us: the worker is closing
                    return
                raise
            self._steps += 1
            for method, batch in jobs.items():
                for (s, generation, req, _), res in zip(batch, results[method]):
                    try:
                        self._apply(s, generation, req, res)
                    except Exception as exc:  # a bug costs this session, not the loop
                        log.exception("applying drafts for session %r failed", s.session_id)
                        self._fail(s.stream, s.session_id, ErrorCode.INTERNAL, repr(exc),
                                   s.epoch)

    def _jobs(self, ready: list[Session]) -> Jobs:
        """Event loop: each ready session's request and grammar snapshot (cheap); one that
        cannot be had fails that session alone."""
        jobs: Jobs = {}
        for s in ready:
            try:
                job = (s, s.generation, s.request(), s.grammar_view())
            except BaseException as exc:
                if not session_fault(exc):
                    raise
                log.exception("preparing a draft for session %r failed", s.session_id)
                self._fail(s.stream, s.session_id, ErrorCode.INTERNAL, fault(exc), s.epoch)
                continue
            jobs.setdefault(s.method, []).append(job)
        return jobs

    def _run_step(self, jobs: Jobs) -> dict[Method, list[DraftResult]]:
        """Forward thread: masks, then proposals (draft_service/step.py)."""
        return run_step(self.proposers, jobs)

    def _apply(self, s: Session, generation: int, req: DraftRequest, res: DraftResult) -> None:
        if s.session_key not in self._sessions:
            return  # closed while the step ran
        if res.error is not None:
            self._fail(s.stream, s.session_id, res.error, res.message, s.epoch)
            return
        if s.generation != generation or s.length != len(req.token_ids):
            return  # rolled back while the step ran: these drafts continue a stale sequence
        send = send_tree if s.tree else send_chain
        self._tokens_drafted += send(s, res, self.limits.max_context_length)

    # --- introspection and shutdown -----------------------------------------------------------

    def stats(self) -> WorkerStats:
        return WorkerStats(
            sessions_open=len(self._sessions),
            queue_depth=sum(1 for s in self._sessions.values() if self._wants_draft(s)),
            tokens_drafted=self._tokens_drafted, steps=self._steps)

    def load(self) -> int:
        """Open sessions, for the registry heartbeat."""
        return len(self._sessions)

    async def aclose(self) -> None:
        self._closed = True
        for stream in list(self._streams):
            self.close_stream(stream)
            stream.put(None)
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._executor.shutdown(wait=False, cancel_futures=True)
