"""The proposer interface and the plain dataclasses the draft worker speaks (no gRPC here).

Two kinds of dataclass live here: what a proposer consumes and produces (DraftRequest,
DraftResult, DraftToken), and the worker's transport-agnostic messages (Open / Commit / Close /
Invalid in, Proposal / SessionError out) that the gRPC servicer maps to and from protobuf.

A proposer turns "this session's sequence so far" into draft tokens with the exact q each was
sampled from. The worker owns session state (committed tokens, outstanding drafts, epochs) and
calls one proposer once per step with every session that wants drafting, so a model proposer
runs one batched forward per step whatever the number of sessions and streams.

Enum values equal the wire contract's (tandem.v1.SpeculationMethod / DraftErrorCode) so the
gRPC layer converts with int(); tests/unit/test_draft_worker.py checks they stay equal.
"""
from __future__ import annotations

import enum
import logging
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from tandem.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class Method(enum.IntEnum):
    """Speculation methods (values of tandem.v1.SpeculationMethod)."""

    UNSPECIFIED = 0
    NONE = 1
    DRAFT_MODEL = 2
    NGRAM = 3


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
class DraftRequest:
    """One session's drafting work for one step.

    token_ids is the sequence the drafts continue: committed tokens plus the session's
    outstanding drafts. Proposers that cache state per session (the draft model's KV) reuse the
    longest prefix they already hold and roll back the rest, so a rollback after an epoch bump
    needs no separate call.
    """

    key: Hashable  # unique per session incarnation, across all streams
    token_ids: list[int]
    num_committed: int  # leading token_ids the verifier committed (final)
    max_tokens: int  # at most this many drafts now (the session's remaining run-ahead)
    sampling: SamplingParams = field(default_factory=lambda: SamplingParams(temperature=0.0))
    top_n: int = 8
    max_ngram_size: int = 3
    generator: torch.Generator | None = None  # the session's draft RNG (seeded requests)


@dataclass(frozen=True)
class DraftResult:
    """What a proposer made of one request: tokens (possibly none), or a per-session error."""

    tokens: list[DraftToken] = field(default_factory=list)
    error: ErrorCode | None = None
    message: str = ""


@runtime_checkable
class Proposer(Protocol):
    """One speculation method. Called from the worker's single forward thread only."""

    method: Method

    def propose(self, requests: list[DraftRequest]) -> list[DraftResult]:
        """One result per request, in order; all requests are served by one batched step."""
        ...

    def release(self, key: Hashable) -> None:
        """Forget a session's cached state (KV blocks); unknown keys are ignored."""
        ...



def propose_isolated(proposer: Proposer, requests: list[DraftRequest]) -> list[DraftResult]:
    """proposer.propose(), but a failure costs only the sessions that cause it.

    On an exception the batch is retried one request at a time (a model proposer forgets the
    failed batch's cache state, so retries start clean); requests that fail alone get INTERNAL.
    """
    def checked(reqs: list[DraftRequest]) -> list[DraftResult]:
        results = proposer.propose(reqs)
        if len(results) != len(reqs):
            raise RuntimeError(f"proposer returned {len(results)} results for {len(reqs)}")
        return results

    try:
        return checked(requests)
    except Exception:
        log.exception("%s step over %d sessions failed; retrying one by one",
                      proposer.method.name, len(requests))
    results = []
    for req in requests:
        try:
            results.extend(checked([req]))
        except Exception as exc:
            log.exception("%s proposer failed for session key %s", proposer.method.name, req.key)
            results.append(DraftResult(error=ErrorCode.INTERNAL,
                                       message=f"{type(exc).__name__}: {exc}"))
    return results

# --- what flows through the worker (the gRPC layer maps these to and from protobuf) ---------


@dataclass(frozen=True)
class Open:
    """Start (or fully resynchronise) a session; zero limits mean the worker's default."""

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


@dataclass(frozen=True)
class Commit:
    """After this the committed sequence is committed[:start_position] + token_ids."""

    session_id: str
    epoch: int
    start_position: int
    token_ids: list[int]
    max_run_ahead: int = 0


@dataclass(frozen=True)
class Close:
    session_id: str


@dataclass(frozen=True)
class Invalid:
    """A control message the transport could not make sense of (e.g. no control set)."""

    session_id: str
    message: str


@dataclass(frozen=True)
class Proposal:
    session_id: str
    epoch: int
    position: int
    token: DraftToken


@dataclass(frozen=True)
class SessionError:
    session_id: str
    code: ErrorCode
    message: str


@dataclass(frozen=True)
class WorkerStats:
    sessions_open: int
    queue_depth: int  # sessions waiting to be drafted
    tokens_drafted: int
    steps: int


@dataclass(frozen=True)
class Limits:
    """What a worker allows; per-session values of 0 on the wire fall back to the defaults."""

    vocab_size: int
    max_context_length: int
    max_sessions: int = 256
    max_run_ahead: int = 8  # default per session
    max_run_ahead_cap: int = 16  # = WorkerInfo.max_speculative_tokens
    top_n: int = 8
    max_top_n: int = 64
    max_ngram_size: int = 3

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Limits.{name} must be an int >= 1, got {value!r}")
        if self.max_run_ahead > self.max_run_ahead_cap or self.top_n > self.max_top_n:
            raise ValueError("Limits: a default exceeds its cap (max_run_ahead_cap, max_top_n)")
