"""The trainer's validation and the served proposer score an EAGLE head alike, position for
position: same feature/token pairing (entry t reads feature t-1 and token t, drafts t+1), same
positions, same vocabulary (tiny random weights, synthetic sequences)."""
import pytest
import torch
from eagle_tiny import HF, tiny_head

from tandem.models import ModelPaths
from tandem.proposers.eagle import EagleProposer
from tools.distill.config import EagleTrainConfig
from tools.distill.eagle import FeatureSeq
from tools.distill.eagle_agreement import served_top1, trained_top1
from tools.distill.eagle_head import EagleTrainHead

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory):
    return tiny_head(tmp_path_factory.mktemp("eagle-agree"), seed=3)


def _seqs(head: EagleTrainHead, n: int = 3) -> list[FeatureSeq]:
    """Random sequences whose teacher top-1 is, at every other position, the head's own
    teacher-forced draft there (else a random id): agreement well above chance, and a
    misaligned computation falls to chance."""
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        prompt, total = 5 + 3 * i, 30 + 4 * i  # total = T + 1 tokens
        ids = torch.randint(0, 300, (total,), generator=g)
        feats = torch.randn(total - 1, 64, generator=g).half()
        with torch.no_grad():
            pred, _ = head(ids[None, 1:total - 1], feats[None, :total - 2].float(),
                           torch.arange(total - 2))
        own = torch.tensor(head.vocab.target_ids)[head.logits(pred[0]).argmax(-1)]  # 2..T
        top = torch.randint(0, 300, (total - prompt, 32), generator=g)
        for t in range(prompt - 1, total - 1):  # entry t drafts token t + 1
            if t % 2:
                top[t + 1 - prompt, 0] = own[t - 1]
        lp = torch.full(top.shape, -3.0).half()
        lp[:, 0] = -0.1
        out.append(FeatureSeq(ids, feats, prompt, top, lp))
    return out


def test_trained_and_served_agreement_are_one_figure(head_dir):
    head = EagleTrainHead.from_export(head_dir)
    seqs = _seqs(head)
    trained = trained_top1(head_dir, seqs, EagleTrainConfig())
    prop = EagleProposer.load(ModelPaths(head_dir), 1 << 20, block_size=4)
    served = served_top1(prop, seqs)
    assert served["positions"] == trained["positions"] == sum(
        len(s.features) - s.gen_start + 1 for s in seqs)
    assert 0.45 < trained["top1_step1"] < 0.8  # the planted half, and a few by chance
    assert served["served"] == pytest.approx(trained["top1_step1"], abs=1e-4)
    assert not prop._state  # every session released


def test_from_export_round_trips_the_exported_weights(head_dir):
    head = EagleTrainHead.from_export(head_dir)
    again = head_dir.parent / "again"
    head.export(again, HF, {"format": "tandem-eagle/1"})
    a = EagleTrainHead.from_export(again).state_dict()
    for name, value in head.state_dict().items():
        torch.testing.assert_close(a[name], value, rtol=0, atol=0)


def test_the_training_split_of_a_self_written_prompt_set_comes_from_its_data_dir(tmp_path):
    """A head trained on prompts the target wrote (mix "self") cannot rebuild them from a
    seed: its split is read from the run's prompts.jsonl, and without it the error says so."""
    import json

    from tools.distill.corpus import Prompt
    from tools.distill.eagle_agreement import training_split

    texts = [f"request {i}" for i in range(20)]
    (tmp_path / "prompts.jsonl").write_text(
        "".join(json.dumps(Prompt("chat", t, "self").__dict__) + "\n" for t in texts))
    card = {"data": {"mix": "self", "num_prompts": 20, "seed": 0, "sequences": 16,
                     "batch_size": 4, "sampled_every": 3, "temperature": 0.7},
            "train": {"seed": 1, "val_fraction": 0.25}}
    ordered, params, n_val = training_split(card, tmp_path)
    assert sorted(p.text for p in ordered) == sorted(texts[:16]) and n_val == 4
    assert len(params) == 16 and sum(not p.is_greedy for p in params) == 4  # shard 2 of 0-3
    with pytest.raises(ValueError, match="--data-dir"):
        training_split(card, None)
