"""MTP through the gateway: an OpenAI request with speculation.method = "mtp", served by a real
verifier and a real draft worker (gRPC on loopback, Redis for the sessions) on a small random
checkpoint that carries an MTP module and the default target's tokenizer. Greedy text equals
plain decoding's, and the drafts were really verified (the default target has no MTP module,
so the cluster tests cannot cover this method)."""
import json
import shutil

import jsonschema
import pytest
import torch
import transformers
from inproc import gateway_cluster
from safetensors.torch import save_file

from draft_service.config import DraftConfig
from tandem.engine.llama import LlamaModel
from tandem.models import resolve_model
from verify_service.config import VerifierConfig

pytestmark = pytest.mark.integration
HIDDEN = 64


def mtp_checkpoint(root, target_root):
    """2 main layers + 1 MTP module (DeepSeek-V3 layout, shared head), real tokenizer."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=HIDDEN, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=512,
                                   tie_word_embeddings=True)
    transformers.LlamaForCausalLM(cfg).float().eval().save_pretrained(root)
    block = transformers.LlamaModel(transformers.LlamaConfig(**dict(
        cfg.to_dict(), num_hidden_layers=1, vocab_size=8)))
    p = "model.layers.2."
    tensors = {p + k: v.detach().clone() for k, v in block.layers[0].state_dict().items()}
    tensors |= {p + "enorm.weight": torch.ones(HIDDEN), p + "hnorm.weight": torch.ones(HIDDEN),
                p + "eh_proj.weight": torch.randn(HIDDEN, 2 * HIDDEN) * 0.1,
                p + "shared_head.norm.weight": torch.ones(HIDDEN)}
    save_file(tensors, str(root / "mtp.safetensors"))
    config = json.loads((root / "config.json").read_text())
    (root / "config.json").write_text(json.dumps(config | {"num_nextn_predict_layers": 1}))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(target_root / f, root / f)
    return root


@pytest.fixture(scope="module")
def client(tmp_path_factory, target_paths, tokenizer):
    root = mtp_checkpoint(tmp_path_factory.mktemp("mtp"), target_paths.root)
    model = LlamaModel.load(resolve_model(root))

    def verifier(draft_port):
        return VerifierConfig(model=str(root), kv_cache_mb=32, calibrate_reps=0,
                              max_draft_wait_ms=2000, layer_skip="off",
                              draft_addresses=(f"127.0.0.1:{draft_port}",))

    # the target's tokenizer: the checkpoint shares it
    with gateway_cluster(DraftConfig(port=0, mtp=str(root)), verifier, model, tokenizer,
                         "tiny-mtp") as c:
        yield c


def _answers(client, **extra) -> dict:
    out = {}
    for method in ("none", "mtp"):
        r = client.post("/v1/chat/completions", json={
            "model": "tiny-mtp", "max_tokens": 24, "temperature": 0,
            "messages": [{"role": "user", "content": "Count: one two three"}],
            "speculation": {"method": method, "num_speculative_tokens": 3}, **extra})
        assert r.status_code == 200, r.text
        out[method] = r.json()
    return out


def test_mtp_through_the_gateway_is_greedy_identical_to_plain(client):
    out = _answers(client)
    text = {m: b["choices"][0]["message"]["content"] for m, b in out.items()}
    assert text["mtp"] == text["none"] and out["mtp"]["usage"]["completion_tokens"] == 24
    assert out["mtp"]["speculation"]["drafted_tokens"] > 0  # MTP drafts were verified


def test_mtp_under_a_grammar_is_greedy_identical_and_valid(client):
    """The MTP worker drafts under the session's grammar (its chains are eagle's)."""
    schema = {"type": "object", "properties": {"n": {"type": "integer"},
                                               "w": {"enum": ["one", "two"]}},
              "required": ["n", "w"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "c", "schema": schema}}
    # The worker compiles the grammar off its loop and drafts nothing meanwhile: the first
    # answer may finish before (a cold tokenizer build); the second finds it cached.
    _answers(client, max_tokens=40, response_format=fmt)
    out = _answers(client, max_tokens=40, response_format=fmt)
    text = {m: b["choices"][0]["message"]["content"] for m, b in out.items()}
    assert text["mtp"] == text["none"]
    if out["none"]["choices"][0]["finish_reason"] == "stop":
        jsonschema.validate(json.loads(text["none"]), schema)
    assert out["mtp"]["speculation"]["drafted_tokens"] > 0
