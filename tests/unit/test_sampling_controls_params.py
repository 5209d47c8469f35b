"""SamplingParams' vLLM controls: validated where they are made (ValueError, InvalidArgument
from the wire), off by default, and carried over the wire both ways."""
import pytest

from tandem.errors import InvalidArgument
from tandem.sampling_params import SamplingParams
from tandem.spec import Method
from tandem.v1 import common_pb2

pytestmark = pytest.mark.unit

ALL_ON = SamplingParams(0.5, 7, 0.9, seed=1, presence_penalty=0.5, frequency_penalty=-1.25,
                        repetition_penalty=1.5, min_p=0.25, min_tokens=4,
                        logit_bias=((3, 2.5), (9, -100.0)), allowed_token_ids=(1, 3, 9),
                        bad_words=((4, 5), (6,)))


def test_defaults_are_off_and_an_empty_message_is_the_defaults():
    assert not SamplingParams().has_controls
    msg = common_pb2.SamplingParams()
    assert SamplingParams.from_wire(msg) == SamplingParams(0.0)
    fields = common_pb2.SamplingParams(**SamplingParams().to_wire()).ListFields()
    assert {f.name for f, _ in fields} == {"temperature", "top_p"}  # controls left unset


def test_every_control_round_trips_the_wire():
    back = SamplingParams.from_wire(common_pb2.SamplingParams.FromString(
        common_pb2.SamplingParams(**ALL_ON.to_wire()).SerializeToString()))
    assert back.has_controls and back.token_ids() == [3, 9, 1, 3, 9, 4, 5, 6]
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p"):
        assert getattr(back, name) == pytest.approx(getattr(ALL_ON, name))
    assert (back.min_tokens, back.logit_bias, back.allowed_token_ids, back.bad_words) == (
        ALL_ON.min_tokens, ALL_ON.logit_bias, ALL_ON.allowed_token_ids, ALL_ON.bad_words)


def test_min_p_alone_is_not_a_prefix_control():
    assert not SamplingParams(min_p=0.5).has_controls
    assert SamplingParams(repetition_penalty=1.1).has_controls


@pytest.mark.parametrize("kwargs, word", [
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": 11.0}, "repetition_penalty"),
    ({"min_p": 1.5}, "min_p"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": True}, "min_tokens"),
    ({"logit_bias": ((1, 101.0),)}, "logit_bias"),
    ({"logit_bias": ((-1, 1.0),)}, "logit_bias"),
    ({"logit_bias": ((1, 1.0), (1, 2.0))}, "twice"),
    ({"logit_bias": tuple((t, 1.0) for t in range(301))}, "logit_bias"),
    ({"allowed_token_ids": (-3,)}, "allowed_token_ids"),
    ({"bad_words": ((),)}, "bad_words"),
    ({"bad_words": ((1,) * 4097,)}, "bad_words"),
])
def test_a_bad_control_is_a_value_error_naming_it(kwargs, word):
    with pytest.raises(ValueError, match=word):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("fields, word", [
    ({"presence_penalty": -3.0}, "presence_penalty"),
    ({"logit_bias": {-5: 1.0}}, "logit_bias"),
    ({"bad_words": [{"token_ids": []}]}, "bad_words"),
])
def test_a_bad_control_on_the_wire_is_invalid_argument(fields, word):
    with pytest.raises(InvalidArgument, match=word):
        SamplingParams.from_wire(common_pb2.SamplingParams(**fields))


@pytest.mark.parametrize("fields", [{"logit_bias": {100: 1.0}}, {"allowed_token_ids": [3, 100]},
                                    {"bad_words": [{"token_ids": [1, 120]}]}])
def test_the_verifier_refuses_ids_outside_its_vocabulary(fields):
    from tandem.v1 import verify_pb2
    from verify_service.server import params_from_proto

    info = common_pb2.WorkerInfo(max_spec_tokens=16, vocab_size=100, max_context_length=64)
    req = verify_pb2.GenerateRequest(
        session_id="s", prompt_token_ids=[1, 2], sampling=common_pb2.SamplingParams(**fields),
        stopping=verify_pb2.StoppingCriteria(max_new_tokens=4))
    with pytest.raises(InvalidArgument, match="vocabulary"):
        params_from_proto(req, info, Method.NONE)
    req.sampling.Clear()
    assert params_from_proto(req, info, Method.NONE).sampling == SamplingParams(0.0)
