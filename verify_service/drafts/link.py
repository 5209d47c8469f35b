"""The verifier's end of DraftService.Speculate: one stream per draft worker, many sessions.

A DraftLink owns one bidirectional stream; control messages are queued without blocking the
engine loop, proposals are handed to a callback. A broken stream only turns its sessions to
plain decoding (speculation fails open); the DraftPool reconnects them elsewhere.
This is the protobuf edge of the draft link: it sends and receives tandem.spec dataclasses.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Container

import grpc

from tandem.backoff import KeyedBackoff
from tandem.grpc_limits import (
    DEFAULT_MAX_MESSAGE_BYTES,
    KEEPALIVE_S,
    KEEPALIVE_TIMEOUT_S,
    keepalive_options,
    message_options,
)
from tandem.sampling_params import SamplingParams
from tandem.spec import (
    Close,
    Commit,
    Control,
    DraftToken,
    ErrorCode,
    Features,
    Open,
    Proposal,
    Reply,
    SessionError,
    TreeNode,
)
from tandem.tls import TlsConfig, open_channel
from tandem.v1 import common_pb2, draft_pb2, draft_pb2_grpc

log = logging.getLogger(__name__)
STREAM_DEADLINE_S = 24 * 3600.0  # long-lived by design; a deadline still bounds a lost peer
# A worker that failed is skipped for 0.5 s, doubling with each failure in a row up to
# RETRY_BACKOFF_S (a restarting worker is tried again within about a second of its return).
FIRST_RETRY_S, RETRY_BACKOFF_S = 0.5, 5.0
# Control messages waiting to be sent on one link. A link that cannot drain this many (its
# peer stopped reading) is broken rather than buffered without bound.
MAX_QUEUED = 4096


def control_to_proto(c: Control) -> draft_pb2.DraftControl:
    if isinstance(c, Open):
        return draft_pb2.DraftControl(open=draft_pb2.OpenSession(
            session_id=c.session_id, token_ids=c.token_ids, epoch=c.epoch,
            trace_context=dict(c.trace_context), method=int(c.method),
            max_run_ahead=c.max_run_ahead, top_n=c.top_n, max_ngram_size=c.max_ngram_size,
            sampling=common_pb2.SamplingParams(temperature=c.temperature, top_k=c.top_k,
                                               top_p=c.top_p, seed=c.seed,
                                               **SamplingParams.controls_to_wire(c.controls)),
            features=_features(c.features), tenant=c.tenant, tree=c.tree,
            grammar=None if c.grammar is None else common_pb2.Grammar(**c.grammar.to_wire()),
            grammar_start=c.grammar_start))
    if isinstance(c, Commit):
        return draft_pb2.DraftControl(commit=draft_pb2.CommitTokens(
            session_id=c.session_id, epoch=c.epoch, start_position=c.start_position,
            token_ids=c.token_ids, max_run_ahead=c.max_run_ahead,
            features=_features(c.features)))
    if isinstance(c, Close):
        return draft_pb2.DraftControl(close=draft_pb2.CloseSession(session_id=c.session_id))
    raise TypeError(f"not a draft control message: {c!r}")


def _features(f: Features | None) -> draft_pb2.TargetFeatures | None:
    if f is None:
        return None
    return draft_pb2.TargetFeatures(start_position=f.start_position, hidden_size=f.hidden_size,
                                    data=f.data)


def reply_from_proto(msg: draft_pb2.DraftProposal) -> Reply:
    if msg.HasField("error"):
        try:
            code = ErrorCode(msg.error.code)
        except ValueError:  # a code newer than this verifier
            code = ErrorCode.INTERNAL
        return SessionError(msg.session_id, code, msg.error.message, msg.epoch)
    node = None
    if msg.HasField("tree"):
        t = msg.tree
        node = TreeNode(t.parent, t.path_prob, t.last)
    return Proposal(msg.session_id, msg.epoch, msg.position, DraftToken(
        msg.token_id, tuple(msg.q.token_ids), tuple(msg.q.probs)), node)


class DraftLink:
    def __init__(self, address: str,
                 on_message: Callable[[DraftLink, Reply], None],
                 on_broken: Callable[[DraftLink], None], tls: TlsConfig | None = None,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 keepalive: tuple[float, float] = (KEEPALIVE_S, KEEPALIVE_TIMEOUT_S),
                 max_queued: int = MAX_QUEUED):
        self.address = address
        self.tls = tls
        self.max_message_bytes = max_message_bytes
        self.keepalive = keepalive
        self.alive = False
        self._on_message = on_message
        self._on_broken = on_broken
        # One slot more than max_queued for the closing sentinel.
        self._queue: asyncio.Queue[draft_pb2.DraftControl | None] = asyncio.Queue(max_queued + 1)
        self._max_queued = max_queued
        self._channel: grpc.aio.Channel | None = None
        self._reader: asyncio.Task | None = None

    async def start(self, connect_timeout_s: float = 2.0) -> bool:
        self._channel = open_channel(self.address, self.tls,
                                     message_options(self.max_message_bytes)
                                     + keepalive_options(*self.keepalive))
        try:
            await asyncio.wait_for(self._channel.channel_ready(), connect_timeout_s)
        except (asyncio.TimeoutError, grpc.aio.AioRpcError):
            await self._channel.close()
            return False
        call = draft_pb2_grpc.DraftServiceStub(self._channel).Speculate(
            self._requests(), timeout=STREAM_DEADLINE_S)
        self.alive = True
        self._reader = asyncio.create_task(self._read(call))
        return True

    def send(self, control: Control) -> None:
        if not self.alive:
            return
        if self._queue.qsize() >= self._max_queued:  # the peer stopped reading: give up on it
            log.warning("draft link to %s has %d messages unsent: breaking it", self.address,
                        self._max_queued)
            self._break()
            return
        self._queue.put_nowait(control_to_proto(control))

    def _break(self) -> None:
        """The link is broken (from either side): its sessions go plain now (on_broken), the
        stream and channel close in the background."""
        if self.alive:
            self.alive = False
            self._on_broken(self)
            asyncio.get_running_loop().create_task(self.close())

    async def _requests(self):
        while (msg := await self._queue.get()) is not None:
            yield msg

    async def _read(self, call) -> None:
        try:
            async for proposal in call:
                self._on_message(self, reply_from_proto(proposal))
        except grpc.aio.AioRpcError as exc:
            log.warning("draft stream to %s broke: %s", self.address, exc.code().name)
        except asyncio.CancelledError:
            pass
        finally:
            self._break()  # broken by the peer or the network (a no-op after close())

    async def close(self) -> None:
        """Idempotent: ends the request stream, the reader and the channel."""
        self.alive = False
        while not self._queue.empty():  # what was never sent never will be
            self._queue.get_nowait()
        self._queue.put_nowait(None)
        if self._reader is not None and self._reader is not asyncio.current_task():
            self._reader.cancel()
        channel, self._channel = self._channel, None
        if channel is not None:
            await channel.close()


class DraftPool:
    """Live links by address; picks one for a session, skipping recently failed workers."""

    def __init__(self, static_addresses: list[str],
                 discover: Callable[[], Awaitable[list[str]]] | None,
                 on_message, on_broken, clock=time.monotonic, tls: TlsConfig | None = None,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 keepalive: tuple[float, float] = (KEEPALIVE_S, KEEPALIVE_TIMEOUT_S)):
        self._static = list(static_addresses)
        self._tls = tls
        self._max_message_bytes = max_message_bytes
        self._keepalive = keepalive
        self._discover = discover
        self._on_message = on_message
        self._on_broken = on_broken
        self.links: dict[str, DraftLink] = {}
        self._connecting: dict[str, asyncio.Future] = {}  # address -> its one start in flight
        self._skips = KeyedBackoff(FIRST_RETRY_S, RETRY_BACKOFF_S, clock)  # per address

    def mark_failed(self, address: str, link: DraftLink | None = None) -> None:
        """The worker at address failed (the link to it broke, or it would not connect):
        skip it for a while. Only `link` itself is forgotten, not a newer one."""
        self._skips.failed(address)
        if link is None or self.links.get(address) is link:
            self.links.pop(address, None)

    async def candidates(self) -> list[str]:
        found = list(self._static)
        if self._discover is not None:
            try:
                found += [a for a in await self._discover() if a not in found]
            except Exception as exc:  # registry trouble must not stop decoding
                log.warning("draft discovery failed: %s", exc)
        return [a for a in found if self._skips.ready(a)]

    async def get(self, hint: str = "", avoid: Container[str] = ()) -> DraftLink | None:
        """A live link for a session, the hint first; none to the addresses in `avoid` (the
        workers that refused this session or never drafted for it)."""
        order = [a for a in await self.candidates() if a not in avoid]
        if hint in order:  # the gateway's pick first
            order.remove(hint)
            order.insert(0, hint)
        for address in order:
            link = self.links.get(address)
            if link is not None and link.alive:
                return link
            # Concurrent callers share one start: one channel and stream per worker.
            pending = self._connecting.get(address)
            if pending is None:
                pending = asyncio.ensure_future(self._connect(address))
                self._connecting[address] = pending
                pending.add_done_callback(lambda _, a=address: self._connecting.pop(a, None))
            link = await asyncio.shield(pending)
            if link is not None:
                return link
        return None

    async def _connect(self, address: str) -> DraftLink | None:
        link = DraftLink(address, self._on_message, self._on_broken, self._tls,
                         self._max_message_bytes, self._keepalive)
        if not await link.start():
            self.mark_failed(address)
            return None
        self._skips.succeeded(address)
        old = self.links.get(address)
        self.links[address] = link
        if old is not None and old is not link:
            await old.close()
        return link

    async def close(self) -> None:
        for pending in list(self._connecting.values()):
            pending.cancel()
        for link in list(self.links.values()):
            await link.close()
        self.links.clear()
