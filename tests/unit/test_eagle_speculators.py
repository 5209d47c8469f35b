"""EAGLE heads in the speculators format (tandem.engine.eagle_speculators; what vLLM loads):
a head written to the documented layout (speculators' diff-only transformer_layer_config,
`layers.0.*`, layer ids in vLLM's reading) drafts exactly what the same weights draft in the
published `midlayer.*` layout; the converter and the trainer's writer produce it; the
verifier's feature layers come from its config; variants are refused by name."""
import json

import pytest
import torch
import transformers
from eagle3_tiny import (
    DRAFT_IDS,
    EPS,
    HEADS,
    INTER,
    KV,
    VOCAB,
    H,
    head_weights,
    tiny_target,
    write_head,
)
from safetensors.torch import load_file, save_file

from tandem.engine.eagle3_published import is_eagle3, layer_ids_of, load_eagle3
from tandem.models import ModelError, ModelPaths
from tandem.proposers.eagle import EagleProposer
from tandem.sampling_params import SamplingParams
from tandem.spec import DraftRequest
from tools.convert_head import convert_head

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return tiny_target(tmp_path_factory.mktemp("target"))


def write_speculators(path, w, layer_ids=(1, 3, 5), **extra):
    """A head as speculators saves it: the layer's config as a diff against LlamaConfig's
    defaults, tensors under layers.0, ids in vLLM's reading, the verifier named."""
    path.mkdir(parents=True, exist_ok=True)
    layer = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=H, intermediate_size=INTER, num_hidden_layers=1,
        num_attention_heads=HEADS, num_key_value_heads=KV, max_position_embeddings=256,
        rms_norm_eps=EPS, tie_word_embeddings=False).to_diff_dict()
    config = {
        "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
        "speculators_version": "0.9.0", "transformer_layer_config": layer,
        "draft_vocab_size": len(w["lm_head.weight"]), "norm_before_residual": False,
        "target_hidden_size": None, "eagle_aux_hidden_state_layer_ids": list(layer_ids),
        "speculators_config": {
            "algorithm": "eagle3", "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 4}],
            "verifier": {"name_or_path": "tiny", "architectures": ["LlamaForCausalLM"]}},
        **extra}
    (path / "config.json").write_text(json.dumps(config))
    named = {n.replace("midlayer.", "layers.0."): t for n, t in w.items()}
    save_file({**named, "verifier_norm.weight": torch.ones(H)}, path / "model.safetensors")
    return path


def _drafts(proposer, tokens, feats, steps=4):
    out = []
    for _ in range(steps):
        req = DraftRequest(session_key="s", token_ids=list(tokens) + [t.token_id for t in out],
                           num_committed=len(tokens), max_tokens=4, features=feats,
                           sampling=SamplingParams(temperature=1.0), top_n=6,
                           generator=torch.Generator().manual_seed(len(out)))
        res, = proposer.propose([req])
        out.append(res.tokens[0])
    proposer.release("s")
    return [(t.token_id, t.q_ids, [round(q, 5) for q in t.q_probs]) for t in out]


def _same_proposals(a_dir, b_dir, target):
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (11,), generator=gen).tolist()
    feats = torch.randn(len(tokens) - 1, 3 * H, generator=gen)
    a, b = (EagleProposer.load(ModelPaths(d), 1 << 20, target=target) for d in (a_dir, b_dir))
    assert _drafts(a, tokens, feats) == _drafts(b, tokens, feats)
    return a, b


def test_speculators_head_proposes_what_the_midlayer_layout_does(tmp_path, target):
    w = head_weights()
    w.pop("fc.bias")  # speculators' fc has no bias
    mid = write_head(tmp_path / "mid", w, eagle_aux_hidden_state_layer_ids=[0, 2, 4])
    spec = write_speculators(tmp_path / "spec", w)
    assert is_eagle3(spec) and is_eagle3(mid)
    # vLLM's ids (entering layers 1, 3, 5) are Tandem's (outputs of layers 0, 2, 4)
    config = json.loads((spec / "config.json").read_text())
    assert layer_ids_of(config) == (0, 2, 4)
    _, b = _same_proposals(mid, spec, target)
    assert b.head.card["format"] == "eagle-3 (speculators)"
    assert b.head.card["speculative_tokens"] == 4 and b.head.layer_ids == (0, 2, 4)
    assert b.head.model.vocab_map.tolist() == list(DRAFT_IDS)


def test_converter_and_full_vocabulary_heads(tmp_path, target):
    w = head_weights()  # fc.bias kept: converted as it is
    mid = write_head(tmp_path / "mid", w, eagle_aux_hidden_state_layer_ids=[1, 2, 4])
    out = convert_head(mid, tmp_path / "out", str(target.root), log=lambda *_: None)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["speculators_model_type"] == "eagle3"
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 3, 5]
    assert cfg["speculators_config"]["verifier"]["architectures"] == ["LlamaForCausalLM"]
    assert "layers.0.hidden_norm.weight" in load_file(str(out / "model.safetensors"))
    _same_proposals(mid, out, target)
    # A draft vocabulary equal to the target's ships no d2t/t2d (speculators drops them).
    full = {n: t for n, t in head_weights(seed=2).items() if n not in ("d2t", "t2d")}
    full["lm_head.weight"] = torch.randn(VOCAB, H)
    head = load_eagle3(write_speculators(tmp_path / "full", full, layer_ids=(2, 3, 5)), target)
    assert head.model.vocab_map.tolist() == list(range(VOCAB))
    with pytest.raises(ModelError, match="not empty"):
        convert_head(mid, out)
    with pytest.raises(ModelError, match="already in the speculators format"):
        convert_head(out, tmp_path / "again")


def test_variants_are_refused_and_norm_before_residual_is_served(tmp_path, target):
    w = head_weights()
    for name, extra in (("fc_norm", {"fc_norm": True}),
                        ("norm_output", {"norm_output": True}),
                        ("target_hidden_size", {"target_hidden_size": 64}),
                        ("speculators_model_type 'dflash'", {"speculators_model_type": "dflash"})):
        root = write_speculators(tmp_path / name.split()[0], w, **extra)
        with pytest.raises(ModelError, match=name):
            EagleProposer.load(ModelPaths(root), 1 << 20, target=target)
    with pytest.raises(ModelError, match="id 0"):
        layer_ids_of(json.loads((write_speculators(tmp_path / "zero", w, (0, 2, 4))
                                 / "config.json").read_text()))
    # absent, norm_before_residual is vLLM's default: true (the residual is the normed input)
    plain = write_speculators(tmp_path / "nbr_off", w)
    nbr = write_speculators(tmp_path / "nbr_on", w)
    cfg = json.loads((nbr / "config.json").read_text())
    del cfg["norm_before_residual"]
    (nbr / "config.json").write_text(json.dumps(cfg))
    a, b = (load_eagle3(d, target) for d in (plain, nbr))
    assert not a.norm_before_residual and b.norm_before_residual
    with pytest.raises(AssertionError):  # and it changes what the head computes
        _same_proposals(plain, nbr, target)


def test_tandem_private_eagle1_heads_are_refused_with_the_reason(tmp_path):
    (tmp_path / "h").mkdir()
    (tmp_path / "h" / "tandem_eagle.json").write_text("{}")
    with pytest.raises(ModelError, match="cannot be converted exactly"):
        convert_head(tmp_path / "h", tmp_path / "out")


def test_cli_convert_head_and_up_take_the_layers_from_the_config(tmp_path, target, capsys):
    from tools.cli import main
    from tools.launcher import Cluster, ClusterConfig

    mid = write_head(tmp_path / "mid", head_weights(), eagle_aux_hidden_state_layer_ids=[1, 2, 4])
    assert main(["models", "convert-head", str(mid), str(tmp_path / "out")]) == 0
    assert main(["models", "convert-head", str(mid), str(tmp_path / "out")]) == 2
    assert "not empty" in capsys.readouterr().err
    args = Cluster(ClusterConfig(model=str(target.root), eagle=str(tmp_path / "out")),
                   log=lambda *_: None)._eagle3_args()[0]
    assert args == ["--eagle-feature-layers", "1,2,4", "--medusa", "off"]


def test_converter_card_names_are_the_formats():
    from tandem.engine.eagle import EAGLE_CARD
    from tools import convert_head as c
    from tools.distill.airgap_head3 import EAGLE3_CARD

    assert (c.EAGLE_CARD, c.EAGLE3_CARD) == (EAGLE_CARD, EAGLE3_CARD)


def test_speculators_eagle1_proposes_what_the_published_layout_does(tmp_path):
    from test_eagle_published import _head, _target

    target = _target(tmp_path / "target")
    _head(tmp_path / "pub")
    out = convert_head(tmp_path / "pub", tmp_path / "spec", log=lambda *_: None)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["speculators_model_type"] == "eagle" and cfg["fusion_bias"] is True
    names = set(load_file(str(out / "model.safetensors")))
    assert {"fusion_fc.weight", "fusion_fc.bias", "transformer.mlp.up_proj.weight"} <= names
    gen = torch.Generator().manual_seed(4)
    tokens = torch.randint(0, VOCAB, (9,), generator=gen).tolist()
    feats = torch.randn(len(tokens) - 1, H, generator=gen)
    a, b = (EagleProposer.load(ModelPaths(d), 1 << 20, target=target)
            for d in (tmp_path / "pub", out))
    assert b.head.card["format"] == "eagle-1/2 (speculators)"
    assert _drafts(a, tokens, feats) == _drafts(b, tokens, feats)
    with pytest.raises(ModelError, match="pass the target checkpoint"):
        EagleProposer.load(ModelPaths(out), 1 << 20)
    cfg["layernorms"] = True
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelError, match="layernorms = true"):
        EagleProposer.load(ModelPaths(out), 1 << 20, target=target)
