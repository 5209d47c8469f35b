"""The one proposer interface: every speculation method is a class behind it.

A proposer turns "this session's sequence so far" into draft tokens with the exact q each was
sampled from. Its host (the draft worker today; the verifier for co-located heads that need the
target's hidden states every step, such as Medusa or layer skip) owns session state (committed
tokens, outstanding drafts, epochs) and calls one proposer once per step with every session
that wants drafting, so a model proposer runs one batched forward per step.

Room for what comes next, without changing callers: `DraftRequest.features` carries target
hidden states for feature-based heads (EAGLE, Medusa, MTP); `DraftResult.parents` lets a
proposer return a token tree (parent index per token, -1 = the sequence's last token) where a
chain is the case parents = (-1, 0, 1, ...), written as None.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from tandem.sampling_params import SamplingParams
from tandem.spec.methods import Method
from tandem.spec.protocol import DraftToken, ErrorCode

if TYPE_CHECKING:  # torch stays out of the gateway's imports
    import torch

    from tandem.grammar.state import GrammarState

log = logging.getLogger(__name__)
# What never counts as one session's failure: the process being stopped or a task cancelled.
# Everything else does, a Rust extension's panic included (pyo3's PanicException, which
# llguidance raises, derives from BaseException, not Exception).
_NOT_A_SESSION_FAULT = (KeyboardInterrupt, SystemExit, GeneratorExit, asyncio.CancelledError)


def session_fault(exc: BaseException) -> bool:
    """Whether `exc`, raised while serving one session, may cost that session alone."""
    return not isinstance(exc, _NOT_A_SESSION_FAULT)


@dataclass(frozen=True)
class DraftRequest:
    """One session's drafting work for one step.

    token_ids is the sequence the drafts continue: committed tokens plus the session's
    outstanding drafts. Proposers that cache state per session (the draft model's KV) reuse the
    longest prefix they already hold and roll back the rest, so a rollback after an epoch bump
    needs no separate call.
    """

    # Whose cached state (KV blocks) this is: unique per session incarnation, across all
    # streams (a draft worker's counter: a reopened session_id gets a new one; the verifier's
    # own proposers use its session_id)
    session_key: Hashable
    token_ids: list[int]
    num_committed: int  # leading token_ids the verifier committed (final)
    max_tokens: int  # at most this many drafts now (the session's remaining run-ahead)
    sampling: SamplingParams = field(default_factory=lambda: SamplingParams(temperature=0.0))
    top_n: int = 8
    max_ngram_size: int = 3
    generator: torch.Generator | None = None  # the session's draft RNG (seeded requests)
    # [rows, hidden] the target's states at positions 0..rows-1, for heads: row t drafts
    # token t+2 with token t+1; the newest committed token has none yet (rows <=
    # num_committed - 1 from a verifier, fewer while a commit is in flight)
    features: torch.Tensor | None = None
    tenant: str = ""  # who asked (the gateway's API-key tenant); "" = anonymous
    tree: bool = False  # draft a token tree of at most max_tokens nodes (can_tree methods)
    # Structured output: [1, ceil(vocab / 32)] int32 bitmask of the tokens the session's
    # grammar allows next (tandem.grammar); proposers that can draft only those, with q masked
    # and renormalised. None = free text.
    mask: torch.Tensor | None = None
    # Structured output for trees (can_tree methods): the session's grammar, a copy of its own
    # past token_ids, whose `mask_after(path)` gives the tokens allowed under each node.
    grammar: GrammarState | None = None
    # token_ids[:prompt_len] is the prompt, the rest the output (what the penalties count)
    prompt_len: int = 0


@dataclass(frozen=True)
class DraftResult:
    """What a proposer made of one request: tokens (possibly none), or a per-session error."""

    tokens: list[DraftToken] = field(default_factory=list)
    error: ErrorCode | None = None
    message: str = ""
    parents: tuple[int, ...] | None = None  # a token tree; None = a chain
    # A tree's nodes (or a chain's tokens): the draft's estimate that verification reaches
    # each (path probability); () = no estimate.
    scores: tuple[float, ...] = ()


@runtime_checkable
class Proposer(Protocol):
    """One speculation method. Called from its host's single forward thread only."""

    method: Method

    def propose(self, requests: list[DraftRequest]) -> list[DraftResult]:
        """One result per request, in order; all requests are served by one batched step."""
        ...

    def release(self, session_key: Hashable) -> None:
        """Forget a session's cached state (KV blocks); unknown keys are ignored."""
        ...


@runtime_checkable
class Learner(Protocol):
    """A proposer that also learns from finished sessions (suffix decoding's cache)."""

    def learn(self, tenant: str, token_ids: list[int]) -> None:
        """A session ended with these committed tokens (prompt and output); tenant may scope
        what is learnt ("" = anonymous)."""
        ...


def propose_isolated(proposer: Proposer, requests: list[DraftRequest]) -> list[DraftResult]:
    """proposer.propose(), but a failure costs only the sessions that cause it.

    On an exception (or a Rust panic) the batch is retried one request at a time (a model
    proposer forgets the failed batch's cache state, so retries start clean); requests that
    fail alone get INTERNAL.
    """
    def checked(reqs: list[DraftRequest]) -> list[DraftResult]:
        results = proposer.propose(reqs)
        if len(results) != len(reqs):
            raise RuntimeError(f"proposer returned {len(results)} results for {len(reqs)}")
        return results

    try:
        return checked(requests)
    except BaseException as exc:
        if not session_fault(exc):
            raise
        log.exception("%s step over %d sessions failed; retrying one by one",
                      proposer.method.name, len(requests))
    results = []
    for req in requests:
        try:
            results.extend(checked([req]))
        except BaseException as exc:
            if not session_fault(exc):
                raise
            log.exception("%s proposer failed for session key %s", proposer.method.name,
                          req.session_key)
            results.append(DraftResult(error=ErrorCode.INTERNAL,
                                       message=f"{type(exc).__name__}: {exc}"))
    return results
