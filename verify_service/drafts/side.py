"""The verifier's side of drafting: which link serves each session, proposals in, commits out.

Proposals arrive as tandem.spec dataclasses (the draft-link client converts protobuf) and are
checked before they count: wrong session, stale epoch, out of order, outside the vocabulary or
a malformed q drop that session's stream only. Every failure here turns one session (or one
link's sessions) to plain decoding; speculation fails open.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Container, Mapping
from typing import Protocol

from tandem.backoff import backoff_s
from tandem.spec import (
    Close,
    Commit,
    Control,
    Features,
    Method,
    Open,
    Reply,
    SessionError,
)
from verify_service.drafts.checks import checked
from verify_service.drafts.held import HeldCommits
from verify_service.drafts.watch import REFUSALS, LinkWatch
from verify_service.policy.feedback import Latency, note_link_round
from verify_service.session.sequence import DRAFT_ATTACHES, Sequence

log = logging.getLogger(__name__)
# After a try that found no draft worker, a session looks again after this, doubling per miss.
ATTACH_BACKOFF_S, MAX_ATTACH_BACKOFF_S = 0.25, 1.0
# A session whose re-attach budget (DRAFT_ATTACHES streams that never drafted for it) is spent
# rests this long, then gets one more: under churn a session must not lose drafting for good,
# and a stream that keeps failing it is tried only this often.
ATTACH_REST_S = 5.0


class Link(Protocol):
    """One stream to a draft worker (verify_service/drafts/link.py, a worker hosted in this
    process, or a test's script)."""

    address: str

    def send(self, control: Control) -> None: ...


class Host(Protocol):
    """A draft worker in this process (layer skip over the verifier's own target): its link
    carries the same messages with no socket, no protobuf and no gRPC."""

    def link(self, on_message, on_broken) -> Link:
        """The live link to it (a new one when the last ended)."""
        ...


def _alive(link: Link) -> bool:
    """A link that broke drops what it is sent: a session must not stay on it (a script
    without the flag never breaks)."""
    return getattr(link, "alive", True)


class Links(Protocol):
    """Where links come from (DraftPool)."""

    async def get(self, hint: str = "", avoid: Container[str] = ()) -> Link | None: ...

    def mark_failed(self, address: str, link: Link | None = None) -> None: ...

    async def close(self) -> None: ...


class DraftSide:
    def __init__(self, sessions: Mapping[str, Sequence], vocab_size: int, top_n: int,
                 max_run_ahead: int, pool: Links | None = None, clock=time.monotonic):
        self.sessions = sessions  # the engine's, read-only here
        self.vocab_size, self.top_n, self.max_run_ahead = vocab_size, top_n, max_run_ahead
        self.pool = pool
        self.hosted: dict[Method, Host] = {}  # methods served in this process
        self.links: dict[str, Link] = {}
        self.arrived = asyncio.Event()  # set whenever a draft token is accepted for checking
        self.arrival = Latency(5.0)  # gap between draft tokens, for the wait bound
        self.first = Latency(10.0)  # from asking for drafts (commit) to the first arriving
        self._last_arrival = 0.0
        self._asked_at: dict[str, float] = {}  # session -> when its last commit asked
        self._run_ahead: dict[str, int] = {}  # session -> the run-ahead its last commit set
        self._held = HeldCommits()  # what a paused worker learns with its next ask
        self._attaching: set[str] = set()
        self._clock = clock
        self.watch = LinkWatch(clock)  # workers that refuse a session or never draft for it

    def linked(self, seq: Sequence) -> bool:
        return seq.session_id in self.links

    def asked(self, seq: Sequence) -> int:
        """The run-ahead the session's last commit asked its link (or the one it is opening)
        for; 0: paused, or no link."""
        return self._run_ahead.get(seq.session_id, 0) if self.coming(seq) else 0

    def coming(self, seq: Sequence) -> bool:
        """Whether drafts may come: a link, or one being opened."""
        return seq.session_id in self.links or seq.session_id in self._attaching

    # ---- out: open / commit / close ----------------------------------------------------------
    def attach(self, seq: Sequence, run_ahead: int | None = None) -> None:
        """Open a draft stream for seq in the background, if it may still have one, once its
        worker is asked for drafts (auto: policy/auto.py; others: none while the pool says they
        do not pay): until then it costs the worker nothing, not even an Open drafting before
        its pause came, and the Open brings it in sync. `run_ahead`: the drafts its Open asks
        for (None: the last commit's ask, or the most)."""
        if run_ahead is not None:
            self._run_ahead[seq.session_id] = min(run_ahead, self.max_run_ahead)
        if seq.link.attaches_left <= 0:  # spent: rest, then one more try (ATTACH_REST_S)
            seq.link.attaches_left, seq.link.next_attach_at = 1, self._clock() + ATTACH_REST_S
        if ((self.pool is not None or seq.link_method in self.hosted)
                and seq.speculating and not seq.finished
                and not seq.params.method.in_verifier
                and self._run_ahead.get(seq.session_id, 0 if seq.local.in_verifier else 1) > 0
                and (not seq.local.in_verifier or seq.params.auto_draft is not None)
                and seq.session_id not in self._attaching
                and self._clock() >= seq.link.next_attach_at):
            self._attaching.add(seq.session_id)
            asyncio.get_running_loop().create_task(self._attach(seq))

    async def _attach(self, seq: Sequence) -> None:
        try:
            host = self.hosted.get(seq.link_method)  # a method served in this process
            link = host.link(self.on_reply, self.on_link_broken) if host is not None \
                else await self._from_pool(seq)
        finally:
            self._attaching.discard(seq.session_id)
        if seq.finished or seq.session_id not in self.sessions:
            return
        if link is None or not _alive(link):
            # No worker now (restarting, draining), or the link broke while this session
            # waited for it (its on_link_broken ran before the session was on it, so
            # keeping it would leave the session on a dead link for good): look again later,
            # for free.
            seq.link.attach_misses += 1
            seq.link.next_attach_at = self._clock() + backoff_s(
                seq.link.attach_misses, ATTACH_BACKOFF_S, MAX_ATTACH_BACKOFF_S)
            return
        seq.link.attach_misses = 0
        seq.link.attaches_left -= 1  # given back by the stream's first draft (on_reply)
        self.links[seq.session_id] = link
        self._held.drop(seq.session_id)  # its Open sends every token
        seq.drop_link_drafts()
        note_link_round(seq, arrived=True)  # a new stream gets waited for again
        p, s = seq.params, seq.params.sampling
        run_ahead = self._run_ahead.get(seq.session_id)  # the last commit's ask, if any
        if run_ahead is None and seq.local.in_verifier:
            run_ahead = 0  # auto: no drafts until its history misses (policy/auto.py)
        link.send(Open(session_id=seq.session_id, token_ids=seq.tokens, epoch=seq.epoch,
                       temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, seed=s.seed,
                       method=seq.link_method, max_run_ahead=run_ahead or self.max_run_ahead,
                       top_n=self.top_n, trace_context=p.trace_context,
                       features=seq.link.all_features(), tenant=p.tenant,
                       tree=bool(p.tree) and not seq.local.in_verifier,  # auto's worker: chains
                       grammar=p.grammar, grammar_start=len(p.prompt),
                       controls=s.control_items() if s.has_controls or s.min_p else ()))
        if run_ahead == 0:  # a session at k = 0: Open cannot say "none yet", a commit can
            link.send(Commit(seq.session_id, seq.epoch, seq.num_tokens, [], 0, None))
            return
        self.watch.asked(seq.session_id, seq.link_method)
        if seq.local.in_verifier:  # auto opens when it asks: its first draft is timed from here
            self._asked_at[seq.session_id] = time.perf_counter()

    def commit(self, seq: Sequence, start: int, tokens: list[int],
               features: Features | None = None, run_ahead: int | None = None) -> None:
        """Tell the draft what was committed from `start` (re-attach if it has no stream),
        with the target's hidden states of the positions made final (EAGLE sessions) and how
        many drafts the next round can use (run_ahead: None leaves the worker's limit as is,
        0 pauses drafting)."""
        if features is not None:  # kept first: a re-attach's Open sends the whole history
            seq.link.keep_features(features)
        paused = self._run_ahead.get(seq.session_id, -1) == 0  # the worker drafts nothing
        if run_ahead is not None:  # also what a re-attach's Open asks for
            run_ahead = self._run_ahead[seq.session_id] = min(run_ahead, self.max_run_ahead)
        link = self.links.get(seq.session_id)
        if link is not None and not _alive(link):  # broke without telling (see _attach)
            self._detach(seq, close=False)
            link = None
        asking = self._asking(seq)
        if not asking:
            self.watch.quiet(seq.session_id)
        elif link is not None and self.watch.silent(seq.session_id):
            self._leave(seq, link, "sent no drafts for it")
            link = None
        if link is None:
            self.attach(seq)
        elif paused and run_ahead == 0:
            self._held.hold(seq.session_id, start, features)
        else:
            start, tokens, features = self._held.take(seq, start, tokens, features)
            if run_ahead == 0:
                self._asked_at.pop(seq.session_id, None)
            else:
                self._asked_at[seq.session_id] = time.perf_counter()
            if asking:
                self.watch.asked(seq.session_id, seq.link_method)
            link.send(Commit(seq.session_id, seq.epoch, start, tokens, run_ahead, features))

    async def _from_pool(self, seq: Sequence) -> Link | None:
        avoid = self.watch.avoided(seq.session_id)  # the workers that refused it, if any
        return await self.pool.get(seq.params.draft_address, () if avoid is None else avoid)

    def _asking(self, seq: Sequence) -> bool:
        """Whether the session wants drafts from its link now (an auto session not until
        a commit asks: verify_service/policy/auto.py)."""
        default = 0 if seq.local.in_verifier else self.max_run_ahead
        return self._run_ahead.get(seq.session_id, default) > 0

    def _leave(self, seq: Sequence, link: Link, why: str) -> None:
        """Move the session off a worker that fails it while its link is up: it stays away
        from that worker for a while (watch.py); the next attach finds another, or none."""
        log.info("draft %s %s %s: moving it", link.address, why, seq.session_id)
        self.watch.avoid(seq.session_id, link.address)
        self._detach(seq, close=True)

    def release(self, seq: Sequence) -> None:
        self.watch.forget(seq.session_id)
        self._asked_at.pop(seq.session_id, None)
        self._run_ahead.pop(seq.session_id, None)
        held = self._held.final(seq)
        link = self.links.pop(seq.session_id, None)
        if link is not None:
            if held is not None:
                link.send(held)
            link.send(Close(seq.session_id))

    # ---- in: proposals and failures ----------------------------------------------------------
    def on_reply(self, link: Link, reply: Reply) -> None:
        seq = self.sessions.get(reply.session_id)
        if seq is None or self.links.get(reply.session_id) is not link or seq.finished:
            return  # closed session or one that moved to another link: harmless
        if reply.epoch != seq.epoch:
            return  # drafted (or failed) before the last divergence or re-attach
        if isinstance(reply, SessionError):
            log.info("draft %s gave up on %s: %s", link.address, seq.session_id, reply.message)
            if reply.code in REFUSALS:  # full, or failing it: try another worker next
                self.watch.avoid(seq.session_id, link.address)
            self._detach(seq, close=False)
            return
        token = checked(seq, reply, self.vocab_size, self.top_n, self.max_run_ahead)
        if token is None:  # malformed or out of order: resynchronise this session only
            log.info("draft %s sent %s a proposal out of place (position %d, expected %d) or "
                     "malformed: re-attaching", link.address, seq.session_id, reply.position,
                     seq.next_draft_position())
            self._detach(seq, close=True)
            return
        if reply.tree is None:
            if len(seq.link_drafts) >= self.max_run_ahead:  # more than any limit it was given
                self._detach(seq, close=True)
                return
            seq.link_drafts.append(token)
        else:
            seq.add_node(token, reply.tree.parent, reply.tree.path_prob, reply.tree.last)
        seq.link.attaches_left = DRAFT_ATTACHES  # this stream works
        self.watch.quiet(seq.session_id)
        now = time.perf_counter()
        asked = self._asked_at.pop(seq.session_id, None)
        if asked is not None and now - asked < 0.5:  # the first draft since the commit
            self.first.observe((now - asked) * 1e3)
        gap_ms = (now - self._last_arrival) * 1e3
        if gap_ms < 200:  # gaps across idle periods say nothing about drafting speed
            self.arrival.observe(gap_ms)
        self._last_arrival = now
        self.arrived.set()

    def _detach(self, seq: Sequence, close: bool) -> None:
        """Stop taking this session's proposals from its link. The epoch moves on, so what the
        old attach still has in flight fails the epoch check after a re-attach."""
        link = self.links.pop(seq.session_id)
        self._held.drop(seq.session_id)  # a re-attach's Open sends every token
        self.watch.quiet(seq.session_id)
        if close:
            link.send(Close(seq.session_id))
        seq.drop_link_drafts()
        seq.next_epoch()

    def on_link_broken(self, link: Link) -> None:
        if self.pool is not None:  # (an in-process link's address is none of the pool's)
            self.pool.mark_failed(link.address, link)
        for session_id, owner in list(self.links.items()):
            if owner is link:
                del self.links[session_id]
                self.watch.quiet(session_id)
                seq = self.sessions.get(session_id)
                if seq is not None:
                    seq.drop_link_drafts()
                    seq.next_epoch()

    async def close(self) -> None:
        if self.pool is not None:
            await self.pool.close()
