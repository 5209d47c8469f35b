"""A verifier session: committed tokens, the round's drafts and epoch, and records that each
have one writer (tests/unit/test_session_owners.py holds the code to it):

    Sequence         its own methods (commit, the drafts, the epoch, finish)
    .sched           Scheduling      verify_service/policy/scheduler.py
    .link            DraftLinkState  verify_service/drafts/side.py
    .est             Estimates       verify_service/policy/feedback.py
    .local           LocalProposals  verify_service/policy/auto.py (proposers offer() into it)
    .stats           SessionStats    verify_service/sessions.py

Pure Python (no torch): the scheduler and the engine loop share it on the event-loop thread.
Invariant between rounds: the KV cache holds every committed token but the last one, which is
the first input of the next round; except for a *carried* session (all drafts of its last
round accepted, the next draft already waiting), whose KV holds every committed token and
whose next-position target distribution the engine kept (docs/design/brief.md, speculation
loop step 5).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from tandem.spec import DraftToken, Features, Method
from verify_service.session.params import GenerateParams

DRAFT_ATTACHES = 3


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # needs a prefill (new, resumed or preempted)
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class LocalProposal:
    """One proposer's drafts for a round of a session drafted in the verifier."""

    drafts: list[DraftToken]
    parents: tuple[int, ...] | None  # a tree's (Sequence.draft_parents); None = a chain
    reach: list[float]  # the proposer's estimate that each draft is accepted


@dataclass
class SessionStats:
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    lossy: bool = False  # a round verified drafts by typical acceptance
    # Drafts from the prediction (GenerateParams.prediction) kept, and verified but not kept.
    prediction_accepted: int = 0
    prediction_rejected: int = 0


@dataclass
class Scheduling:
    """Where the session stands in the batch (written by verify_service/policy/scheduler.py)."""

    status: SeqStatus = SeqStatus.WAITING
    arrival: int = 0  # admission order, for FIFO and preemption choice
    # Chunked prefill: tokens whose KV is still to be computed (their slots are allocated);
    # 0 = prefilled, decoding. A session is not sampled until its last chunk.
    prefill_left: int = 0
    carried: bool = False  # see the module docstring
    # A worker probe whose drafts had not come by its round stays open through this round
    # (verify_service/policy/batch.py late_probe); -1: none open.
    probe_until: int = -1


@dataclass
class DraftLinkState:
    """The session's draft stream (written by verify_service/drafts/side.py)."""

    # Draft streams this session may still open that deliver nothing (a stream that delivers
    # a draft refills it: restarts and drains of a worker never use it up); and, after a try
    # that found no worker at all, when it may look again (backing off, free of charge).
    attaches_left: int = DRAFT_ATTACHES
    attach_misses: int = 0
    next_attach_at: float = 0.0
    # EAGLE sessions: the target's hidden states of positions [0, n) as fp16 bytes, so a
    # draft stream opened mid-session (re-attach) starts from the whole history.
    features: bytearray = field(default_factory=bytearray)
    feature_size: int = 0

    def keep_features(self, f: Features) -> None:
        """Record a round's hidden states (a recomputation after preemption overwrites)."""
        self.feature_size = f.hidden_size
        del self.features[f.start_position * 2 * f.hidden_size:]
        self.features += f.data

    def all_features(self) -> Features | None:
        return self.features_from(0) if self.features else None

    def features_from(self, start: int) -> Features:
        """The kept hidden states of positions [start, n)."""
        return Features(start, self.feature_size,
                        bytes(self.features[start * 2 * self.feature_size:]))


@dataclass
class Estimates:
    """What the session measured of its drafts (written by verify_service/policy/feedback.py)."""

    acceptance_ema: float = 0.7  # prior: a fresh session is assumed to speculate well
    late_rounds: int = 0  # rounds in a row whose wanted drafts had not arrived
    tree_wait_ms: float = 0.0  # EMA: from the commit to a complete tree (drafted after it)
    tree_scale: float = 1.0  # accepted / expected per tree round (EMA): corrects the estimate
    # Each local source's correction to its reach estimates (accepted / expected) and the
    # decayed sums it is the ratio of (tandem.spec.cost.update_source_scale); the sources
    # whose drafts this session verified.
    source_scale: dict[Method, float] = field(default_factory=dict)
    source_evidence: dict[Method, tuple[float, float]] = field(default_factory=dict)
    drafted_from: set[Method] = field(default_factory=set)


@dataclass
class LocalProposals:
    """Drafts made in the verifier's own step (written by verify_service/policy/auto.py; the history
    and the Medusa heads offer() theirs)."""

    # Drafted in the verifier from the token history (verify_service/drafts/history.py): afresh each
    # round, sized by draft_reach; never over a draft link.
    in_verifier: bool = False
    # This round's proposals by source (suffix, ngram; Medusa heads for auto) before auto.pick
    # takes one into the session's drafts; the source of the current drafts.
    proposals: dict[Method, LocalProposal] = field(default_factory=dict)
    source: Method | None = None
    history_misses: int = 0  # rounds in a row the token history proposed nothing

    def offer(self, method: Method, proposal: LocalProposal) -> None:
        self.proposals[method] = proposal


@dataclass
class Sequence:
    params: GenerateParams
    output: list[int] = field(default_factory=list)  # committed generated tokens
    epoch: int = 0
    # Checked proposals, contiguous from position num_tokens: a chain, or a tree when
    # draft_parents gives each draft's parent among them (-1 = the last committed token).
    drafts: list[DraftToken] = field(default_factory=list)
    draft_parents: tuple[int, ...] | None = None
    # A tree from the draft worker (eagle): each node's reach as the draft estimates it, and
    # whether its last node arrived; the last tree's estimates size the next until it comes.
    draft_reach: list[float] = field(default_factory=list)
    tree_complete: bool = False
    last_reach: tuple[float, ...] = ()
    # auto linked to a draft worker (params.auto_draft): the worker's chain, contiguous from
    # num_tokens, kept apart from `drafts` until auto.pick takes it as a proposal.
    remote: list[DraftToken] = field(default_factory=list)
    finish_reason: str | None = None
    error: str = ""  # why, when finish_reason is "error" (the client's 400) or "fault" (500)
    # Structured output: a tandem.grammar.GrammarState at the committed tokens (None = free
    # text); it masks every verified position and advances only by committed tokens.
    grammar: Any = None
    sched: Scheduling = field(default_factory=Scheduling)
    link: DraftLinkState = field(default_factory=DraftLinkState)
    est: Estimates = field(default_factory=Estimates)
    local: LocalProposals = field(default_factory=LocalProposals)
    stats: SessionStats = field(default_factory=SessionStats)

    def __post_init__(self):
        self.output = list(self.params.committed)

    @property
    def session_id(self) -> str:
        return self.params.session_id

    @property
    def tokens(self) -> list[int]:
        return [*self.params.prompt, *self.output]

    @property
    def num_tokens(self) -> int:
        return len(self.params.prompt) + len(self.output)

    @property
    def speculating(self) -> bool:  # (a prediction is a draft even with method none)
        return self.params.method is not Method.NONE or bool(self.params.prediction)

    @property
    def link_method(self) -> Method:
        """The method a draft link of this session drafts (auto: its worker's model method)."""
        return self.params.auto_draft or self.params.method

    @property
    def needs_features(self) -> bool:
        """Whether the target's hidden states go with its commits (EAGLE, MTP; auto linked
        to an EAGLE worker)."""
        return self.link_method.needs_features

    @property
    def link_drafts(self) -> list[DraftToken]:  # an auto session's own buffer, or drafts
        return self.remote if self.local.in_verifier else self.drafts

    def next_draft_position(self) -> int:
        return self.num_tokens + len(self.link_drafts)

    def drop_link_drafts(self) -> None:  # what the draft link sent (stream opened or broken)
        self.remote.clear() if self.local.in_verifier else self.clear_drafts()

    def commit(self, accepted: list[int], next_token: int | None) -> list[int]:
        """Append a round's tokens, cut at a stop token or the length limit; returns them.

        The epoch survives only when the final token is itself the draft's next proposal
        (a bonus token equal to an arrived draft token): the draft's run-ahead then continues.
        With no final token (a carried round: every draft accepted, no bonus sampled) the
        drafts stay valid too. Otherwise the epoch is bumped and the arrived drafts, now stale,
        are dropped.
        """
        new = [*accepted, *([] if next_token is None else [next_token])]
        budget = self.params.max_new_tokens - len(self.output)
        for i, tok in enumerate(new[:budget]):
            if tok in self.params.stop_token_ids:
                new, self.finish_reason = new[: i + 1], "stop"
                break
        else:
            if len(new) >= budget:
                new, self.finish_reason = new[:budget], "length"
        self.output.extend(new)
        k = len(accepted)
        if self.local.in_verifier and self.params.auto_draft is not None:
            self.clear_drafts(remote=False)  # drafted afresh each round; the worker's chain
            self._advance_remote(new)  # goes on if it holds what was committed
        elif self.params.tree or self.params.method.in_verifier or self.local.in_verifier:
            self.clear_drafts()  # a tree (any in-verifier draft) is drafted afresh each round,
            self.epoch += 1  # in a new epoch: late nodes of this one are dropped
        elif next_token is None:
            self.drafts = self.drafts[k:]
        elif len(self.drafts) > k and self.drafts[k].token_id == next_token:
            self.drafts = self.drafts[k + 1:]
        else:
            self.epoch += 1
            self.drafts = []
        return new

    def _advance_remote(self, new: list[int]) -> None:
        """The worker's chain after a commit of `new`: its rest when it began with them
        (the worker's run-ahead goes on, same epoch), else void in a new epoch."""
        held = [d.token_id for d in self.remote[:len(new)]] == new
        self.remote, self.epoch = (self.remote[len(new):], self.epoch) if held else \
            ([], self.epoch + 1)

    def scaled_reach(self, source: Method | None, reach) -> list[float]:
        """A source's per-node reach estimates corrected by what this session measured of it
        (source_scale; 1 for a source it has not drafted from)."""
        scale = self.est.source_scale.get(source, 1.0)
        return [min(1.0, r * scale) for r in reach]

    def clear_drafts(self, remote: bool = True) -> None:
        if remote:  # (auto) the worker's chain too
            self.remote.clear()
        if self.draft_reach:
            self.last_reach = tuple(self.draft_reach)
        self.drafts, self.draft_parents = [], None
        self.draft_reach, self.tree_complete = [], False

    def take_drafts(self, drafts: list[DraftToken], parents: tuple[int, ...] | None,
                    reach: list[float] | None = None) -> None:
        """The round's drafts from a local source (auto.pick, the Medusa heads, the grammar's
        forced tokens) in place of what was there."""
        self.drafts, self.draft_parents = list(drafts), parents
        if reach is not None:
            self.draft_reach = list(reach)

    def next_epoch(self) -> None:
        """What was drafted for the current epoch is void (preempted, re-attached, link lost)."""
        self.epoch += 1

    def set_finished(self, reason: str, error: str = "") -> None:
        if not self.finish_reason:
            self.finish_reason, self.error = reason, error

    def add_node(self, token: DraftToken, parent: int, path_prob: float, last: bool) -> None:
        """Append a checked tree node (drafts.py checks parent and position first)."""
        self.drafts.append(token)
        self.draft_parents = (*(self.draft_parents or ()), parent)
        self.draft_reach.append(path_prob)
        self.tree_complete = last

    def node_depth(self, node: int) -> int:
        """Depth of draft node `node` of the current tree (1 = a child of the root); 0 for
        -1, the root itself."""
        depth, parents = 0, self.draft_parents or ()
        while node >= 0:
            depth, node = depth + 1, parents[node]
        return depth

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
