"""Multi-token-prediction (MTP) modules that ship inside a target checkpoint.

DeepSeek-V3's layout, on our Llama block: `config.json` says `num_nextn_predict_layers: D` and
the checkpoint holds, after the main stack's L layers, modules `model.layers.{L + i}.` with
  enorm.weight, hnorm.weight       RMSNorms of the token embedding and of the target's hidden
  eh_proj.weight [hidden, 2*hidden] fusing [enorm(embedding of token t) ; hnorm(h of t - 1)]
  input_layernorm, self_attn.*, post_attention_layernorm, mlp.*   one decoder layer
  shared_head.norm.weight          the output norm
  shared_head.head.weight          optional: else the target's LM head
  embed_tokens.weight              optional: else the target's embedding
The module predicts token t + 1 from the hidden state of position t - 1 and token t: the same
alignment as our EAGLE head, so it runs in the EAGLE proposer's machinery (draft worker, the
verifier shipping features). The hidden state it reads is the target's final *normed* one (what
vLLM's MTP path passes too); beyond the true features it feeds its own normed output back, as
vLLM does when more tokens are drafted than there are MTP layers.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from tandem.engine.checkpoint import LlamaConfig, load_tensors
from tandem.engine.eagle import EagleHead
from tandem.models import ModelError, ModelPaths, read_hf_config

MTP_LAYERS_KEY = "num_nextn_predict_layers"
_BLOCK = ("input_layernorm.", "self_attn.", "post_attention_layernorm.", "mlp.")


def mtp_layers(paths: ModelPaths) -> int:
    """How many MTP modules the checkpoint declares (0 = none)."""
    n = read_hf_config(paths).get(MTP_LAYERS_KEY) or 0
    if not isinstance(n, int) or n < 0:
        raise ModelError(f"{MTP_LAYERS_KEY} must be a non-negative integer, got {n!r}")
    return n


def _module_weights(tensors: dict[str, torch.Tensor], cfg: LlamaConfig,
                    index: int) -> tuple[dict[str, torch.Tensor], bool]:
    """Module `index`'s tensors under the names a 1-layer LlamaModel reads, and whether its
    LM head is tied to its embedding."""
    prefix = f"layers.{cfg.num_layers + index}."
    own = {k.removeprefix(prefix): v for k, v in tensors.items() if k.startswith(prefix)}
    missing = [n for n in ("enorm.weight", "hnorm.weight", "eh_proj.weight",
                           "shared_head.norm.weight") if n not in own]
    if missing:
        raise ModelError(f"MTP module {index} ({prefix}*) is missing {', '.join(missing)}")
    weights = {"layers.0." + k: v for k, v in own.items() if k.startswith(_BLOCK)}
    weights["embed_tokens.weight"] = own.get("embed_tokens.weight",
                                             tensors.get("embed_tokens.weight"))
    weights["norm.weight"] = own["shared_head.norm.weight"]
    weights["fc.weight"] = own["eh_proj.weight"]
    weights["enorm"], weights["hnorm"] = own["enorm.weight"], own["hnorm.weight"]
    head = own.get("shared_head.head.weight", tensors.get("lm_head.weight"))
    if head is not None:
        weights["lm_head.weight"] = head
    if weights["embed_tokens.weight"] is None:
        raise ModelError("checkpoint has no embed_tokens.weight for the MTP module")
    return weights, head is None


class MtpHead(EagleHead):
    """One MTP module: EAGLE's head with DeepSeek's input norms and [embedding ; hidden]."""

    def __init__(self, cfg: LlamaConfig, weights: dict[str, torch.Tensor],
                 dtype=torch.float32, device="cpu"):
        super().__init__(cfg, weights, None, dtype, device)
        on = {"device": self.model.device, "dtype": dtype}
        self.enorm = weights["enorm"].to(**on)  # [hidden]
        self.hnorm = weights["hnorm"].to(**on)  # [hidden]

    @classmethod
    def load(cls, paths: ModelPaths, dtype=torch.float32, index: int = 0,
             device="cpu") -> MtpHead:
        declared = mtp_layers(paths)
        if not 0 <= index < declared:
            raise ModelError(f"{paths.root} declares {declared} MTP module(s) "
                             f"({MTP_LAYERS_KEY}); module {index} does not exist")
        cfg = LlamaConfig.from_hf(read_hf_config(paths))
        weights, tied = _module_weights(load_tensors(paths), cfg, index)
        head = cls(replace(cfg, num_layers=1, tie_word_embeddings=tied, layer_types=()), weights,
                   dtype, device)  # the module attends over the whole context
        head.card = {"method": "mtp", "source": str(paths.root), "module": index}
        head.model.tune_kernels()
        return head

    def fuse_inputs(
        self,
        embeds: torch.Tensor,  # [n, hidden] embeddings of token t
        features: torch.Tensor,  # [n, hidden] the target's normed hidden of position t - 1
    ) -> torch.Tensor:  # [n, 2 * hidden]: DeepSeek's order, embedding first
        m = self.model
        return torch.cat([m._rms_norm(embeds, self.enorm), m._rms_norm(features, self.hnorm)],
                         dim=-1)
