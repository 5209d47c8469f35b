"""What an Open or a Commit does to a draft worker's session: the checks a verifier's message
must pass, and the session state it leaves behind.

A failed check raises SessionFailure; the worker (worker.py) answers it in-band and drops the
session. The worker also keeps the registry of sessions and wakes its drafting loop: nothing
here touches either.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping

from draft_service.limits import Limits
from draft_service.session import FeatureStore, Session, SessionFailure, Stream
from tandem.sampling_params import SamplingParams
from tandem.spec import Commit, ErrorCode, Method, Open, Proposer

# Longer suffixes almost never match again and each length tried costs a scan of the context.
_MAX_NGRAM_SIZE = 64
_MAX_TENANT_LEN = 128  # a tenant names a cache: bound what a peer can make us hold


def check_tokens(token_ids: list[int], vocab_size: int, *, allow_empty: bool) -> list[int]:
    tokens = list(token_ids)
    if not tokens and not allow_empty:
        raise SessionFailure(ErrorCode.INVALID_ARGUMENT, "token_ids must not be empty")
    bad = [t for t in tokens if not 0 <= t < vocab_size]
    if bad:
        raise SessionFailure(ErrorCode.INVALID_ARGUMENT,
                             f"token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
    return tokens


def _method_for(cmd: Open, proposers: Mapping[Method, Proposer],
                default_method: Method) -> Method:
    try:
        method = Method(cmd.method) or default_method  # UNSPECIFIED (0) is falsy
    except ValueError:  # a method newer than this worker
        method = None
    if method not in proposers:  # includes values newer than this enum
        raise SessionFailure(ErrorCode.UNSUPPORTED_METHOD, f"method {cmd.method} is not "
                             f"served here (have {[m.name for m in proposers]})")
    if cmd.tree and not method.can_tree:
        raise SessionFailure(ErrorCode.INVALID_ARGUMENT,
                             f"method {method.api_name} drafts chains, not trees")
    return method


def open_session(stream: Stream, cmd: Open, limits: Limits, proposers: Mapping[Method, Proposer],
                 default_method: Method, *, open_sessions: int,
                 session_keys: Iterator[int]) -> Session:
    """The session an Open asks for (not yet registered); its session_key (one per session
    incarnation, unlike its session_id, which a reopen reuses) is drawn from `session_keys`
    only once every check has passed. `open_sessions`: how many the worker holds now."""
    if len(cmd.token_ids) > limits.max_context_length:  # before scanning them
        raise SessionFailure(ErrorCode.RESOURCE_EXHAUSTED, f"sequence of "
                             f"{len(cmd.token_ids)} tokens exceeds the context length "
                             f"{limits.max_context_length}")
    tokens = check_tokens(cmd.token_ids, limits.vocab_size, allow_empty=False)
    try:
        sampling = SamplingParams(cmd.temperature, cmd.top_k, cmd.top_p, cmd.seed,
                                  **dict(cmd.controls))
    except ValueError as exc:
        raise SessionFailure(ErrorCode.INVALID_ARGUMENT, str(exc)) from None
    if any(not 0 <= t < limits.vocab_size for t in sampling.token_ids()):
        raise SessionFailure(ErrorCode.INVALID_ARGUMENT, "a sampling control names a token "
                             f"id outside the vocabulary [0, {limits.vocab_size})")
    method = _method_for(cmd, proposers, default_method)
    if open_sessions >= limits.max_sessions:
        raise SessionFailure(ErrorCode.RESOURCE_EXHAUSTED,
                             f"worker is full ({limits.max_sessions} sessions)")
    session = Session(
        session_key=next(session_keys), session_id=cmd.session_id, stream=stream, method=method,
        committed=tokens, epoch=cmd.epoch, sampling=sampling,
        max_run_ahead=min(cmd.max_run_ahead or limits.max_run_ahead, limits.max_spec_tokens),
        top_n=min(cmd.top_n or limits.top_n, limits.max_top_n),
        max_ngram_size=min(cmd.max_ngram_size or limits.max_ngram_size, _MAX_NGRAM_SIZE),
        seed=cmd.seed, tenant=cmd.tenant[:_MAX_TENANT_LEN], tree=cmd.tree,
        prompt_len=min(cmd.grammar_start, len(tokens)))
    if method.needs_features:
        session.features = FeatureStore(proposers[method].feature_size, limits.max_context_length)
        if cmd.features is not None:
            session.features.put(cmd.features)
    return session


def _new_tokens(session: Session, cmd: Commit, limits: Limits) -> list[int]:
    """The commit's tokens past the session's committed ones, once the re-sent ones match."""
    if cmd.start_position + len(cmd.token_ids) > limits.max_context_length:
        raise SessionFailure(ErrorCode.RESOURCE_EXHAUSTED, "commit reaches position "
                             f"{cmd.start_position + len(cmd.token_ids)}, beyond the context")
    tokens = check_tokens(cmd.token_ids, limits.vocab_size, allow_empty=True)
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
    return tokens[len(resent):]


def apply_commit(session: Session, cmd: Commit, limits: Limits) -> None:
    """Settle a Commit: under the same epoch the accepted drafts leave `drafts`; a new epoch
    voids every outstanding draft."""
    new = _new_tokens(session, cmd, limits)
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
    session.committed.extend(new)
    if cmd.features is not None and session.features is not None:
        session.features.put(cmd.features)
        session.stalled = False  # a head drafts anew from fresh features
    if cmd.max_run_ahead is not None:  # 0 pauses drafting until a commit raises it
        session.max_run_ahead = min(cmd.max_run_ahead, limits.max_spec_tokens)
    if len(session.committed) > limits.max_context_length:
        raise SessionFailure(ErrorCode.RESOURCE_EXHAUSTED, f"sequence of "
                             f"{len(session.committed)} tokens exceeds the context length")
