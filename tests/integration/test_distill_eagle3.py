"""`tandem distill --method eagle3` on a tiny 8-layer target: the teacher-forced pass adds the
three-layer features the verifier would send (the very rows its runner records while
generating), the head trains with the training-time test, resumes, and the exported head in
the published EAGLE-3 layout drafts through the real EagleProposer."""
import json

import pytest
import torch
from test_distill import _tiny_target

from tandem.models import ModelPaths

pytestmark = pytest.mark.integration


def test_eagle3_distill_trains_resumes_and_serves(tmp_path, target_paths):
    from tandem.proposers.eagle import EagleProposer
    from tandem.spec import DraftRequest
    from tools.cli import main
    from tools.distill.config import EagleTrainConfig
    from tools.distill.eagle import aux_path, load_feature_seqs
    from tools.distill.eagle3 import evaluate3
    from tools.distill.eagle3_head import EAGLE3_CARD, Eagle3TrainHead
    from tools.distill.eagle_agreement import served_top1

    target = _tiny_target(tmp_path / "target", target_paths, layers=8)
    out, data = tmp_path / "head", tmp_path / "data"
    argv = ["distill", "--method", "eagle3", "--target", str(target), "--out", str(out),
            "--data-dir", str(data), "--num-prompts", "8", "--gen-batch", "4",
            "--max-new-tokens", "12", "--eagle-vocab", "512", "--epochs", "2",
            "--batch-tokens", "256", "--time-budget", "0", "--heldout-prompts", "2"]
    assert main(argv) == 0
    seqs = load_feature_seqs(data, aux=True)
    assert len(seqs) >= 4 and all(s.features.shape == (len(s.ids) - 1, 3 * 32) for s in seqs)
    card = json.loads((out / EAGLE3_CARD).read_text())
    assert card["format"] == "tandem-eagle3/1" and "--method eagle3" in card["command"]
    steps, held = card["progress"]["steps"], card["progress"]["heldout_chat"]
    assert steps >= 1 and 0 <= card["progress"]["top1_step3"] <= 1
    assert held["prompts"] == 2 and 0 <= held["top1_step1"] <= 1
    cfg = json.loads((out / "config.json").read_text())
    # 8 layers: Tandem's ids 1, N/2-1, N-4, written in vLLM's reading (one more)
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert cfg["speculators_model_type"] == "eagle3"
    prop = EagleProposer.load(ModelPaths(out), 8 << 20, target=ModelPaths(target))
    req = DraftRequest("k", seqs[0].ids[:6].tolist(), 6, 1, features=seqs[0].features[:5].float())
    (res,) = prop.propose([req])
    assert len(res.tokens) == 1 and 0 <= res.tokens[0].token_id < 49152
    # One agreement figure: the trainer's validation of the written head and the proposer.
    trained = evaluate3(Eagle3TrainHead.from_export(out, ModelPaths(target)), seqs[:3],
                        EagleTrainConfig())
    served = served_top1(prop, seqs[:3])
    assert served["positions"] == trained["positions"] > 0
    assert served["served"] == pytest.approx(trained["top1_step1"], abs=1e-4)
    aux = {p: p.stat().st_mtime_ns for p in data.glob("aux-*.safetensors")}
    assert aux and all(aux_path(s) in aux for s in data.glob("shard-*.safetensors"))
    assert main([*argv, "--resume", "--epochs", "4"]) == 0
    assert {p: p.stat().st_mtime_ns for p in data.glob("aux-*.safetensors")} == aux
    assert json.loads((out / EAGLE3_CARD).read_text())["progress"]["steps"] > steps


def test_aux_pass_gives_the_features_the_verifier_records(tmp_path, target_paths):
    """The teacher-forced pass (one prefill per conversation) and the runner recording the
    streams while it generates (as the verifier does) give the same rows, position for
    position, up to fp16 rounding."""
    from tandem.engine.llama import LlamaModel
    from tandem.engine.model_runner import ModelRunner
    from tools.distill.config import DataConfig
    from tools.distill.data import _RecordingGenerator, generate_shard
    from tools.distill.eagle import load_feature_seqs
    from tools.distill.eagle3 import aux_features, aux_runner
    from tools.distill.eagle_agreement import GREEDY

    target = _tiny_target(tmp_path / "target", target_paths, layers=8)
    model = LlamaModel.load(ModelPaths(target))
    prompts = [[1, 400, 52, 9000, 77], [1, 12, 13], [1, 5000, 6000, 7000, 8000, 123, 9]]
    # A cache shard recorded by a runner whose features are the three streams.
    gen = _RecordingGenerator(aux_runner(model, 16), DataConfig.top_k, features=True)
    generate_shard(gen, prompts, GREEDY, DataConfig(max_new_tokens=10, features=True,
                                                    dtype="float32"), (),
                   tmp_path / "shard-00000.safetensors")
    recorded = load_feature_seqs(tmp_path)
    # A KV cache of two 16-token blocks: the pass groups conversations to fit it.
    small = ModelRunner(model, 2, 16, feature_layers=aux_runner(model, 16).feature_layers)
    assert aux_features(small, tmp_path) == sum(len(s.ids) - 1 for s in recorded)
    forced = load_feature_seqs(tmp_path, aux=True)
    assert len(forced) == 3
    assert [s.ids.tolist() for s in forced] == [s.ids.tolist() for s in recorded]
    for a, b in zip(forced, recorded):
        assert a.features.shape == b.features.shape == (len(a.ids) - 1, 96)
        torch.testing.assert_close(a.features.float(), b.features.float(), atol=2e-3, rtol=2e-3)
    assert aux_features(aux_runner(model, 16), tmp_path) == 0  # cached: nothing recomputed


def test_eagle3_refuses_a_target_too_shallow(tmp_path, target_paths, capsys):
    from tools.cli import main

    target = _tiny_target(tmp_path / "target", target_paths)  # 2 layers
    rc = main(["distill", "--method", "eagle3", "--target", str(target), "--out",
               str(tmp_path / "h"), "--num-prompts", "2"])
    assert rc == 2 and "three target layers" in capsys.readouterr().err
    assert not (tmp_path / "h.data").exists()
