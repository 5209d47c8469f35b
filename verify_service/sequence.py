"""A verifier session: committed tokens, arrived draft tokens, epoch and statistics.

Pure Python (no torch): the scheduler and the engine loop share it on the event-loop thread.
Invariant between rounds: the KV cache holds every committed token but the last one, which is
the first input of the next round; except for a *carried* session (all drafts of its last
round accepted, the next draft already waiting), whose KV holds every committed token and
whose next-position target distribution the engine kept (DESIGN.md, speculation loop step 5).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from tandem.errors import InvalidArgument
from tandem.grammar.spec import GrammarSpec
from tandem.sampling_params import SamplingParams
from tandem.spec import DraftToken, Features, Method

MAX_TOP_LOGPROBS = 20  # as OpenAI's API
DRAFT_ATTACHES = 3
# The draft workers' methods whose drafts an auto session may take beside its own (model
# drafts: what the verifier cannot draft itself).
AUTO_DRAFT_METHODS = frozenset({Method.DRAFT_MODEL, Method.EAGLE})


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # needs a prefill (new, resumed or preempted)
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class GenerateParams:
    """What a Generate call asks for (validated where it enters: the servicer)."""

    session_id: str
    prompt: tuple[int, ...]
    committed: tuple[int, ...]  # resumed after failover: already generated tokens
    sampling: SamplingParams
    max_new_tokens: int
    stop_token_ids: frozenset[int]
    method: Method = Method.NONE
    num_speculative_tokens: int = 0  # 0 = server default
    draft_address: str = ""
    tenant: str = ""  # passed on to the draft worker (per-tenant suffix caches)
    trace_context: tuple[tuple[str, str], ...] = ()  # W3C headers for the draft's span
    # Medusa's typical acceptance (posterior_threshold, posterior_alpha): LOSSY; None = exact.
    typical: tuple[float, float] | None = None
    # Return each generated token's target logprob, with this many top alternatives; None = no.
    logprobs: int | None = None
    # Draft token trees (medusa, eagle) instead of chains; None: medusa's trees, else chains
    # (the servicer always decides, from the request and the server's --draft-shape).
    tree: bool | None = None
    grammar: GrammarSpec | None = None  # structured output: the text follows it
    # auto only: the model method of the draft worker at draft_address whose drafts auto may
    # also take (verify_service/auto.py); None: auto drafts in the verifier alone.
    auto_draft: Method | None = None

    def __post_init__(self):
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidArgument(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got "
                                  f"{self.logprobs}")
        if not self.session_id:
            raise InvalidArgument("session_id is empty")
        if not self.prompt:
            raise InvalidArgument("prompt_token_ids is empty")
        if self.max_new_tokens < 1:
            raise InvalidArgument(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if len(self.committed) >= self.max_new_tokens:
            raise InvalidArgument(
                f"{len(self.committed)} committed tokens already reach max_new_tokens "
                f"{self.max_new_tokens}"
            )
        if not isinstance(self.method, Method) or self.method is Method.UNSPECIFIED:
            raise InvalidArgument(f"unknown speculation method {self.method!r}")
        if self.num_speculative_tokens < 0:
            raise InvalidArgument(
                f"num_speculative_tokens must be >= 0, got {self.num_speculative_tokens}")
        if self.tree is None:
            object.__setattr__(self, "tree", self.method is Method.MEDUSA)
        if self.tree and not self.method.can_tree:
            raise InvalidArgument("draft_shape tree applies to methods medusa, eagle and auto, "
                                  f"not {self.method.api_name}")
        if self.typical is not None:
            threshold, alpha = self.typical
            if not (0 < threshold <= 1 and 0 <= alpha <= 1):
                raise InvalidArgument(
                    "typical_acceptance needs posterior_threshold in (0, 1] and "
                    f"posterior_alpha in [0, 1], got {threshold} and {alpha}")
            if self.method is not Method.MEDUSA:
                raise InvalidArgument("typical_acceptance applies to the medusa method only, "
                                      f"not {self.method.api_name}")
        if self.auto_draft is not None and (self.method is not Method.AUTO or
                                            self.auto_draft not in AUTO_DRAFT_METHODS):
            raise InvalidArgument(f"auto_draft_method {self.auto_draft!r} needs method auto "
                                  f"and draft_model or eagle, not {self.method.api_name}")


@dataclass(frozen=True)
class Proposal:
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


@dataclass
class Sequence:
    params: GenerateParams
    output: list[int] = field(default_factory=list)  # committed generated tokens
    status: SeqStatus = SeqStatus.WAITING
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
    tree_wait_ms: float = 0.0  # EMA: from the commit to a complete tree (drafted after it)
    tree_scale: float = 1.0  # accepted / expected per tree round (EMA): corrects the estimate
    stats: SessionStats = field(default_factory=SessionStats)
    finish_reason: str | None = None
    acceptance_ema: float = 0.7  # prior: a fresh session is assumed to speculate well
    late_rounds: int = 0  # rounds in a row whose wanted drafts had not arrived
    arrival: int = 0  # admission order, for FIFO and preemption choice
    # Draft streams this session may still open that deliver nothing (a stream that delivers
    # a draft refills it: restarts and drains of a worker never use it up); and, after a try
    # that found no worker at all, when it may look again (backing off, free of charge).
    draft_attaches_left: int = DRAFT_ATTACHES
    attach_misses: int = 0
    next_attach_at: float = 0.0
    carried: bool = False  # see the module docstring
    # Drafted in the verifier's own step from the token history (verify_service/history.py):
    # afresh each round, sized by draft_reach; never over a draft link.
    local_drafts: bool = False
    # This round's proposals by source (suffix, ngram; Medusa heads for auto) before
    # verify_service/auto.py picks one into drafts; the source of the current drafts; each
    # source's correction to its reach estimates (accepted / expected) and the decayed sums
    # it is the ratio of (tandem.spec.cost.update_source_scale); the sources whose drafts
    # this session verified.
    proposals: dict[Method, Proposal] = field(default_factory=dict)
    draft_source: Method | None = None
    source_scale: dict[Method, float] = field(default_factory=dict)
    source_evidence: dict[Method, tuple[float, float]] = field(default_factory=dict)
    drafted_from: set[Method] = field(default_factory=set)
    history_misses: int = 0  # rounds in a row the token history proposed nothing
    # auto linked to a draft worker (params.auto_draft): the worker's chain, contiguous from
    # num_tokens, kept apart from `drafts` until auto.pick copies it there as a proposal.
    remote: list[DraftToken] = field(default_factory=list)
    # Chunked prefill: tokens whose KV is still to be computed (their slots are allocated);
    # 0 = prefilled, decoding. A session is not sampled until its last chunk.
    prefill_left: int = 0
    # EAGLE sessions: the target's hidden states of positions [0, n) as fp16 bytes, so a
    # draft stream opened mid-session (re-attach) starts from the whole history.
    features: bytearray = field(default_factory=bytearray)
    feature_size: int = 0
    # Structured output: a tandem.grammar.GrammarState at the committed tokens (None = free
    # text); it masks every verified position and advances only by committed tokens.
    grammar: Any = None

    def __post_init__(self):
        self.output = list(self.params.committed)

    @property
    def seq_id(self) -> str:
        return self.params.session_id

    @property
    def tokens(self) -> list[int]:
        return [*self.params.prompt, *self.output]

    @property
    def num_tokens(self) -> int:
        return len(self.params.prompt) + len(self.output)

    @property
    def speculating(self) -> bool:
        return self.params.method is not Method.NONE

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
        return self.remote if self.local_drafts else self.drafts

    def next_draft_position(self) -> int:
        return self.num_tokens + len(self.link_drafts)

    def drop_link_drafts(self) -> None:  # what the draft link sent (stream opened or broken)
        self.remote.clear() if self.local_drafts else self.clear_drafts()

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
        if self.local_drafts and self.params.auto_draft is not None:
            self.clear_drafts(remote=False)  # drafted afresh each round; the worker's chain
            self._advance_remote(new)  # goes on if it holds what was committed
        elif self.params.tree or self.params.method.in_verifier or self.local_drafts:
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
        scale = self.source_scale.get(source, 1.0)
        return [min(1.0, r * scale) for r in reach]

    def clear_drafts(self, remote: bool = True) -> None:
        if remote:  # (auto) the worker's chain too
            self.remote.clear()
        if self.draft_reach:
            self.last_reach = tuple(self.draft_reach)
        self.drafts, self.draft_parents = [], None
        self.draft_reach, self.tree_complete = [], False

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

    def keep_features(self, f: Features) -> None:
        """Record a round's hidden states (a recomputation after preemption overwrites)."""
        self.feature_size = f.hidden_size
        del self.features[f.start_position * 2 * f.hidden_size:]
        self.features += f.data

    def all_features(self) -> Features | None:
        if not self.features:
            return None
        return Features(0, self.feature_size, bytes(self.features))

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
