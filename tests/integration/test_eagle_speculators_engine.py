"""A speculators-format EAGLE-3 head through the real engine step: the verifier keeps the
layers the head's config names (vLLM's reading, converted), the head drafts, and greedy text
is identical to plain decoding, with drafts accepted."""
import sys
from pathlib import Path

import pytest
import torch
from inproc import run_sessions

from tandem.engine.eagle3 import capture_layers
from tandem.engine.generate import LocalGenerator
from tandem.engine.llama import LlamaModel
from tandem.engine.model_runner import ModelRunner
from tandem.models import ModelPaths
from tandem.proposers.eagle import EagleProposer
from tandem.sampling_params import SamplingParams
from tandem.spec import Method
from tools.convert_head import convert_head

pytestmark = pytest.mark.integration
GREEDY = SamplingParams(temperature=0.0)


def test_speculators_head_serves_plain_greedy_text(tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
    import eagle3_tiny

    target = eagle3_tiny.tiny_target(tmp_path / "target")
    mid = eagle3_tiny.write_head(tmp_path / "mid", eagle3_tiny.head_weights(),
                                 eagle_aux_hidden_state_layer_ids=[0, 2, 4])
    head_dir = convert_head(mid, tmp_path / "spec", log=lambda *_: None)
    model = LlamaModel.load(target)
    proposer = EagleProposer.load(ModelPaths(head_dir), 16 << 20, 16, target=target)
    assert proposer.head.layer_ids == (0, 2, 4)
    layers = capture_layers(proposer.head.layer_ids, model.cfg.num_layers)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, eagle3_tiny.VOCAB, (n,), generator=gen).tolist()
               for n in (12, 21, 7)]
    plain = LocalGenerator(ModelRunner(model, 128, 16)).generate(
        [list(p) for p in prompts], GREEDY, 20, ())
    got, drafted, _, link = run_sessions(
        model, {Method.EAGLE: proposer}, Method.EAGLE, prompts, GREEDY, 20,
        features_cached=True, make_runner=lambda nb, bs: ModelRunner(
            model, nb, bs, keep_features=True, feature_layers=layers))
    assert got == plain and drafted > 0
    row = next(iter(link.features["s0"].values()))
    assert len(row) == 2 * 3 * model.cfg.hidden_size
