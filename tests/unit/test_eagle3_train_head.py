"""The EAGLE-3 training module against the served head: a Tandem-trained head, exported in the
published layout, drafts through the real EagleProposer exactly what its training-time test
computes at each draft step (step 1 from the target's features, steps 2-3 from its own
outputs), and its checkpoint has the layout's names, d2t/t2d and layer ids."""
import json

import pytest
import torch
from eagle3_tiny import DRAFT_IDS, LAYERS, VOCAB, tiny_target
from safetensors.torch import load_file

from tandem.engine.checkpoint import LlamaConfig, load_tensors
from tandem.engine.draft_vocab import DraftVocab
from tandem.models import ModelPaths, read_hf_config
from tandem.proposers.eagle import EagleProposer
from tandem.sampling_params import SamplingParams
from tandem.spec import DraftRequest
from tools.distill.config import EagleTrainConfig
from tools.distill.eagle3_head import EAGLE3_CARD, Eagle3TrainHead

pytestmark = pytest.mark.unit
STEPS = 3
SAMPLED = SamplingParams(temperature=1.0, seed=11)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle3train")
    target = tiny_target(root / "target")
    # A RoPE base other than the default, spelled the way transformers 5 writes it: the
    # export must carry it (a head served with another base drafts from wrong positions).
    cfg_path = root / "target" / "config.json"
    hf = json.loads(cfg_path.read_text())
    hf.pop("rope_theta", None)
    hf["rope_parameters"] = {"rope_theta": 500.0, "rope_type": "default"}
    cfg_path.write_text(json.dumps(hf))
    cfg = LlamaConfig.from_hf(read_hf_config(target))
    t = load_tensors(target)
    ids = tuple(reversed(DRAFT_IDS))  # rows not in target order: export must sort them
    vocab = DraftVocab(ids, VOCAB, 0)
    head = Eagle3TrainHead(cfg, vocab, t["embed_tokens.weight"],
                           t["lm_head.weight"][torch.tensor(ids)], (1, 3, 4))
    head.init_from_target(t, LAYERS - 1)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():  # away from the init, and fp16-exact as the export stores it
        for p in head.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.1)
            p.copy_(p.half().float())
    head.export(root / "head", read_hf_config(target), {"format": "tandem-eagle3/1"})
    return target, head, root / "head"


def test_export_has_the_speculators_layout(exported):
    _, head, out = exported
    w = load_file(str(out / "model.safetensors"))
    cfg = json.loads((out / "config.json").read_text())
    # vLLM's reading (the stream entering layer i): Tandem's ids (1, 3, 4) plus one
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert cfg["speculators_model_type"] == "eagle3" and "layers.0.hidden_norm.weight" in w
    assert cfg["transformer_layer_config"]["rope_theta"] == 500.0
    assert not any(n.startswith("midlayer.") for n in w)
    assert cfg["draft_vocab_size"] == len(DRAFT_IDS) and (out / EAGLE3_CARD).is_file()
    assert (torch.arange(len(w["d2t"])) + w["d2t"]).tolist() == list(DRAFT_IDS)
    assert w["t2d"].sum() == len(DRAFT_IDS) and "embed_tokens.weight" not in w
    assert w["fc.weight"].shape == (head.cfg.hidden_size, 3 * head.cfg.hidden_size)


def test_from_export_is_the_trained_module(exported):
    target, head, out = exported
    back = Eagle3TrainHead.from_export(out, target)
    assert back.layer_ids == (1, 3, 4) and set(back.vocab.target_ids) == set(DRAFT_IDS)
    gen = torch.Generator().manual_seed(8)
    ids = torch.randint(0, VOCAB, (1, 10), generator=gen)
    feats = torch.randn(1, 10, 3 * head.cfg.hidden_size, generator=gen)
    with torch.no_grad():
        a = [head.logits(o)[..., torch.tensor(head.vocab.target_ids).argsort()]
             for o in head(ids, feats, torch.arange(10), 2)]
        b = [back.logits(o) for o in back(ids, feats, torch.arange(10), 2)]
    for x, y in zip(a, b):  # back's rows are sorted by target id, head's are not
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)


def test_training_time_test_drafts_what_the_proposer_serves(exported):
    target, head, out = exported
    prop = EagleProposer.load(ModelPaths(out), 8 << 20, 16, target=target)
    gen = torch.Generator().manual_seed(5)
    h3 = 3 * head.cfg.hidden_size
    checked = 0
    for commit in (2, 5, 9, 14):
        # The served chain after a commit at `commit`: its drafts become the sequence's next
        # tokens, so the training forward reads, at step j, the token the proposer drafted.
        ids = torch.randint(0, VOCAB, (commit + 1,), generator=gen).tolist()
        feats = torch.randn(commit + STEPS, h3, generator=gen)
        drafts, qs = [], []
        for _ in range(STEPS):  # a draft worker asks one token at a time, drafts appended
            res = prop.propose([DraftRequest(("t", commit), ids + drafts, commit + 1,
                                             STEPS - len(drafts), SAMPLED, generator=gen,
                                             features=feats[:commit])])[0]
            drafts.append(res.tokens[0].token_id)
            qs.append(res.tokens[0])
        seq = torch.tensor(ids + drafts[:-1])  # entries 0..commit + STEPS - 1
        # Row r of the training forward is entry r + 1, reading feature r.
        with torch.no_grad():
            outs = head(seq[1:][None], feats[:len(seq) - 1][None],
                        torch.arange(len(seq) - 1), STEPS)
        for j, o in enumerate(outs):
            row = commit - 1 + j  # step j + 1 of the chain that starts at entry commit
            p = head.logits(o[0, row]).softmax(-1)  # over draft rows
            rows = head.vocab.input_map()[torch.tensor(qs[j].q_ids)]
            assert len(qs[j].q_ids) > 1 and drafts[j] in qs[j].q_ids
            # q is the head's top-n, renormalised (DraftRequest.top_n)
            assert torch.allclose(p[rows] / p[rows].sum(), torch.tensor(qs[j].q_probs),
                                  atol=2e-5), (commit, j)
            checked += 1
    assert checked == 4 * STEPS


def test_ttt_config_is_checked():
    with pytest.raises(ValueError, match="ttt_steps"):
        EagleTrainConfig(ttt_steps=0)
    with pytest.raises(ValueError, match="ttt_decay"):
        EagleTrainConfig(ttt_decay=0.0)
