"""The decoder families Tandem computes exactly, and how each one's HF config.json maps onto
one LlamaConfig (tandem.engine.checkpoint): the forward (tandem.engine.llama) reads feature
flags, never family names.

| family          | beyond Llama                                                            |
|-----------------|-------------------------------------------------------------------------|
| mistral         | a sliding window on every layer (`sliding_window`)                      |
| qwen2           | q/k/v biases; a window on layers >= `max_window_layers` if enabled      |
| qwen3           | per-head RMSNorm of q and k before RoPE (`q_norm`, `k_norm`), head_dim  |
| gemma2          | (1 + w) norms, embeddings x sqrt(hidden), GeGLU (tanh), pre/post-attention |
|                 | and -feedforward norms, query_pre_attn_scalar, attention and final      |
|                 | logit softcapping, sliding and global layers alternating                |
| gemma3(_text)   | gemma2 minus softcapping, plus q/k norms, a sliding/global layer pattern |
|                 | and a separate RoPE base for the sliding layers                         |

A config field Tandem cannot compute exactly is refused here, by name (`unsupported`), so
`tandem models inspect` and every loader say the same thing.
"""
from __future__ import annotations

SLIDING, FULL = "sliding_attention", "full_attention"
GEMMA = ("gemma2", "gemma3", "gemma3_text")
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", *GEMMA)
ROPE_TYPES = ("default", "linear", "llama3")
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


def text_config(hf: dict) -> dict:
    """The decoder's config: a multimodal Gemma 3 checkpoint nests it under text_config."""
    inner = hf.get("text_config")
    if hf.get("model_type") == "gemma3" and isinstance(inner, dict):
        return {"model_type": "gemma3_text", **inner}
    return hf


def rope_of(hf: dict, layer_type: str = FULL) -> dict:
    """The RoPE parameters of a layer type, in one shape whatever the transformers version:
    {"rope_type", "rope_theta", ...scaling}."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    if isinstance(params.get(layer_type), dict):  # transformers 5 Gemma 3: per layer type
        params = dict(params[layer_type])
    elif any(isinstance(v, dict) for v in params.values()):
        params = dict(params.get(FULL) or {})
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params.pop("type")
    params.setdefault("rope_type", "default")
    if "rope_theta" not in params:
        local = layer_type == SLIDING and hf.get("model_type") in GEMMA
        params["rope_theta"] = (hf.get("rope_local_base_freq", 10_000.0) if local else
                                hf.get("rope_theta", 1_000_000.0 if hf.get("model_type") in
                                       ("gemma3", "gemma3_text") else 10_000.0))
    return params


def layer_types(hf: dict) -> tuple[str, ...]:
    """Each layer's attention: sliding-window or full."""
    n, kind = hf["num_hidden_layers"], hf.get("model_type")
    given = hf.get("layer_types")
    if given:
        return tuple(given)
    if not hf.get("sliding_window"):
        return (FULL,) * n
    if kind == "mistral":
        return (SLIDING,) * n
    if kind in ("qwen2", "qwen3"):
        if not hf.get("use_sliding_window"):
            return (FULL,) * n
        first = hf.get("max_window_layers", n)
        return tuple(SLIDING if i >= first else FULL for i in range(n))
    if kind == "gemma2":
        return tuple(SLIDING if (i + 1) % 2 else FULL for i in range(n))
    if kind in ("gemma3", "gemma3_text"):
        every = hf.get("sliding_window_pattern", 6)
        return tuple(SLIDING if (i + 1) % every else FULL for i in range(n))
    return (FULL,) * n


def unsupported(hf: dict) -> str | None:
    """The first feature of this config Tandem cannot compute exactly, named; None if every
    one is served."""
    if hf.get("vision_config") is not None:
        return "vision_config (a multimodal checkpoint: serve its text model alone)"
    hf = text_config(hf)
    kind = hf.get("model_type")
    if kind not in FAMILIES:
        return f"model_type={kind!r} (served: {', '.join(FAMILIES)})"
    types = set(layer_types(hf))
    for kind_of_layer in {FULL, SLIDING} & types:
        rope = rope_of(hf, kind_of_layer)
        if rope["rope_type"] not in ROPE_TYPES:
            return (f"rope scaling rope_type={rope['rope_type']!r} (served: "
                    f"{', '.join(ROPE_TYPES)})")
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "silu"
    if kind in GEMMA:
        act = hf.get("hidden_activation") or "gelu_pytorch_tanh"
    if act not in ACTIVATIONS:
        return f"hidden_act={act!r} (served: {', '.join(ACTIVATIONS)})"
    if hf.get("mlp_bias"):
        return "mlp_bias=true"
    if hf.get("use_bidirectional_attention"):
        return "use_bidirectional_attention=true"
    if types - {FULL, SLIDING}:
        return f"layer_types {sorted(types - {FULL, SLIDING})}"
    return None
