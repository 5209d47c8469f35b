"""Hostile input on the gRPC surface: every handler answers with a 4xx-like status (or an
in-band draft error) that says what was wrong, and the process keeps serving.

Real servers over one tiny random Llama on the target's tokenizer: a draft worker, a verifier,
and a verifier linked to a hostile draft worker. They live on an event loop in a background
thread; hypothesis drives them through plain (sync) channels with fuzzed messages and raw
mutated bytes (generic calls, no serializer), so undecodable messages are covered too.
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import grpc
import numpy as np
import pytest
from google.protobuf.message import DecodeError
from grpc_servers import (
    CONTEXT,
    HIDDEN,
    VOCAB,
    Servers,
    generate,
    healthy,
    save_tiny_llama,
    speculate,
)
from grpc_strategies import CONTROLS, DRAFT_METHODS, PROPOSALS, UINT32, generate_requests, mutate
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from draft_service.session import FeatureStore, SessionFailure
from tandem.grpc_limits import (
    DEFAULT_MAX_MESSAGE_BYTES,
    MAX_SESSION_ID_CHARS,
    MAX_STOP_TOKEN_IDS,
    max_message_bytes,
)
from tandem.sampling_params import SamplingParams
from tandem.spec import DraftToken, ErrorCode, Features, Method, Proposal
from tandem.v1 import common_pb2, draft_pb2, verify_pb2
from verify_service.drafts.side import DraftSide
from verify_service.session.params import GenerateParams
from verify_service.session.sequence import Sequence

pytestmark = pytest.mark.contract

FUZZ = settings(max_examples=100, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))
BAD_DRAFT_CODES = {draft_pb2.DRAFT_ERROR_CODE_UNSPECIFIED, draft_pb2.DRAFT_ERROR_CODE_INTERNAL}


@pytest.fixture(scope="module")
def servers(tmp_path_factory, target_paths):
    s = Servers(save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), target_paths.root))
    yield s
    s.close()


def refusal(req: verify_pb2.GenerateRequest) -> str | None:
    """Why the verifier must refuse req (None: it must serve it): the contract, restated."""
    s, stop, spec = req.sampling, req.stopping, req.speculation
    prompt, committed, max_new = req.prompt_token_ids, req.committed_token_ids, stop.max_new_tokens
    t, typical = spec.typical_acceptance, spec.HasField("typical_acceptance")
    checks = [
        (not req.session_id or len(req.session_id) > MAX_SESSION_ID_CHARS, "session_id"),
        (not prompt, "empty prompt"), (len(stop.stop_token_ids) > MAX_STOP_TOKEN_IDS, "stops"),
        (any(not 0 <= i < VOCAB for i in [*prompt, *committed, *stop.stop_token_ids]), "vocab"),
        (not (math.isfinite(s.temperature) and 0 <= s.temperature <= 1e4), "temperature"),
        (not 0 <= s.top_p <= 1, "top_p"), (s.HasField("seed") and s.seed >= 2**63, "seed"),
        (max_new < 1 or len(committed) >= max_new, "max_new_tokens"),
        (len(prompt) + max_new > CONTEXT, "context"),
        (spec.method not in common_pb2.SpeculationMethod.values(), "method"),
        (spec.num_speculative_tokens > 16, "num_speculative_tokens"),
        (typical and not (0 < t.posterior_threshold <= 1 and 0 <= t.posterior_alpha <= 1),
         "typical"),
        (typical and spec.method != common_pb2.SPECULATION_METHOD_MEDUSA, "typical method"),
        (spec.auto_draft_method and not (
            spec.method == common_pb2.SPECULATION_METHOD_AUTO and spec.auto_draft_method in (
                common_pb2.SPECULATION_METHOD_DRAFT_MODEL, common_pb2.SPECULATION_METHOD_EAGLE)),
         "auto_draft_method"),
    ]
    return next((why for bad, why in checks if bad), None)


def check_generate(servers: Servers, raw: bytes, req: verify_pb2.GenerateRequest | None):
    code, details, out = generate(servers.verifier_channel, raw)
    why = "undecodable" if req is None else refusal(req)
    if why is None:
        assert code == grpc.StatusCode.OK, (details, req)
        assert out and out[-1].finish_reason != verify_pb2.FINISH_REASON_UNSPECIFIED
        tokens = [t for r in out for t in r.token_ids]
        assert len(tokens) <= req.stopping.max_new_tokens - len(req.committed_token_ids)
        assert all(0 <= t < VOCAB for t in tokens)
    else:
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (why, code, details)
        assert details
    assert healthy(servers.verifier_channel)


# ---- the verifier ------------------------------------------------------------------------

@FUZZ
@given(req=generate_requests())
def test_generate_refuses_what_the_contract_refuses_and_serves_the_rest(servers, req):
    event(f"refused: {refusal(req)}")
    check_generate(servers, req.SerializeToString(), req)


@FUZZ
@given(req=generate_requests(), how=st.integers(0, 3), at=st.integers(0, 2**16),
       junk=st.binary(min_size=1, max_size=16))
def test_generate_survives_mutated_bytes(servers, req, how, at, junk):
    raw = mutate(req.SerializeToString(), how, at, junk)
    try:
        decoded = verify_pb2.GenerateRequest.FromString(raw)
    except DecodeError:
        decoded = None
    check_generate(servers, raw, decoded)


def _request(**fields) -> verify_pb2.GenerateRequest:
    base = dict(session_id="ok", prompt_token_ids=[1, 2],
                stopping=verify_pb2.StoppingCriteria(max_new_tokens=2))
    return verify_pb2.GenerateRequest(**{**base, **fields})


def test_invalid_utf8_and_oversize_generate_requests(servers):
    ok = _request()
    too_many_stops = verify_pb2.StoppingCriteria(
        max_new_tokens=2, stop_token_ids=[1] * (MAX_STOP_TOKEN_IDS + 1))
    for req, words in [(_request(session_id="s" * (MAX_SESSION_ID_CHARS + 1)), "session_id"),
                       (_request(prompt_token_ids=[1] * 100_000), "exceeds the context"),
                       (_request(committed_token_ids=[1] * 100_000), "committed_token_ids"),
                       (_request(stopping=too_many_stops), "stop_token_ids")]:
        code, details, _ = generate(servers.verifier_channel, req.SerializeToString())
        assert code == grpc.StatusCode.INVALID_ARGUMENT and words in details, details
    bad_utf8 = b"\x0a\x02\xff\xfe" + ok.SerializeToString()[4:]  # session_id = 0xff 0xfe
    code, details, _ = generate(servers.verifier_channel, bad_utf8)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "UTF-8" in details
    # Within the explicit limit (above gRPC's 4 MiB default) a request is read and judged...
    big = _request(session_id="x" * (6 << 20))
    code, details, _ = generate(servers.verifier_channel, big.SerializeToString())
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "session_id" in details
    # ...beyond it the transport refuses it unread.
    huge = b"x" * (DEFAULT_MAX_MESSAGE_BYTES + 8)
    code, details, _ = generate(servers.verifier_channel, huge)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and details
    check_generate(servers, ok.SerializeToString(), ok)


# ---- the draft worker --------------------------------------------------------------------

def check_speculate(servers: Servers, raws: list[bytes]) -> list[draft_pb2.DraftProposal]:
    code, details, replies = speculate(servers.draft_channel, raws)
    assert code == grpc.StatusCode.OK, details  # per-session trouble never ends the stream
    for r in replies:
        if r.HasField("error"):
            assert r.error.code not in BAD_DRAFT_CODES and r.error.message, r
            assert len(r.session_id) <= MAX_SESSION_ID_CHARS
    assert servers.draft_idle() and healthy(servers.draft_channel)
    return replies


@FUZZ
@given(controls=st.lists(CONTROLS, min_size=1, max_size=6))
def test_speculate_reports_bad_controls_in_band(servers, controls):
    check_speculate(servers, [c.SerializeToString() for c in controls])


@FUZZ
@given(controls=st.lists(st.tuples(CONTROLS, st.integers(0, 3), st.integers(0, 2**16),
                                   st.binary(min_size=1, max_size=16)), min_size=1, max_size=4))
def test_speculate_survives_mutated_bytes(servers, controls):
    raws = [mutate(c.SerializeToString(), *m) for c, *m in controls]
    replies = check_speculate(servers, raws)
    undecodable = 0
    for raw in raws:
        try:
            draft_pb2.DraftControl.FromString(raw)
        except DecodeError:
            undecodable += 1
    parse_errors = [r for r in replies if "parse" in r.error.message]
    assert len(parse_errors) == undecodable


def test_speculate_keeps_serving_after_bad_and_oversize_messages(servers):
    good = draft_pb2.DraftControl(open=draft_pb2.OpenSession(
        session_id="g", token_ids=[5, 6, 7], method=DRAFT_METHODS[0], max_run_ahead=2))
    long_id = draft_pb2.DraftControl(open=draft_pb2.OpenSession(
        session_id="s" * (MAX_SESSION_ID_CHARS + 1), token_ids=[1]))
    eagle = draft_pb2.DraftControl(open=draft_pb2.OpenSession(
        session_id="e", token_ids=[1, 2], method=common_pb2.SPECULATION_METHOD_EAGLE))
    too_many_rows = draft_pb2.TargetFeatures(hidden_size=HIDDEN,
                                             data=bytes(2 * HIDDEN * (CONTEXT + 1)))
    overflow = draft_pb2.DraftControl(commit=draft_pb2.CommitTokens(
        session_id="e", start_position=2, features=too_many_rows))
    bad_utf8 = b"\x0a\x03\x0a\x01\xff"  # open { session_id: 0xff }
    replies = check_speculate(servers, [bad_utf8] + [m.SerializeToString() for m in (
        long_id, eagle, overflow, good)])
    errors = [(r.session_id, r.error.code, r.error.message) for r in replies
              if r.HasField("error")]
    invalid, full = (draft_pb2.DRAFT_ERROR_CODE_INVALID_ARGUMENT,
                     draft_pb2.DRAFT_ERROR_CODE_RESOURCE_EXHAUSTED)
    assert [e[:2] for e in errors] == [("", invalid), ("", invalid), ("e", full)]
    assert "UTF-8" in errors[0][2] and "session_id" in errors[1][2] and "context" in errors[2][2]
    huge = b"x" * (servers.draft_limit + 8)
    code, details, _ = speculate(servers.draft_channel, [huge])
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and details
    assert servers.draft_idle() and healthy(servers.draft_channel)


# ---- a hostile draft worker --------------------------------------------------------------

@FUZZ
@given(script=PROPOSALS, mode=st.sampled_from(["greedy", "seeded", "sampled"]),
       method=st.sampled_from(DRAFT_METHODS))
def test_verifier_survives_a_hostile_draft_worker(servers, script, mode, method):
    """Whatever a draft worker streams, the session ends normally; greedy and seeded text is
    the target's own (lossless)."""
    servers.hostile.script = script
    tokens, reference = servers.linked_generate(mode, method)
    assert len(tokens) == 6 and all(0 <= t < VOCAB for t in tokens)
    if mode != "sampled":
        assert tokens == reference
    assert healthy(servers.linked_channel)


def test_verifier_refuses_a_q_too_long_or_with_duplicate_ids():
    """Checked before any scan of the q (a peer could send millions of entries); a dense q
    would keep one entry of each duplicated id."""
    params = GenerateParams("s", (1, 2), (), SamplingParams(1.0), 4, frozenset(),
                            Method.DRAFT_MODEL)
    seq = Sequence(params)
    side = DraftSide({"s": seq}, VOCAB, top_n=4, max_run_ahead=4)
    link = SimpleNamespace(address="x", sent=[])
    link.send = link.sent.append
    for ids, probs in (((5, 5), (0.5, 0.5)), (tuple(range(5, 10)), (0.2,) * 5),
                       ((5, 6), (0.5, 0.5))):
        side.links["s"] = link
        epoch = seq.epoch
        side.on_reply(link, Proposal("s", epoch, 2, DraftToken(5, ids, probs)))
    assert [d.q_ids for d in seq.drafts] == [(5, 6)]  # only the well-formed one
    assert seq.epoch == epoch == 2 and [type(c).__name__ for c in link.sent] == ["Close"] * 2


# ---- limits and features -----------------------------------------------------------------

def test_message_limit_fits_the_largest_legitimate_message():
    eagle_reopen = 8192 * (5 + 2 * 576)  # the default target's context and hidden size
    assert max_message_bytes(8192, 576) >= 2 * eagle_reopen
    assert max_message_bytes(8192) == DEFAULT_MAX_MESSAGE_BYTES  # ids only: the floor
    assert max_message_bytes(1 << 20, 16384) == 2**31 - 1  # never past gRPC's own ceiling


@FUZZ
@given(msgs=st.lists(st.tuples(UINT32, st.one_of(st.just(HIDDEN), UINT32),
                               st.integers(0, 300), st.sampled_from([0.5, np.nan])),
                     min_size=1, max_size=4))
def test_feature_store_refuses_bad_rows_with_a_reason(msgs):
    store = FeatureStore(HIDDEN, max_rows=CONTEXT)
    for start, hidden, rows, value in msgs:
        data = np.full(rows * HIDDEN, value, "<f2").tobytes()
        try:
            store.put(Features(start, hidden, data))
        except SessionFailure as exc:
            assert exc.code in (ErrorCode.INVALID_ARGUMENT, ErrorCode.OUT_OF_SYNC,
                                ErrorCode.RESOURCE_EXHAUSTED) and str(exc)
        assert store.rows <= CONTEXT and store.view().shape == (store.rows, HIDDEN)
