"""The second real model: Gemma 3 270M, assembled from its GGUF pieces on the package index
(checked by hash), dequantized once, served by our forward with logits and greedy text equal to
transformers' Gemma 3 on the same dequantized weights, and speculation lossless on it."""
from pathlib import Path

import pytest
import torch

from tandem.engine.generate import LocalGenerator
from tandem.engine.model_runner import ModelRunner, SeqChunk
from tandem.models import ModelPaths, generation_eos_ids
from tandem.sampling_params import SamplingParams

pytestmark = pytest.mark.integration
# The base model (no chat template): prompts it continues
PROMPTS = ["Three rivers in Europe are the", "the cat sat on the mat. the cat sat on the",
           "12 times 7 is"]


@pytest.fixture(scope="module")
def gemma(gemma_paths, gemma_model, gemma_tokenizer):
    from transformers import AutoModelForCausalLM

    paths, tok = gemma_paths, gemma_tokenizer
    hf = AutoModelForCausalLM.from_pretrained(str(paths.root), dtype=torch.float32).eval()
    assert not tok.chat_template  # a base model: chat needs --chat-template
    ids = [tok(p).input_ids for p in PROMPTS]
    return paths, tok, hf, gemma_model, ids


def test_the_gguf_is_a_gemma3_checkpoint_tandem_serves(gemma):
    from tandem.engine.inspect import inspect

    paths, _, _, ours, _ = gemma
    ok, lines = inspect(paths.root)
    assert ok, lines
    cfg = ours.cfg
    assert cfg.model_type == "gemma3_text" and cfg.qk_norm and cfg.sliding_window
    assert cfg.local_rope and cfg.tie_word_embeddings


def test_logits_and_greedy_text_match_transformers(gemma):
    _, tok, hf, ours, ids = gemma
    with torch.no_grad():
        ref = hf(torch.tensor([ids[0]])).logits[0]
    runner = ModelRunner(ours, 64, 16)
    got = runner.forward([SeqChunk(ids[0], 0, list(range(8)), num_logits=len(ids[0]))])
    assert (got - ref).abs().max().item() < 2e-3
    eos = (tok.convert_tokens_to_ids("<end_of_turn>"), tok.eos_token_id)
    assert generation_eos_ids(ModelPaths(Path(hf.name_or_path))) == (1, eos[0])
    want = [hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                        max_new_tokens=24, do_sample=False, eos_token_id=list(eos),
                        pad_token_id=tok.pad_token_id)[0, len(p):].tolist() for p in ids]
    mine = LocalGenerator(ModelRunner(ours, 64, 16)).generate(
        ids, SamplingParams(temperature=0.0), 24, eos)
    for w, m in zip(want, mine):
        assert m == w[:len(m)] and len(m) == len(w), (tok.decode(w), tok.decode(m))
