"""Hypothesis strategies for tests/contract/test_grpc_fuzz.py: protobuf messages that are
valid but for a field or two (so each hostile value is judged on its own), huge repeated fields
built cheaply, any floats, ints and enum values, byte mutations, and hostile draft replies."""
from __future__ import annotations

import numpy as np
from grpc_servers import HIDDEN, VOCAB
from hypothesis import strategies as st

from tandem.v1 import common_pb2, draft_pb2, verify_pb2

DRAFT_METHODS = (common_pb2.SPECULATION_METHOD_DRAFT_MODEL, common_pb2.SPECULATION_METHOD_NGRAM,
                 common_pb2.SPECULATION_METHOD_EAGLE)


def _repeat(n: int, t: int) -> list[int]:
    return [t] * n


INT32 = st.one_of(st.integers(0, 300), st.integers(VOCAB - 2, VOCAB + 2),
                  st.integers(-2**31, 2**31 - 1))
UINT32 = st.one_of(st.integers(0, 12), st.integers(0, 2**32 - 1))
UINT64 = st.one_of(st.integers(0, 12), st.integers(0, 2**64 - 1))
FLOAT = st.one_of(st.sampled_from([0.0, 0.5, 1.0, -1.0, 1e4, 2e4]),
                  st.floats(width=32, allow_nan=True, allow_infinity=True))
# Short lists, and huge ones (built cheaply: one id repeated up to 200k times).
IDS = st.one_of(st.lists(INT32, max_size=8), st.lists(st.integers(0, 400), max_size=40),
                st.builds(_repeat, st.integers(0, 200_000), INT32))
TEXT = st.one_of(st.sampled_from(["", "a", "b", "a"]), st.text(max_size=12),
                 st.builds(lambda n: "s" * n, st.integers(0, 100_000)))
METHOD = st.one_of(st.sampled_from(DRAFT_METHODS), st.integers(-3, 12),
                   st.integers(-2**31, 2**31 - 1))


def field(draw, bad: set[str], name: str, good, hostile):
    """The hostile value for the fields this example corrupts, a valid one for the rest."""
    return draw(hostile if name in bad else good)


GOOD_IDS = st.lists(st.integers(0, 400), min_size=1, max_size=12)
SMALL = st.integers(0, 6)


def sampling(draw, bad: set[str]) -> common_pb2.SamplingParams:
    s = common_pb2.SamplingParams(
        temperature=field(draw, bad, "temperature", st.sampled_from([0.0, 0.7, 1.0]), FLOAT),
        top_k=field(draw, bad, "top_k", st.sampled_from([0, 5]), UINT32),
        top_p=field(draw, bad, "top_p", st.sampled_from([0.0, 0.9, 1.0]), FLOAT))
    if draw(st.booleans()):
        s.seed = field(draw, bad, "seed", st.integers(0, 2**63 - 1), UINT64)
    return s


GENERATE_FIELDS = ("session_id", "prompt", "committed", "temperature", "top_k", "top_p", "seed",
                   "max_new", "stops", "method", "k", "address", "tenant", "typical",
                   "top_logprobs")


@st.composite
def generate_requests(draw):
    bad = draw(st.sets(st.sampled_from(GENERATE_FIELDS), min_size=1, max_size=2))
    f = lambda name, good, hostile: field(draw, bad, name, good, hostile)  # noqa: E731
    spec = verify_pb2.SpeculationConfig(
        method=f("method", st.sampled_from([0, 1, *DRAFT_METHODS]), METHOD),
        num_speculative_tokens=f("k", SMALL, UINT32), draft_address=f("address", TEXT, TEXT),
        tenant=f("tenant", TEXT, TEXT))
    if "typical" in bad:
        spec.typical_acceptance.posterior_threshold = draw(FLOAT)
        spec.typical_acceptance.posterior_alpha = draw(FLOAT)
    return verify_pb2.GenerateRequest(
        session_id=f("session_id", st.uuids().map(str), TEXT),
        prompt_token_ids=f("prompt", GOOD_IDS, IDS),
        committed_token_ids=f("committed", st.lists(st.integers(0, 400), max_size=2), IDS),
        sampling=sampling(draw, bad), speculation=spec,
        stopping=verify_pb2.StoppingCriteria(
            max_new_tokens=f("max_new", st.integers(3, 5), UINT32),
            stop_token_ids=f("stops", st.lists(st.integers(0, 400), max_size=3), IDS),
            ignore_eos=draw(st.booleans())),
        logprobs=draw(st.booleans()), top_logprobs=f("top_logprobs", st.integers(0, 3), UINT32))


def mutate(raw: bytes, how: int, at: int, junk: bytes) -> bytes:
    at = at % (len(raw) + 1)
    return [raw[:at] + junk + raw[at:],  # insert
            raw[:at] + junk + raw[at + len(junk):],  # overwrite
            raw[:at],  # truncate
            junk][how]



FEATURES = st.builds(
    draft_pb2.TargetFeatures, start_position=UINT32,
    hidden_size=st.one_of(st.just(HIDDEN), UINT32),
    data=st.one_of(st.binary(max_size=200), st.builds(
        lambda rows, v: np.full(rows * HIDDEN, v, "<f2").tobytes(), st.integers(0, 400),
        st.sampled_from([0.5, -1.0, np.nan, np.inf, 65504.0]))))


SESSION_IDS = st.one_of(st.sampled_from(["a", "b", "a", ""]), TEXT)
OPEN_FIELDS = ("session_id", "tokens", "temperature", "top_k", "top_p", "seed", "method",
               "run_ahead", "top_n", "epoch", "ngram", "tenant", "trace", "features")


@st.composite
def open_sessions(draw):
    bad = draw(st.sets(st.sampled_from(OPEN_FIELDS), min_size=1, max_size=2))
    f = lambda name, good, hostile: field(draw, bad, name, good, hostile)  # noqa: E731
    o = draft_pb2.OpenSession(
        session_id=f("session_id", st.sampled_from(["a", "b"]), SESSION_IDS),
        token_ids=f("tokens", GOOD_IDS, IDS), sampling=sampling(draw, bad),
        method=f("method", st.sampled_from(DRAFT_METHODS), METHOD),
        max_run_ahead=f("run_ahead", SMALL, UINT32), top_n=f("top_n", SMALL, UINT32),
        epoch=f("epoch", SMALL, UINT64), max_ngram_size=f("ngram", SMALL, UINT32),
        tenant=f("tenant", st.just(""), TEXT),
        trace_context=f("trace", st.just({}), st.dictionaries(
            st.sampled_from(["traceparent", "tracestate", "x"]), TEXT, max_size=2)))
    if "features" in bad:
        o.features.CopyFrom(draw(FEATURES))
    return draft_pb2.DraftControl(open=o)


@st.composite
def commits(draw):
    c = draft_pb2.CommitTokens(session_id=draw(SESSION_IDS), epoch=draw(UINT64),
                               start_position=draw(st.one_of(st.integers(0, 14), UINT32)),
                               token_ids=draw(st.one_of(GOOD_IDS, IDS)))
    if draw(st.booleans()):
        c.max_run_ahead = draw(UINT32)
    if draw(st.booleans()):
        c.features.CopyFrom(draw(FEATURES))
    return draft_pb2.DraftControl(commit=c)


CONTROLS = st.one_of(
    open_sessions(), commits(), st.just(draft_pb2.DraftControl()),
    st.builds(lambda session_id: draft_pb2.DraftControl(
        close=draft_pb2.CloseSession(session_id=session_id)), SESSION_IDS))



PROPOSALS = st.lists(st.fixed_dictionaries({
    "session": st.sampled_from(["own", "own", "other", ""]),
    "epoch": st.one_of(st.just(None), UINT64), "position": st.one_of(st.just(None), UINT32),
    "token_id": st.one_of(st.integers(0, 60), INT32),
    "q_ids": st.one_of(st.just([]), st.lists(st.integers(-2, 60), max_size=10),
                       st.builds(_repeat, st.integers(0, 5000), st.integers(0, 60))),
    "q_probs": st.lists(FLOAT, max_size=10),
    "error": st.one_of(st.just(None), st.integers(-1, 99)),
}), max_size=12)


