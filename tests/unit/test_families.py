"""Every served family against transformers on tiny random checkpoints (tandem.engine.families):
logits through the paged runner (chunked prefill, a verification chunk, decodes, a batch), and
greedy text for 64 tokens, with sliding windows shorter than the prompt, GQA, tied and untied
heads; and what cannot be computed exactly is refused by name."""
import json

import pytest
import torch
import transformers

from tandem.engine.checkpoint import LlamaConfig
from tandem.engine.families import unsupported
from tandem.engine.generate import LocalGenerator
from tandem.engine.llama import LlamaModel
from tandem.engine.model_runner import ModelRunner, SeqChunk
from tandem.models import ModelError, resolve_model
from tandem.sampling_params import SamplingParams

pytestmark = pytest.mark.unit

BASE = dict(vocab_size=101, hidden_size=48, intermediate_size=96, num_hidden_layers=4,
            num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=256)
FAMILIES = {
    "qwen2-window": (transformers.Qwen2Config, dict(
        use_sliding_window=True, sliding_window=12, max_window_layers=2,
        tie_word_embeddings=False)),
    "qwen3": (transformers.Qwen3Config, dict(head_dim=16, tie_word_embeddings=False)),
    "qwen3-tied-window": (transformers.Qwen3Config, dict(
        head_dim=8, tie_word_embeddings=True, use_sliding_window=True, sliding_window=10,
        max_window_layers=1)),
    "mistral-window": (transformers.MistralConfig, dict(sliding_window=12, head_dim=8)),
    "llama-attention-bias": (transformers.LlamaConfig, dict(attention_bias=True)),
    "gemma2": (transformers.Gemma2Config, dict(
        head_dim=16, query_pre_attn_scalar=24, sliding_window=12,
        attn_logit_softcapping=5.0, final_logit_softcapping=3.0)),
    "gemma3": (transformers.Gemma3TextConfig, dict(
        head_dim=16, query_pre_attn_scalar=16, sliding_window=10, sliding_window_pattern=3,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                            "rope_theta": 100000.0},
                         "sliding_attention": {"rope_type": "default",
                                               "rope_theta": 1000.0}})),
}


def make_checkpoint(path, family, **overrides):
    cfg_cls, extra = FAMILIES[family]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg_cls(**{**BASE, **overrides},
                                                                  **extra))
    model = model.float().eval()
    with torch.no_grad():  # HF initialises biases and norms to constants, which hides bugs
        for name, p in model.named_parameters():
            if name.endswith(".bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            elif "embed" in name or "lm_head" in name:
                p.normal_(0, 0.8)
            else:
                p.normal_(0, 0.08)
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = make_checkpoint(path, request.param)
    return request.param, hf, LlamaModel.load(resolve_model(path))


def test_logits_match_transformers_chunked_verified_decoded_and_batched(family):
    name, hf, ours = family
    runner = ModelRunner(ours, num_blocks=64, block_size=4)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, BASE["vocab_size"], (2, 40), generator=gen)
    with torch.no_grad():
        ref = hf(ids).logits
    tables = [list(range(30, 19, -1)), list(range(40, 51))]  # scattered blocks
    # Two chunks of prefill, a 5-token verification chunk, then decodes; both sequences in
    # each forward (a batch mixing lengths once the second's prefill runs in one piece).
    splits = [((0, 17), (0, 30)), ((17, 30), (30, 35)), ((30, 35), (35, 36))] + [
        ((i, i + 1), (i + 1, i + 2)) for i in range(35, 39)]
    got = [[], []]
    for parts in splits:
        chunks = [SeqChunk(ids[b, lo:hi].tolist(), lo, tables[b], num_logits=hi - lo)
                  for b, (lo, hi) in enumerate(parts)]
        out, at = runner.forward(chunks), 0
        for b, c in enumerate(chunks):
            got[b].append(out[at:at + c.num_logits])
            at += c.num_logits
    for b, upto in ((0, 39), (1, 40)):
        err = (torch.cat(got[b]) - ref[b, :upto]).abs().max().item()
        assert err < 2e-4, (name, b, err)


def test_greedy_text_matches_transformers_generate(family):
    name, hf, ours = family
    prompt = torch.randint(1, BASE["vocab_size"], (1, 24),
                           generator=torch.Generator().manual_seed(3))
    want = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=64,
                       do_sample=False, min_new_tokens=64, pad_token_id=0)[0, 24:].tolist()
    got = LocalGenerator(ModelRunner(ours, 64, 4)).generate(
        [prompt[0].tolist()], SamplingParams(temperature=0.0), 64)[0]
    assert got == want, name


def test_config_flags_per_family(tmp_path):
    make_checkpoint(tmp_path, "gemma3")
    cfg = LlamaConfig.from_hf(json.loads((tmp_path / "config.json").read_text()))
    assert cfg.layer_types == ("sliding_attention", "sliding_attention", "full_attention",
                               "sliding_attention")
    assert [cfg.window(i) for i in range(4)] == [10, 10, 0, 10]
    assert cfg.qk_norm and cfg.sandwich_norms and cfg.norm_offset == 1.0
    assert cfg.rope_theta == 100000.0 and cfg.rope_scaling["rope_type"] == "linear"
    assert cfg.local_rope["rope_theta"] == 1000.0 and cfg.tie_word_embeddings
    assert cfg.embed_scale == pytest.approx(48 ** 0.5) and cfg.query_scale == 0.25


@pytest.mark.parametrize("change, field", [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type='yarn'"),
    ({"hidden_act": "relu"}, "hidden_act='relu'"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"model_type": "gpt_neox"}, "model_type='gpt_neox'"),
    ({"layer_types": ["chunked_attention"] * 2}, "chunked_attention"),
    ({"vision_config": {}}, "vision_config"),
])
def test_what_cannot_be_computed_exactly_is_refused_by_name(change, field):
    cfg = {"model_type": "llama", "num_hidden_layers": 2, **change}
    assert field in unsupported(cfg)
    with pytest.raises(ModelError, match="unsupported checkpoint feature"):
        LlamaConfig.from_hf({**BASE, **cfg})


def test_windows_refuse_batch_invariant_mode(tmp_path):
    make_checkpoint(tmp_path, "mistral-window")
    with pytest.raises(ModelError, match="sliding windows"):
        LlamaModel.load(resolve_model(tmp_path), batch_invariant=True)


def test_models_inspect_says_servable_or_names_the_problem(tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    from tools.cli import main

    make_checkpoint(tmp_path, "gemma2")
    assert main(["models", "inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "servable: yes" in out and "sliding window 12 on 2 of 4 layers" in out
    assert "attention softcap" in out
    (file,) = tmp_path.glob("*.safetensors")
    tensors = load_file(file)
    tensors["model.layers.0.mlp.extra.weight"] = torch.zeros(2)
    save_file(tensors, file)
    assert main(["models", "inspect", str(tmp_path)]) == 1
    assert "layers.0.mlp.extra.weight" in capsys.readouterr().out
    del tensors["model.layers.0.mlp.extra.weight"], tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, file)
    assert main(["models", "inspect", str(tmp_path)]) == 1
    assert "missing, e.g. layers.1.mlp.up_proj.weight" in capsys.readouterr().out
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "hidden_activation": "relu"}))
    assert main(["models", "inspect", str(tmp_path)]) == 1
    assert "hidden_act='relu'" in capsys.readouterr().out


@pytest.mark.parametrize("name, rope", [
    ("llama-3.1", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
                   "rope_theta": 500000.0}),
    ("llama-3.2", {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
                   "rope_theta": 500000.0}),
])
def test_llama3_rope_matches_transformers_at_the_published_settings(name, rope):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from tandem.engine.rope import rope_inv_freq

    hf_cfg = transformers.LlamaConfig(hidden_size=4096, num_attention_heads=32,
                                      max_position_embeddings=131072, rope_parameters=rope)
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, "cpu")
    ours = LlamaConfig.from_hf({**hf_cfg.to_dict(), "model_type": "llama"})
    assert ours.rope_theta == 500000.0 and ours.rope_scaling["factor"] == rope["factor"]
    assert torch.allclose(rope_inv_freq(ours), want.float(), rtol=1e-6, atol=0), name


@pytest.mark.parametrize("skip", [(1,), (2,), (1, 3, 4)])
def test_a_gemma3_layer_skip_view_is_transformers_without_those_layers(tmp_path, skip):
    """Each kept layer keeps its own window and RoPE base (local on sliding layers, linear
    scaling on global ones), q/k norms and post-norms: equal to transformers' Gemma 3 with
    those layers deleted, in a prompt longer than the window."""
    import copy

    from tandem.engine.layer_skip import SkipSet, skip_view

    hf = make_checkpoint(tmp_path, "gemma3", num_hidden_layers=6)  # s s F s s F
    kept = [i for i in range(6) if i not in skip]
    view = skip_view(LlamaModel.load(resolve_model(tmp_path)), SkipSet(6, skip))
    assert [view.cfg.window(j) for j in range(len(kept))] == \
        [10 if i % 3 != 2 else 0 for i in kept]
    pruned = copy.deepcopy(hf)
    pruned.model.layers = torch.nn.ModuleList([pruned.model.layers[i] for i in kept])
    pruned.config.layer_types = [hf.config.layer_types[i] for i in kept]
    pruned.config.num_hidden_layers = len(kept)
    ids = [(7 * i + 3) % 101 for i in range(29)]
    with torch.no_grad():
        want = pruned(torch.tensor([ids]), use_cache=False).logits[0]
        full = hf(torch.tensor([ids]), use_cache=False).logits[0]
    got = ModelRunner(view, num_blocks=16, block_size=4).forward(
        [SeqChunk(ids, 0, list(range(8)), num_logits=len(ids))])
    assert (got - want).abs().max().item() < 2e-4
    assert (got - full).abs().max().item() > 1e-2  # the layers really are gone
