"""EAGLE-3 features under tensor parallelism: rank 0's runner keeps the residual streams of
three layers (every rank holds the same residual stream, so no collective is added) and ships
the same features, the same logits, as TP=1 (tests/unit/test_tensor_parallel.py's steps)."""
import pytest
import torch
from test_tensor_parallel import ATOL, BLOCK, BLOCKS, _steps, tiny  # noqa: F401 (a fixture)

from tandem.engine.eagle3 import parse_feature_layers
from tandem.engine.llama import LlamaModel
from tandem.engine.model_runner import ModelRunner, kv_bytes_per_token
from tandem.models import resolve_model
from verify_service.tp.group import start_leader

pytestmark = pytest.mark.unit


def test_tp2_keeps_the_same_three_layer_features_as_tp1(tiny):  # noqa: F811
    torch.set_num_threads(1)
    layers = parse_feature_layers("0,1,1", 2)  # the last one: the last layer's output
    assert layers == (1, 2, 2)
    expected = _steps(ModelRunner(LlamaModel.load(resolve_model(tiny)), BLOCKS, BLOCK,
                                  keep_features=True, feature_layers=layers))
    leader = start_leader(str(tiny), 2, "float32", threads=1, timeout_s=30)
    try:
        budget = BLOCKS * BLOCK * kv_bytes_per_token(leader.model)
        got = _steps(leader.make_runner(budget, BLOCK, keep_features=True,
                                        feature_layers=layers))
    finally:
        leader.close()
    assert [p.exitcode for p in leader.procs] == [0]
    assert expected[2].shape[1] == expected[-1].shape[1] == 3 * 64  # features, kept ones
    for g, e in zip(got, expected):
        assert g.shape == e.shape
        torch.testing.assert_close(g, e, atol=ATOL, rtol=0)
