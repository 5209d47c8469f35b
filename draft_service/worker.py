"""The draft side of a round: sessions, run-ahead, commit / rollback by epoch, drafting loop.

Per round, the verifier verifies the drafts this worker streamed for a session and answers with
a Commit (accepted + recovered/bonus tokens, and a new epoch if the sequence diverged); the
worker drops what the commit settled or voided and keeps drafting ahead, up to the session's
max_run_ahead, while the next verification is in flight.

Transport-agnostic: the gRPC servicer turns DraftControl messages into tandem.spec's Open /
Commit / Close / Invalid and sends back whatever a Stream yields (Proposal or SessionError).
One worker serves every stream of the process, so each step batches ALL sessions that want
drafting into one proposer call per method (one forward for the draft model). The step runs on
a single-thread executor: the event loop stays free for stream traffic and health checks, and
the proposers (with their KV caches) are only ever touched by that one thread.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

from draft_service.limits import Limits, WorkerStats
from draft_service.session import FeatureStore, Session, SessionFailure, Stream
from tandem.grpc_limits import MAX_SESSION_ID_CHARS
from tandem.sampling_params import SamplingParams
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
    Proposal,
    Proposer,
    SessionError,
    TreeNode,
    propose_isolated,
)

log = logging.getLogger(__name__)

# Longer suffixes almost never match again and each length tried costs a scan of the context.
_MAX_NGRAM_SIZE = 64
_MAX_TENANT_LEN = 128  # a tenant names a cache: bound what a peer can make us hold

# One step's work per method: (session, its generation when asked, the request).
_Jobs = dict[Method, list[tuple[Session, int, DraftRequest]]]


class DraftWorker:
    def __init__(self, proposers: Mapping[Method, Proposer], limits: Limits,
                 default_method: Method | None = None):
        if not proposers:
            raise ValueError("a draft worker needs at least one proposer")
        self.proposers = dict(proposers)
        self.limits = limits
        self.default_method = default_method or next(iter(self.proposers))
        self._sessions: dict[int, Session] = {}
        self._keys = itertools.count()
        self._streams: set[Stream] = set()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="tandem-draft")
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._tokens_drafted = 0
        self._steps = 0

    # --- streams and control messages (event loop) ------------------------------------------

    def open_stream(self) -> Stream:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._loop())
        stream = Stream()
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
        sid = getattr(cmd, "session_id", "")
        epoch = getattr(cmd, "epoch", 0)  # errors carry the epoch they answer
        if len(sid) > MAX_SESSION_ID_CHARS:  # never a verifier's: answer without echoing it
            cmd = Invalid("", f"session_id has {len(sid)} characters, more than "
                              f"{MAX_SESSION_ID_CHARS}")
            sid = ""
        try:
            if isinstance(cmd, Invalid):
                raise SessionFailure(ErrorCode.INVALID_ARGUMENT, cmd.message)
            if not sid:
                raise SessionFailure(ErrorCode.INVALID_ARGUMENT, "empty session_id")
            if isinstance(cmd, Open):
                self._open(stream, cmd)
            elif isinstance(cmd, Commit):
                self._commit(stream, cmd)
            elif isinstance(cmd, Close):
                if sid in stream.sessions:
                    self._drop(stream.sessions[sid])
            else:
                raise SessionFailure(ErrorCode.INVALID_ARGUMENT, f"unknown control {cmd!r}")
        except SessionFailure as exc:
            self._fail(stream, sid, exc.code, str(exc), epoch)
        except Exception as exc:  # a bug must cost one session, never the stream
            log.exception("control message for session %r failed", sid)
            self._fail(stream, sid, ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}", epoch)

    def _open(self, stream: Stream, cmd: Open) -> None:
        if cmd.session_id in stream.sessions:  # reopening replaces the session completely
            self._drop(stream.sessions[cmd.session_id])
        lim = self.limits
        if len(cmd.token_ids) > lim.max_context_length:  # before scanning them
            raise SessionFailure(ErrorCode.RESOURCE_EXHAUSTED, f"sequence of "
                                 f"{len(cmd.token_ids)} tokens exceeds the context length "
                                 f"{lim.max_context_length}")
        tokens = self._check_tokens(cmd.token_ids, allow_empty=False)
        try:
            sampling = SamplingParams(cmd.temperature, cmd.top_k, cmd.top_p, cmd.seed)
        except ValueError as exc:
            raise SessionFailure(ErrorCode.INVALID_ARGUMENT, str(exc)) from None
        try:
            method = Method(cmd.method) or self.default_method  # UNSPECIFIED (0) is falsy
        except ValueError:  # a method newer than this worker
            method = None
        if method not in self.proposers:  # includes values newer than this enum
            raise SessionFailure(ErrorCode.UNSUPPORTED_METHOD, f"method {cmd.method} is not "
                                 f"served here (have {[m.name for m in self.proposers]})")
        if cmd.tree and not method.can_tree:
            raise SessionFailure(ErrorCode.INVALID_ARGUMENT,
                                 f"method {method.api_name} drafts chains, not trees")
        if len(self._sessions) >= lim.max_sessions:
            raise SessionFailure(ErrorCode.RESOURCE_EXHAUSTED,
                                 f"worker is full ({lim.max_sessions} sessions)")
        session = Session(
            key=next(self._keys), session_id=cmd.session_id, stream=stream, method=method,
            committed=tokens, epoch=cmd.epoch, sampling=sampling,
            max_run_ahead=min(cmd.max_run_ahead or lim.max_run_ahead, lim.max_run_ahead_cap),
            top_n=min(cmd.top_n or lim.top_n, lim.max_top_n),
            max_ngram_size=min(cmd.max_ngram_size or lim.max_ngram_size, _MAX_NGRAM_SIZE),
            seed=cmd.seed, tenant=cmd.tenant[:_MAX_TENANT_LEN], tree=cmd.tree)
        if method.needs_features:
            session.features = FeatureStore(self.proposers[method].feature_size,
                                            lim.max_context_length)
            if cmd.features is not None:
                session.features.put(cmd.features)
        stream.sessions[cmd.session_id] = session
        self._sessions[session.key] = session
        self._wake.set()

    def _commit(self, stream: Stream, cmd: Commit) -> None:
        session = stream.sessions.get(cmd.session_id)
        if session is None:
            raise SessionFailure(ErrorCode.UNKNOWN_SESSION,
                                 f"session {cmd.session_id!r} is not open on this stream")
        if cmd.start_position + len(cmd.token_ids) > self.limits.max_context_length:
            raise SessionFailure(ErrorCode.RESOURCE_EXHAUSTED, "commit reaches position "
                                 f"{cmd.start_position + len(cmd.token_ids)}, beyond the context")
        tokens = self._check_tokens(cmd.token_ids, allow_empty=True)
        if cmd.epoch < session.epoch:
            raise SessionFailure(ErrorCode.INVALID_ARGUMENT,
                                 f"epoch decreased from {session.epoch} to {cmd.epoch}")
        committed, start = session.committed, cmd.start_position
        if start > len(committed):
            raise SessionFailure(ErrorCode.OUT_OF_SYNC, f"commit starts at {start}, beyond the "
                                 f"{len(committed)} committed tokens")
        resent = tokens[: len(committed) - start]
        if committed[start:start + len(resent)] != resent:
            raise SessionFailure(ErrorCode.OUT_OF_SYNC, "re-sent tokens disagree with the "
                                 f"committed sequence from position {start}")
        new = tokens[len(resent):]
        if cmd.epoch == session.epoch and session.tree and new:
            raise SessionFailure(ErrorCode.OUT_OF_SYNC, "a tree session's commit must start a "
                                 "new epoch")
        if cmd.epoch == session.epoch:
            # Same epoch: the new tokens are accepted drafts; later drafts stay valid.
            if session.drafts[: len(new)] != new:
                raise SessionFailure(ErrorCode.OUT_OF_SYNC, "commit under the same epoch is "
                                     "not a prefix of the outstanding drafts")
            del session.drafts[: len(new)]
        else:
            # Diverged: outstanding drafts are void; the proposer rolls its cache back to the
            # committed sequence when it is next asked to continue it.
            session.drafts.clear()
            session.epoch = cmd.epoch
            session.generation += 1
            session.stalled = False
        committed.extend(new)
        if cmd.features is not None and session.features is not None:
            session.features.put(cmd.features)
            session.stalled = False  # a head drafts anew from fresh features
        if cmd.max_run_ahead is not None:  # 0 pauses drafting until a commit raises it
            session.max_run_ahead = min(cmd.max_run_ahead, self.limits.max_run_ahead_cap)
        if len(committed) > self.limits.max_context_length:
            raise SessionFailure(ErrorCode.RESOURCE_EXHAUSTED, f"sequence of {len(committed)} "
                                 f"tokens exceeds the context length")
        self._wake.set()

    def _check_tokens(self, token_ids: list[int], allow_empty: bool) -> list[int]:
        tokens = list(token_ids)
        if not tokens and not allow_empty:
            raise SessionFailure(ErrorCode.INVALID_ARGUMENT, "token_ids must not be empty")
        vocab = self.limits.vocab_size
        bad = [t for t in tokens if not 0 <= t < vocab]
        if bad:
            raise SessionFailure(ErrorCode.INVALID_ARGUMENT,
                                 f"token ids outside the vocabulary [0, {vocab}): {bad[:5]}")
        return tokens

    def _fail(self, stream: Stream, sid: str, code: ErrorCode, message: str,
              epoch: int) -> None:
        if sid in stream.sessions:
            self._drop(stream.sessions[sid])
        stream.put(SessionError(sid, code, message, epoch))

    def _drop(self, session: Session) -> None:
        if session.stream.sessions.get(session.session_id) is session:
            del session.stream.sessions[session.session_id]
        if self._sessions.pop(session.key, None) is None:
            return
        proposer = self.proposers[session.method]
        # On the forward thread, after any step in flight that still uses the state; a
        # RuntimeError means the executor is shut down because the worker is closing.
        with contextlib.suppress(RuntimeError):
            if isinstance(proposer, Learner):  # the final text: commits since the last step too
                self._executor.submit(proposer.learn, session.tenant, list(session.committed))
            self._executor.submit(proposer.release, session.key)

    # --- drafting loop ------------------------------------------------------------------------

    def _wants_draft(self, s: Session) -> bool:
        return (not s.stalled and len(s.drafts) < s.max_run_ahead
                and s.length < self.limits.max_context_length)

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
            jobs: _Jobs = {}
            for s in ready:
                jobs.setdefault(s.method, []).append((s, s.generation, s.request()))
            try:
                results = await loop.run_in_executor(self._executor, self._run_step, jobs)
            except RuntimeError:  # executor shut down under us: the worker is closing
                return
            self._steps += 1
            for method, batch in jobs.items():
                for (s, generation, req), res in zip(batch, results[method]):
                    try:
                        self._apply(s, generation, req, res)
                    except Exception as exc:  # a bug costs this session, not the loop
                        log.exception("applying drafts for session %r failed", s.session_id)
                        self._fail(s.stream, s.session_id, ErrorCode.INTERNAL, repr(exc),
                                   s.epoch)

    def _run_step(self, jobs: _Jobs) -> dict[Method, list[DraftResult]]:
        """Forward thread: one propose call per method over all its sessions."""
        return {method: propose_isolated(self.proposers[method], [req for _, _, req in batch])
                for method, batch in jobs.items()}

    def _apply(self, s: Session, generation: int, req: DraftRequest, res: DraftResult) -> None:
        if s.key not in self._sessions:
            return  # closed while the step ran
        if res.error is not None:
            self._fail(s.stream, s.session_id, res.error, res.message, s.epoch)
            return
        if s.generation != generation or s.length != len(req.token_ids):
            return  # rolled back while the step ran: these drafts continue a stale sequence
        if s.tree:
            self._send_tree(s, res)
            return
        room = min(s.max_run_ahead - len(s.drafts), self.limits.max_context_length - s.length)
        tokens = res.tokens[: max(room, 0)]
        if not res.tokens:
            s.stalled = True  # same sequence, same answer: wait for a commit to change it
        for tok in tokens:
            s.stream.put(Proposal(s.session_id, s.epoch, s.length, tok))
            s.drafts.append(tok.token_id)
        self._tokens_drafted += len(tokens)

    def _send_tree(self, s: Session, res: DraftResult) -> None:
        """Stream a tree's nodes (parents first; one tree per epoch: the next commit starts a
        new epoch and wakes the session again)."""
        s.stalled = True
        parents = res.parents if res.parents is not None else tuple(range(-1, len(res.tokens) - 1))
        room = self.limits.max_context_length - s.length  # deepest level that still fits
        kept: dict[int, int] = {-1: -1}  # the proposer's node index -> the one sent
        depth: dict[int, int] = {-1: 0}
        nodes = []
        for j, tok in enumerate(res.tokens):
            p = parents[j]
            if not -1 <= p < j:  # a proposer bug: never send what the verifier must refuse
                raise ValueError(f"tree node {j} has parent {p}")
            if p not in kept or depth[p] + 1 > room or len(nodes) == s.max_run_ahead:
                continue  # beyond the context or the size cap (its subtree goes with it)
            kept[j], depth[j] = len(nodes), depth[p] + 1
            prob = res.scores[j] if j < len(res.scores) else 0.0
            nodes.append((tok, kept[p], depth[j], prob))
        for i, (tok, parent, d, prob) in enumerate(nodes):
            s.stream.put(Proposal(s.session_id, s.epoch, s.length + d - 1, tok,
                                  TreeNode(parent, prob, last=i == len(nodes) - 1)))
        self._tokens_drafted += len(nodes)

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
        for stream in list(self._streams):
            self.close_stream(stream)
            stream.put(None)
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._executor.shutdown(wait=False, cancel_futures=True)
