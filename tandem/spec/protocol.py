"""The draft link as plain dataclasses: what a verifier and a draft worker say to each other.

`DraftService.Speculate` carries these as protobuf; only its two ends convert (the verifier's
draft-link client, verify_service/drafts/link.py, and the draft servicer,
draft_service/server.py). Everything between sees these types, never a `_pb2` one.

Control (verifier -> draft): Open, Commit, Close (and Invalid for a message the transport
could not parse). Replies (draft -> verifier): Proposal, one draft token as soon as it
exists, with the exact q it was sampled from; or SessionError for one session.
Enum values equal the wire's (tandem.v1.DraftErrorCode), so the edges convert with int().
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

from tandem.grammar.spec import GrammarSpec
from tandem.spec.methods import Method


class ErrorCode(enum.IntEnum):
    """Per-session problems (values of tandem.v1.DraftErrorCode)."""

    UNKNOWN_SESSION = 1
    INVALID_ARGUMENT = 2
    OUT_OF_SYNC = 3
    RESOURCE_EXHAUSTED = 4
    UNSUPPORTED_METHOD = 5
    INTERNAL = 6


@dataclass(frozen=True)
class DraftToken:
    """One draft token and the exact distribution q it was sampled from.

    Empty q_ids/q_probs mean q is one-hot on token_id (greedy drafting, n-gram lookup).
    """

    token_id: int
    q_ids: tuple[int, ...] = ()
    q_probs: tuple[float, ...] = ()


@dataclass(frozen=True)
class Features:
    """The target's final normed hidden states for positions start_position.. (EAGLE's
    features): float16 little-endian bytes, row-major [rows, hidden_size]."""

    start_position: int
    hidden_size: int
    data: bytes

    @property
    def rows(self) -> int:
        return len(self.data) // (2 * self.hidden_size) if self.hidden_size else 0

    def problem(self) -> str | None:
        """What is wrong with this message, if anything (checked by the receiver)."""
        if self.hidden_size < 1:
            return "features.hidden_size must be >= 1"
        if len(self.data) % (2 * self.hidden_size):
            return (f"features.data has {len(self.data)} bytes, not a multiple of "
                    f"2 * hidden_size = {2 * self.hidden_size}")
        return None


@dataclass(frozen=True)
class Open:
    """Start (or fully resynchronise) a session; zero limits mean the worker's default.

    Sampling stays as raw fields so the draft worker reports a bad value in-band, for this
    session only, rather than failing the conversion of the whole stream's message.
    """

    session_id: str
    token_ids: list[int]
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    method: int = Method.UNSPECIFIED  # a Method value; unknown ones are UNSUPPORTED_METHOD
    max_run_ahead: int = 0
    top_n: int = 0
    epoch: int = 0
    max_ngram_size: int = 0
    trace_context: tuple[tuple[str, str], ...] = ()  # W3C headers for the draft's span
    features: Features | None = None  # EAGLE: target features computed so far
    tenant: str = ""  # who asked; methods with shared state may keep it per tenant
    tree: bool = False  # draft one token tree per epoch instead of a chain
    grammar: GrammarSpec | None = None  # structured output: drafts it allows (draft_model)
    grammar_start: int = 0  # where the grammar's text starts in token_ids (the prompt's end)
    # The session's sampling controls (SamplingParams.control_fields' keyword arguments,
    # unchecked): a draft model applies them to its own q. () = none.
    controls: tuple[tuple[str, object], ...] = ()


@dataclass(frozen=True)
class Commit:
    """After this the committed sequence is committed[:start_position] + token_ids."""

    session_id: str
    epoch: int
    start_position: int
    token_ids: list[int]
    max_run_ahead: int | None = None  # None: unchanged; 0: pause drafting
    features: Features | None = None  # EAGLE: features of the positions made final


@dataclass(frozen=True)
class Close:
    session_id: str


@dataclass(frozen=True)
class Invalid:
    """A control message the transport could not make sense of (e.g. no control set)."""

    session_id: str
    message: str


Control = Open | Commit | Close | Invalid


@dataclass(frozen=True)
class TreeNode:
    """Where a proposal sits in its session's token tree (tandem.v1.TreeNode)."""

    parent: int  # an earlier node of the tree, or -1: a child of the last committed token
    path_prob: float = 0.0  # the draft's estimate that verification reaches it; 0 = unknown
    last: bool = False  # the tree's last node: it is complete


@dataclass(frozen=True)
class Proposal:
    """Draft token `token` for absolute `position` of `session_id`, drafted under `epoch`;
    with `tree`, a node of the epoch's token tree (position = its depth position)."""

    session_id: str
    epoch: int
    position: int
    token: DraftToken
    tree: TreeNode | None = None


@dataclass(frozen=True)
class SessionError:
    """The draft worker gave up on one session; the verifier decodes it plainly."""

    session_id: str
    code: ErrorCode
    message: str
    # The epoch the failure belongs to: the failing control message's, or the session's. A
    # verifier that has moved on (detached and re-attached since) ignores it as stale.
    epoch: int = 0


Reply = Proposal | SessionError
