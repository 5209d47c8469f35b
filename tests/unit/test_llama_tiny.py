"""Our forward vs transformers on tiny random-weight checkpoints of each supported family."""
import json

import pytest
import torch
import transformers

from tandem.engine.checkpoint import LlamaConfig
from tandem.engine.llama import LlamaModel
from tandem.engine.model_runner import ModelRunner, SeqChunk
from tandem.models import ModelError, resolve_model

pytestmark = pytest.mark.unit

TINY = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
FAMILIES = {
    "llama": (transformers.LlamaConfig, dict(tie_word_embeddings=True)),
    "llama3-rope": (transformers.LlamaConfig, dict(rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16}, rope_theta=500000.0)),
    "linear-rope": (transformers.LlamaConfig, dict(rope_scaling={"rope_type": "linear",
                                                                 "factor": 2.0})),
    "qwen2": (transformers.Qwen2Config, dict(tie_word_embeddings=False)),
    "mistral": (transformers.MistralConfig, dict(sliding_window=None)),
}


def make_checkpoint(tmp_path, family):
    cfg_cls, extra = FAMILIES[family]
    torch.manual_seed(0)
    cfg = cfg_cls(**TINY, **extra)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():  # random biases: HF initialises them to zero, which hides bugs
        for name, p in model.named_parameters():
            if name.endswith(".bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(tmp_path)
    return model


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_match_transformers(tmp_path, family):
    hf = make_checkpoint(tmp_path, family)
    ours = LlamaModel.load(resolve_model(tmp_path))
    runner = ModelRunner(ours, num_blocks=32, block_size=4)
    ids = torch.randint(0, TINY["vocab_size"], (40,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    table = list(range(31, 21, -1))  # 10 scattered blocks
    # Prefill in two chunks, then a 5-token "verification" chunk, then 1-token decodes.
    splits = [(0, 17), (17, 30), (30, 35)] + [(i, i + 1) for i in range(35, 40)]
    got = torch.cat([
        runner.forward([SeqChunk(ids[a:b].tolist(), a, table, num_logits=b - a)])
        for a, b in splits
    ])
    assert (got - ref).abs().max().item() < 1e-4


def test_qwen2_biases_are_used(tmp_path):
    make_checkpoint(tmp_path, "qwen2")
    cfg = LlamaConfig.from_hf(json.loads((tmp_path / "config.json").read_text()))
    assert cfg.qkv_bias and not cfg.tie_word_embeddings


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(ModelError, match="does not exist"):
        resolve_model(tmp_path / "nope")
    with pytest.raises(ModelError, match="no config.json"):
        resolve_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ModelError, match="safetensors"):
        resolve_model(tmp_path)


def test_unsupported_architecture_is_a_clear_error(tmp_path):
    cfg = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(tmp_path)
    with pytest.raises(ModelError, match="unsupported architecture model_type='gpt2'"):
        LlamaModel.load(resolve_model(tmp_path))


def test_config_validation():
    with pytest.raises(ValueError, match="not divisible"):
        LlamaConfig.from_hf(dict(TINY, num_key_value_heads=3, model_type="llama"))
    with pytest.raises(ValueError, match="rope_type=.yarn."):
        LlamaConfig.from_hf(dict(TINY, model_type="llama", rope_scaling={"rope_type": "yarn"}))


def test_runner_rejects_bad_chunks(tmp_path):
    make_checkpoint(tmp_path, "llama")
    runner = ModelRunner(LlamaModel.load(resolve_model(tmp_path)), num_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="empty"):
        SeqChunk([], 0, [0])
    with pytest.raises(ValueError, match="num_logits"):
        SeqChunk([1, 2], 0, [0], num_logits=3)
    with pytest.raises(ValueError, match="outside the cache"):
        runner.forward([SeqChunk([1], 0, [9])])
    with pytest.raises(ValueError, match="token ids"):
        runner.forward([SeqChunk([500], 0, [0])])
    with pytest.raises(ValueError, match="context"):
        runner.forward([SeqChunk([1], 200, [0])])
    with pytest.raises(ValueError, match="at least one"):
        runner.forward([])
