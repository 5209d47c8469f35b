"""One drafting step's work on the forward thread: each session's grammar mask, then one
propose call per method over all its sessions (draft_service/worker.py runs it)."""
from __future__ import annotations

import logging
from collections.abc import Mapping

from draft_service.session import GrammarView, Session
from tandem.spec import DraftRequest, DraftResult, ErrorCode, Method, Proposer, propose_isolated
from tandem.spec.proposer import session_fault

log = logging.getLogger(__name__)

# One step's work per method: (session, its generation when asked, the request, and its
# grammar to mask the request with on the forward thread).
Jobs = dict[Method, list[tuple[Session, int, DraftRequest, GrammarView | None]]]


def fault(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def run_step(proposers: Mapping[Method, Proposer], jobs: Jobs
             ) -> dict[Method, list[DraftResult]]:
    """Forward thread: one result per job, in order. A session whose mask fails (the
    matcher's error, a Rust panic) gets an INTERNAL result alone, as one whose proposal fails
    does (propose_isolated)."""
    out: dict[Method, list[DraftResult]] = {}
    for method, batch in jobs.items():
        results: list[DraftResult | None] = [None] * len(batch)
        masked: list[tuple[int, DraftRequest]] = []
        for i, (s, _, req, view) in enumerate(batch):
            try:
                masked.append((i, req if view is None else view.apply(req)))
            except BaseException as exc:
                if not session_fault(exc):
                    raise
                log.exception("masking a draft for session %r failed", s.session_id)
                results[i] = DraftResult(error=ErrorCode.INTERNAL, message=fault(exc))
        if masked:
            proposed = propose_isolated(proposers[method], [r for _, r in masked])
            for (i, _), res in zip(masked, proposed):
                results[i] = res
        out[method] = results
    return out
