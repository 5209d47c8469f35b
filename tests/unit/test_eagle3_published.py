"""EAGLE-3 heads in their published layout (tandem.engine.eagle3_published): a head written in
that layout loads from safetensors or pytorch_model.bin and the served EagleProposer drafts
what the layout's own forward (tests/unit/eagle3_tiny.py, written from the published math)
drafts, with the same q over target ids; d2t/t2d, missing and unknown tensors are checked by
name; the verifier's features are the residual streams the head's layer ids name."""
import numpy as np
import pytest
import torch
import transformers
from eagle3_tiny import (
    DRAFT_IDS,
    LAYERS,
    VOCAB,
    H,
    head_weights,
    reference_chain,
    tiny_target,
    write_head,
)

from draft_service.session import FeatureStore, SessionFailure
from tandem.engine.eagle3 import parse_feature_layers
from tandem.engine.eagle3_published import is_eagle3, layer_ids_of, load_eagle3
from tandem.engine.eagle_published import is_published_eagle
from tandem.engine.llama import LlamaModel
from tandem.engine.model_runner import ModelRunner, SeqChunk
from tandem.models import ModelError, ModelPaths
from tandem.proposers.eagle import EagleProposer
from tandem.sampling_params import SamplingParams
from tandem.spec import DraftRequest, Features

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return tiny_target(tmp_path_factory.mktemp("target"))


def _embed(target):
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(target.root))
    return hf.model.embed_tokens.weight.detach()


def _drafts(proposer, tokens, feats, steps, sampling=None, top_n=8):
    out = []
    for _ in range(steps):
        req = DraftRequest(session_key="s", token_ids=list(tokens) + [t.token_id for t in out],
                           num_committed=len(tokens), max_tokens=4, features=feats,
                           sampling=sampling or SamplingParams(temperature=0.0), top_n=top_n,
                           generator=torch.Generator().manual_seed(len(out)))
        res, = proposer.propose([req])
        out.append(res.tokens[0])
    return out


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_a_published_eagle3_head_drafts_as_its_layout_says(tmp_path, target, fmt):
    w = head_weights()
    root = write_head(tmp_path / "head", w, fmt)
    assert is_eagle3(root) and not is_published_eagle(tmp_path)
    proposer = EagleProposer.load(ModelPaths(root), 1 << 20, target=target)
    assert proposer.feature_size == 3 * H and proposer.vocab_size == VOCAB
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (9,), generator=gen).tolist()
    feats = torch.randn(len(tokens) - 1, 3 * H, generator=gen)
    want, rows = reference_chain(w, _embed(target), tokens, feats, 4)
    got = _drafts(proposer, tokens, feats, 4)
    assert [t.token_id for t in got] == want and set(want) <= set(DRAFT_IDS)
    # Sampled: q is the top-5 of the head's distribution over target ids, renormalised.
    proposer.release("s")
    tok, = _drafts(proposer, tokens, feats, 1, SamplingParams(temperature=1.0), top_n=5)
    p = rows[0].softmax(-1)
    top = p.topk(5)
    assert set(tok.q_ids) == set(top.indices.tolist()) and tok.token_id in tok.q_ids
    q = dict(zip(tok.q_ids, tok.q_probs))
    np.testing.assert_allclose([q[i] for i in top.indices.tolist()],
                               (top.values / top.values.sum()).numpy(), atol=1e-5)


def test_a_shipped_embedding_is_used_and_no_target_needed(tmp_path, target):
    w = head_weights(embed=True)
    root = write_head(tmp_path / "head", w)
    proposer = EagleProposer.load(ModelPaths(root), 1 << 20)
    gen = torch.Generator().manual_seed(4)
    tokens = torch.randint(0, VOCAB, (7,), generator=gen).tolist()
    feats = torch.randn(len(tokens) - 1, 3 * H, generator=gen)
    want, _ = reference_chain(w, w["embed_tokens.weight"], tokens, feats, 3)
    assert [t.token_id for t in _drafts(proposer, tokens, feats, 3)] == want


def test_without_an_embedding_it_needs_the_target(tmp_path):
    root = write_head(tmp_path / "head", head_weights())
    with pytest.raises(ModelError, match="--tokenizer TARGET_DIR"):
        EagleProposer.load(ModelPaths(root), 1 << 20)


def test_missing_unknown_and_misfit_tensors_are_named(tmp_path, target):
    w = head_weights()
    del w["midlayer.hidden_norm.weight"]
    w["midlayer.self_attn.rotary_emb.inv_freq"] = torch.ones(4)  # ignorable
    w["layers.0.input_layernorm.weight"] = torch.ones(H)  # an EAGLE-1/2 name
    write_head(tmp_path / "a", w)
    with pytest.raises(ModelError, match="missing midlayer.hidden_norm.weight; "
                                         "unexpected layers.0.input_layernorm.weight"):
        load_eagle3(tmp_path / "a", target)
    w = head_weights()
    w["fc.weight"] = w["fc.weight"][:, :2 * H].contiguous()  # an EAGLE-1/2 fc
    write_head(tmp_path / "b", w)
    with pytest.raises(ModelError, match=r"fc.weight has shape \(32, 64\)"):
        load_eagle3(tmp_path / "b", target)
    write_head(tmp_path / "c", head_weights(), target_hidden_size=64)
    with pytest.raises(ModelError, match="target_hidden_size = 64 is not supported"):
        load_eagle3(tmp_path / "c", target)


def test_d2t_and_t2d_are_checked(tmp_path, target):
    head = load_eagle3(write_head(tmp_path / "ok", head_weights()), target)
    assert head.model.vocab_map.tolist() == list(DRAFT_IDS)
    logits = head.draft_logits(torch.randn(2, H))
    assert torch.isinf(logits[:, 1::2]).all() and torch.isfinite(logits[:, ::2]).all()
    w = head_weights()
    w["t2d"] = w["t2d"].clone()
    w["t2d"][1] = True
    with pytest.raises(ModelError, match="t2d does not mark exactly"):
        load_eagle3(write_head(tmp_path / "t2d", w), target)
    w = head_weights()
    w["d2t"] = w["d2t"].clone()
    w["d2t"][-1] = VOCAB  # past the target's vocabulary
    with pytest.raises(ModelError, match="outside"):
        load_eagle3(write_head(tmp_path / "d2t", w), target)


def test_layer_ids_are_layer_outputs_and_the_verifier_captures_them(tmp_path, target):
    """Id i is the output of target layer i (the stream entering i + 1): a head whose config
    names (0, 2, 4), top level or under eagle_config, gets HF hidden_states[1], [3], [5]."""
    for config in ({"eagle_aux_hidden_state_layer_ids": [0, 2, 4]},
                   {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 2, 4]}}):
        root = write_head(tmp_path / "h", head_weights(), **config)
        head = load_eagle3(root, target)
        assert layer_ids_of(config) == head.layer_ids == (0, 2, 4)
    spec = ",".join(map(str, head.layer_ids))
    assert parse_feature_layers(spec, LAYERS) == (1, 3, 5)
    assert parse_feature_layers("eagle3", LAYERS) == (2, 3, 3)  # entering 2, N/2, N-3
    assert parse_feature_layers("final", LAYERS) == ()
    for bad in ("0,2,6", "1,2", "a,b,c", "-1,2,3"):
        with pytest.raises(ModelError, match="eagle-feature-layers"):
            parse_feature_layers(bad, LAYERS)
    model = LlamaModel.load(target)
    runner = ModelRunner(model, 8, 16, keep_features=True,
                         feature_layers=parse_feature_layers(spec, LAYERS))
    ids = torch.randint(0, VOCAB, (11,), generator=torch.Generator().manual_seed(5)).tolist()
    _, feats = runner.forward([SeqChunk(ids, 0, [0], 1)], with_hidden=True)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(target.root))
    states = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
    want = torch.cat([states[i][0] for i in (1, 3, 5)], -1)
    assert feats.shape == (11, 3 * H) and (feats - want).abs().max().item() < 1e-4
    kept = runner.features_at([0], 0, 11).float()  # kept per slot for cache hits and chunks
    assert (kept - want).abs().max().item() < 1e-2


def test_a_feature_width_mismatch_is_a_clear_error():
    store = FeatureStore(3 * H)
    with pytest.raises(SessionFailure, match="--eagle-feature-layers"):
        store.put(Features(0, H, np.zeros((2, H), np.float16).tobytes()))


def test_the_verifier_flag_is_checked_and_refuses_medusa_beside_it(monkeypatch):
    from tools.cli import build_parser
    from verify_service.config import VerifierConfig
    from verify_service.forward.features import feature_layers

    for good in ("final", "eagle3", "1,3,4"):
        assert VerifierConfig(eagle_feature_layers=good).eagle_feature_layers == good
    with pytest.raises(ValueError, match="eagle_feature_layers must be final, eagle3"):
        VerifierConfig(eagle_feature_layers="middle")
    monkeypatch.setenv("TANDEM_VERIFIER_EAGLE_FEATURE_LAYERS", "eagle3")
    assert build_parser().parse_args(["verifier"]).eagle_feature_layers == "eagle3"

    class Model:
        class cfg:  # noqa: N801
            num_layers = LAYERS

    assert feature_layers("eagle3", Model, None) == (2, 3, 3)
    with pytest.raises(ModelError, match="--medusa off"):
        feature_layers("eagle3", Model, object())
    with pytest.raises(ModelError, match=r"ids in \[0, 5\]"):
        feature_layers("1,3,9", Model, None)


def test_the_verifier_keeps_what_its_flag_names_and_refuses_layers_it_lacks(target):
    import asyncio

    from verify_service.assemble import build_engine as _build_engine
    from verify_service.config import VerifierConfig

    model = LlamaModel.load(target)

    def build(spec):
        config = VerifierConfig(model=str(target.root), kv_cache_mb=1, calibrate_reps=0,
                                block_size=16, medusa="off", eagle_feature_layers=spec)
        engine, _ = asyncio.run(_build_engine(config, model, target))
        return engine.executor.runner

    runner = build("eagle3")
    assert runner.feature_layers == (2, 3, 3) and runner.features.shape[1] == 3 * H
    assert build("final").features.shape[1] == H
    with pytest.raises(ModelError, match=r"eagle-feature-layers 1,3,6: .*ids in \[0, 5\]"):
        build("1,3,6")


def test_a_padded_decode_step_keeps_the_same_three_layer_features(target):
    """CUDA graphs' padded decode (run eagerly here) returns and keeps the runner's rows."""
    from tandem.engine.cuda_graphs import GraphDecoder

    model, layers = LlamaModel.load(target), parse_feature_layers("eagle3", LAYERS)
    runners = [ModelRunner(model, 16, 16, keep_features=True, feature_layers=layers)
               for _ in range(2)]
    graphs = GraphDecoder(runners[1], scratch_block=15, capture=False)
    ids = torch.randint(0, VOCAB, (9,), generator=torch.Generator().manual_seed(6)).tolist()
    out = []
    for r, fwd in zip(runners, (runners[0].forward, graphs.forward)):
        r.forward([SeqChunk(ids[:8], 0, [0])])
        out.append((fwd([SeqChunk(ids[8:], 8, [0])], with_hidden=True)[1],
                    r.features_at([0], 0, 9).float()))
    assert graphs.replays == 0 and graphs.fallbacks == 0 and out[0][0].shape == (1, 3 * H)
    for a, b in zip(*out):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


def test_tandem_up_starts_verifiers_with_the_head_s_layers(tmp_path, target):
    from tools.launcher import Cluster, ClusterConfig

    def args(eagle):
        return Cluster(ClusterConfig(model=str(target.root), eagle=str(eagle)),
                       log=lambda *_: None)._eagle3_args()[0]

    named = write_head(tmp_path / "named", head_weights(),
                       eagle_aux_hidden_state_layer_ids=[1, 2, 4])
    assert args(named) == ["--eagle-feature-layers", "1,2,4", "--medusa", "off"]
    assert args(write_head(tmp_path / "default", head_weights()))[1] == "eagle3"
    assert args(tmp_path / "absent") == []
