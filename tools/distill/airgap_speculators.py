"""Writing EAGLE-3 heads in the speculators format (vllm-project/speculators; what vLLM loads
with `--speculative-config '{"method": "eagle3", "model": DIR}'` and
tandem.engine.eagle_speculators reads). The standard library and safetensors only: the
air-gapped script writes its heads with it too.

The layout: config.json (`speculators_model_type` "eagle3", `transformer_layer_config`, the
`speculators_config` with a greedy proposal method and the verifier, `draft_vocab_size`,
`norm_before_residual`, `target_hidden_size`, `eagle_aux_hidden_state_layer_ids` in vLLM's
reading: the stream entering target layer i) and model.safetensors with the decoder layer as
`layers.0.*` (the published layout's `midlayer.*`), `fc`, `norm`, `lm_head`, `d2t`, `t2d` and
`embed_tokens` when the head has its own.
"""
from __future__ import annotations

import json
from pathlib import Path

SPECULATORS_VERSION = "0.9.0"  # the speculators release whose config classes this follows
LAYER_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
              "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters",
              "vocab_size", "max_position_embeddings", "hidden_act", "attention_bias",
              "bos_token_id", "eos_token_id")


def speculators_config(layer: dict, draft_vocab: int, vllm_layer_ids, verifier: dict,
                       k: int = 3, norm_before_residual: bool = False) -> dict:
    """config.json of an EAGLE-3 head: `layer` the decoder layer's HF fields (the target's
    widths), `vllm_layer_ids` the target layers in vLLM's reading, `verifier` {"name_or_path",
    "architectures"}, k the default proposal's speculative_tokens."""
    tl = {key: layer[key] for key in LAYER_KEYS if layer.get(key) is not None}
    theta = (layer.get("rope_parameters") or {}).get("rope_theta")
    if theta is not None:  # spelled for runtimes that read only rope_theta
        tl.setdefault("rope_theta", theta)
    tl.update(model_type="llama", architectures=["LlamaForCausalLM"], num_hidden_layers=1,
              tie_word_embeddings=False)
    return {
        "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION, "transformer_layer_config": tl,
        "draft_vocab_size": int(draft_vocab), "norm_before_residual": norm_before_residual,
        "target_hidden_size": None, "norm_before_fc": False, "fc_norm": False,
        "norm_output": False, "torch_dtype": "float16",
        "eagle_aux_hidden_state_layer_ids": [int(i) for i in vllm_layer_ids],
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(k),
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier.get("name_or_path"),
                         "architectures": list(verifier.get("architectures") or [])},
        },
    }


def speculators_names(tensors: dict) -> dict:
    """The published layout's tensor names (`midlayer.*`) as speculators names them."""
    return {("layers.0." + n[len("midlayer."):] if n.startswith("midlayer.") else n): t
            for n, t in tensors.items()}


def write_eagle3(out: Path, config: dict, tensors: dict) -> None:
    """config.json and model.safetensors (tensors in either naming) into `out`."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    named = {n: t.contiguous() for n, t in speculators_names(tensors).items()}
    save_file(named, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
