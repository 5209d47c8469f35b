"""SamplingParams to and from tandem.v1.SamplingParams: the one conversion the gateway, the
verifier and the draft worker share (proto3's unset top_p is off; an unset seed is unseeded)."""
import pytest

from tandem.errors import InvalidArgument
from tandem.sampling_params import SamplingParams
from tandem.v1 import common_pb2

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(0.0),
                                    SamplingParams(0.7, 40, 0.9, seed=0),
                                    SamplingParams(1.3, 0, 1.0, seed=2**63 - 1)])
def test_a_round_trip_gives_the_same_params(params):
    msg = common_pb2.SamplingParams(**params.to_wire())
    assert msg.HasField("seed") == (params.seed is not None)
    back = SamplingParams.from_wire(common_pb2.SamplingParams.FromString(msg.SerializeToString()))
    assert back == params or (back.temperature == pytest.approx(params.temperature)
                              and (back.top_k, back.seed) == (params.top_k, params.seed))


def test_unset_fields_mean_off_and_unseeded():
    assert SamplingParams.from_wire(common_pb2.SamplingParams()) == SamplingParams(0.0, 0, 1.0)
    assert SamplingParams.wire_fields(common_pb2.SamplingParams(top_p=0.5)) == (0.0, 0, 0.5, None)


@pytest.mark.parametrize("fields, word", [({"temperature": -1.0}, "temperature"),
                                          ({"top_p": 1.5}, "top_p"),
                                          ({"temperature": float("nan")}, "temperature")])
def test_a_bad_value_is_invalid_argument_naming_it(fields, word):
    with pytest.raises(InvalidArgument, match=word):
        SamplingParams.from_wire(common_pb2.SamplingParams(**fields))
    # unchecked for the draft worker, which reports it in-band for the one session
    assert len(SamplingParams.wire_fields(common_pb2.SamplingParams(**fields))) == 4
