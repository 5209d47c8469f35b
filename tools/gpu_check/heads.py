"""Random-weight drafting heads over a gpu-check target: an EAGLE head (one decoder layer and
`fc`, in Tandem's format) and Medusa heads (a tree of 5 nodes over 3 heads). Their drafts are
poor, which is fine: what is checked is that speculation with them gives plain decoding's text.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from tandem.engine.eagle import EagleHead
from tandem.engine.llama import LlamaModel
from tandem.engine.medusa import MedusaConfig, MedusaHeads
from tools.gpu_check.models import random_weights

MEDUSA_TREE = ((0,), (1,), (0, 0), (0, 1), (0, 0, 0))


def eagle_head(target: LlamaModel, seed: int = 1) -> EagleHead:
    """An EAGLE head for `target`, drawn on the CPU in fp32, placed beside the target."""
    cfg = replace(target.cfg, num_layers=1, layer_types=(), sliding_window=0)
    weights = random_weights(cfg, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    weights["fc.weight"] = torch.randn(cfg.hidden_size, 2 * cfg.hidden_size, generator=gen) * 0.08
    return EagleHead(cfg, weights, None, target.dtype, target.device)


def medusa_heads(target: LlamaModel, seed: int = 2) -> MedusaHeads:
    """Medusa heads on `target`'s LM head (every token id), one residual layer each."""
    cfg = MedusaConfig(num_heads=3, num_layers=1, hidden_size=target.cfg.hidden_size,
                       vocab_ids=tuple(range(target.cfg.vocab_size)), choices=MEDUSA_TREE)
    heads = MedusaHeads(cfg, target.lm_head.detach().float().cpu())
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        heads.weight.copy_(torch.randn(heads.weight.shape, generator=gen) * 0.05)
    return heads.to(target.device)
