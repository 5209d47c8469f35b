"""Predicted Outputs' proposer (tandem/proposers/prediction.py): it follows the output through
the prediction, re-aligns after an edit on the longest match nearest after where it left
off, and proposes nothing without a match."""
import pytest

from tandem.proposers.prediction import PREDICTION, PredictionProposer
from tandem.spec import DraftRequest, Method
from verify_service.drafts.history import HistoryDrafts

pytestmark = pytest.mark.unit
PROMPT = [900, 901, 902]


def propose(p: PredictionProposer, output: list[int], k: int = 4, key: str = "s"):
    tokens = PROMPT + output
    res = p.propose([DraftRequest(session_key=key, token_ids=tokens,
                                  num_committed=len(tokens), max_tokens=k)])[0]
    return [d.token_id for d in res.tokens], list(res.scores)


def opened(prediction: list[int]) -> PredictionProposer:
    p = PredictionProposer(max_spec_tokens=8)
    p.open("s", prediction, len(PROMPT))
    return p


def test_follows_the_prediction_and_grows_confident():
    pred = list(range(10, 40))
    p = opened(pred)
    first, reach0 = propose(p, [])
    assert first == [10, 11, 12, 13]
    out = pred[:12]
    tokens, reach = propose(p, out)
    assert tokens == pred[12:16]
    assert reach[0] > reach0[0] and all(a > b for a, b in zip(reach, reach[1:]))
    assert propose(p, pred, k=4)[0] == []  # all of it written: nothing left


def test_realigns_after_a_substitution_nearest_after_where_it_left_off():
    # "x = foo ( a ) ; y = foo ( b )" renamed foo -> bar: "(" occurs twice
    pred = [1, 2, 50, 7, 3, 8, 5, 6, 2, 50, 7, 4, 8]
    p = opened(pred)
    assert propose(p, [1, 2])[0] == [50, 7, 3, 8]
    assert propose(p, [1, 2, 60])[0] == []  # 60 is nowhere in the prediction
    tokens, reach = propose(p, [1, 2, 60, 7])  # 7 after the spot where it left off
    assert tokens == [3, 8, 5, 6]
    assert reach[0] < 0.7  # a 1-token match is a guess
    # a longer match wins over a nearer one: "6 2 50 7" occurs only at the second place
    q = opened(pred)
    assert propose(q, [9, 9, 6, 2, 50, 7])[0] == [4, 8]


def test_realigns_after_an_insertion_and_counts_the_match():
    pred = list(range(100, 130))
    p = opened(pred)
    out = pred[:5] + [7, 7, 7] + pred[5:9]  # three inserted tokens, then the prediction again
    tokens, reach = propose(p, out)
    assert tokens == pred[9:13]
    assert reach[0] >= 1 - 1 / 6  # matched 4 tokens back


def test_sessions_without_a_prediction_propose_nothing():
    p = PredictionProposer()
    assert propose(p, [1, 2, 3], key="other") == ([], [])
    p.open("empty", [], 3)
    assert propose(p, [1], key="empty") == ([], [])


def test_history_drafts_add_the_prediction_to_any_method():
    h = HistoryDrafts(8)
    assert h.serves(Method.NONE, prediction=True) and not h.serves(Method.NONE)
    assert set(h.prior_scales(Method.NONE, prediction=True)) == {PREDICTION}
    assert set(h.prior_scales(Method.AUTO, prediction=True)) == {
        Method.SUFFIX, Method.NGRAM, PREDICTION, Method.MEDUSA}
    assert set(h.prior_scales(Method.SUFFIX)) == {Method.SUFFIX}


def test_the_prediction_on_the_wire_and_what_each_method_makes_of_it():
    from dataclasses import replace

    from gateway.plan import GenerationPlan
    from gateway.verifier import build_request
    from tandem.errors import InvalidArgument
    from tandem.sampling_params import SamplingParams
    from tandem.v1 import common_pb2
    from verify_service.server import params_from_proto

    info = common_pb2.WorkerInfo(max_spec_tokens=16, vocab_size=100, max_context_length=64)
    plan = GenerationPlan(session_id="s", prompt_token_ids=(1, 2), sampling=SamplingParams(),
                          max_new_tokens=4, stop_token_ids=(), ignore_eos=False,
                          method=Method.NONE, num_speculative_tokens=0,
                          prediction_token_ids=(5, 6, 7))

    def params(method: Method, **plan_changes):
        return params_from_proto(build_request(replace(plan, method=method, **plan_changes),
                                               [], "w:1"), info, Method.NONE)

    for method in (Method.NONE, Method.NGRAM, Method.SUFFIX, Method.AUTO):
        got = params(method)
        assert (got.method, got.auto_draft, got.prediction) == (method, None, (5, 6, 7))
    for model in (Method.DRAFT_MODEL, Method.EAGLE):  # the worker's drafts beside it, as auto
        got = params(model)
        assert (got.method, got.auto_draft, got.prediction) == (Method.AUTO, model, (5, 6, 7))
    assert params(Method.MEDUSA).method is Method.AUTO
    assert params(Method.MTP).prediction == () and params(Method.MTP).method is Method.MTP
    assert params(Method.NONE, prediction_token_ids=()).prediction == ()
    with pytest.raises(InvalidArgument, match="prediction_token_ids"):
        params(Method.NONE, prediction_token_ids=(5, 100))
    with pytest.raises(InvalidArgument, match="prediction_token_ids"):
        params(Method.NONE, prediction_token_ids=(5,) * 65)


def test_a_short_match_far_from_where_it_left_off_is_no_realignment():
    pred = [1, 2, 3, 4, 5, *range(100, 140), 8, 9, 70, 71]
    p = opened(pred)
    assert propose(p, [1, 2])[0] == [3, 4, 5, 100]
    assert propose(p, [1, 2, 60, 61, 8, 9])[0] == []  # "8 9": 2 tokens, 40 away: chance
    q = opened(pred)
    assert propose(q, [1, 2, 60, 3])[0] == [4, 5, 100, 101]  # near: the edit's end


def test_a_spot_the_output_keeps_leaving_is_proposed_with_less_confidence():
    pred = [*range(10, 20), 1, 2, 3, 4, 5, 6, *range(30, 40)]
    p = opened(pred)
    loop = [1, 2, 3, 4, 5, 6, 7]  # the model loops where the prediction goes on to 30
    out = list(range(10, 20))
    reach = []
    for _ in range(3):
        out += loop
        tokens, r = propose(p, out[:-1])  # re-aligned on "1 ... 6": the same spot each time
        assert tokens[0] == 30
        reach.append(r[0])
        propose(p, out)
    assert reach[1] < 0.6 * reach[0] and reach[2] < 0.6 * reach[1]
