"""EAGLE-3 through the real engine step: a tiny random target whose runner keeps the residual
streams of three layers (the verifier's --eagle-feature-layers eagle3) ships them with its
commits to a DraftWorker serving a random EAGLE-3 head in the published layout (in process,
no gRPC). Greedy text is identical to plain decoding, chains and trees; chunked prefill ships
the same features; a verifier shipping final hidden states instead fails open."""
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from inproc import dear_verify, run_sessions

from tandem.engine.eagle3 import parse_feature_layers
from tandem.engine.generate import LocalGenerator
from tandem.engine.llama import LlamaModel
from tandem.engine.model_runner import ModelRunner
from tandem.models import ModelPaths
from tandem.proposers.eagle import EagleProposer
from tandem.sampling_params import SamplingParams
from tandem.spec import Method

pytestmark = pytest.mark.integration
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
    import eagle3_tiny

    root = tmp_path_factory.mktemp("eagle3")
    target = eagle3_tiny.tiny_target(root / "target")
    head = eagle3_tiny.write_head(root / "head", eagle3_tiny.head_weights())
    model = LlamaModel.load(target)
    proposer = EagleProposer.load(ModelPaths(head), 16 << 20, 16, target=target)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, eagle3_tiny.VOCAB, (n,), generator=gen).tolist()
               for n in (12, 21, 7)]
    plain = LocalGenerator(ModelRunner(model, 128, 16)).generate(
        [list(p) for p in prompts], GREEDY, 20, ())
    return model, proposer, prompts, plain


def _run(model, proposer, prompts, spec="eagle3", **kw):
    layers = parse_feature_layers(spec, model.cfg.num_layers)
    return run_sessions(model, {Method.EAGLE: proposer}, Method.EAGLE, prompts, GREEDY, 20,
                        features_cached=True, make_runner=lambda nb, bs: ModelRunner(
                            model, nb, bs, keep_features=True, feature_layers=layers), **kw)


def test_greedy_eagle3_chains_and_trees_are_identical_to_plain(tiny):
    model, proposer, prompts, plain = tiny
    got, drafted, _, link = _run(model, proposer, prompts)
    assert got == plain and drafted > 0
    assert link.features_rows >= sum(len(p) for p in prompts)
    row = next(iter(link.features["s0"].values()))
    assert len(row) == 2 * 3 * model.cfg.hidden_size  # float16, three layers wide
    trees = dear_verify()  # every tree verified whole
    got, drafted, _, link = _run(model, proposer, prompts, batch=1, max_spec_tokens=8,
                                 cost=trees, tree=True)
    assert got == plain and drafted > 0 and link.siblings > 0


def test_chunked_prefill_ships_the_same_three_layer_features(tiny):
    model, proposer, prompts, plain = tiny
    whole = _run(model, proposer, prompts, batch=3)
    chunked = _run(model, proposer, prompts, batch=3, prefill_chunk_tokens=8)
    assert whole[0] == chunked[0] == plain
    for i, p in enumerate(prompts):
        rows = [[link.features[f"s{i}"].get(j) for j in range(len(p))]
                for link in (whole[3], chunked[3])]
        assert None not in rows[1]
        a, b = (np.frombuffer(b"".join(r), np.float16).astype(np.float32) for r in rows)
        np.testing.assert_allclose(a, b, atol=0.02, rtol=0.02)


def test_final_features_to_an_eagle3_head_fail_open(tiny):
    """The worker refuses features of the wrong width (a clear per-session error); the
    verifier decodes plainly: the same text, nothing drafted."""
    model, proposer, prompts, plain = tiny
    got, drafted, _, _ = _run(model, proposer, prompts, spec="final")
    assert got == plain and drafted == 0
