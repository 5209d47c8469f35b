"""An EAGLE-style feature head: one decoder layer that drafts from the target's own features.

The target's "feature" at position t is its final normed hidden state there (the LM head's
input; the verifier ships it with each commit). The head reads, for entry t, the pair
[feature of position t-1 ; embedding of token t], fused by `fc` into one hidden vector, runs
one Llama decoder layer over its own paged KV cache (attention over the earlier entries), and
normalises the result into a *predicted* feature of position t. The LM head turns that into the
distribution of token t+1; fed back as the next entry's feature it drafts further ahead.

A head directory is a small Llama checkpoint (config.json with num_hidden_layers = 1, the
layer's weights, `norm.weight` for the output norm, `embed_tokens.weight` holding the target's
embedding rows of a truncated vocabulary in draft_vocab.json, used tied as the LM head, as the
target's are) plus `fc.weight` [hidden, 2 * hidden] and an eagle card. Tokens outside the
truncated vocabulary get probability 0 (lossless, as for the draft model).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from kernels.paged_attention import AttentionMetadata
from tandem.engine.checkpoint import LlamaConfig, load_tensors
from tandem.engine.draft_vocab import DraftVocab
from tandem.engine.llama import LlamaModel
from tandem.models import ModelError, ModelPaths, read_hf_config

EAGLE_CARD = "tandem_eagle.json"


def is_eagle_dir(root: Path) -> bool:
    return (Path(root) / EAGLE_CARD).is_file()


class EagleHead:
    """The head's weights and its functional forward over a paged KV cache (1 layer)."""

    def __init__(self, cfg: LlamaConfig, weights: dict[str, torch.Tensor],
                 draft_vocab: DraftVocab | None, dtype=torch.float32, device="cpu"):
        if cfg.num_layers != 1:
            raise ModelError(f"an EAGLE head has one decoder layer, config says {cfg.num_layers}")
        if "fc.weight" not in weights:
            raise ModelError("EAGLE head checkpoint is missing tensor 'fc.weight'")
        self.model = LlamaModel(cfg, weights, dtype, draft_vocab, device=device)
        # [hidden, 2 * hidden]
        self.fc = weights["fc.weight"].to(device=self.model.device, dtype=dtype).contiguous()
        hidden = self.model.cfg.hidden_size
        if tuple(self.fc.shape) != (hidden, 2 * hidden):
            raise ModelError(f"fc.weight has shape {tuple(self.fc.shape)}, "
                             f"expected {(hidden, 2 * hidden)}")
        self.card: dict = {}
        # The published EAGLE-1/2 layout (tandem.engine.eagle_published): fc has a bias and
        # no norm follows the layer.
        self.fc_bias: torch.Tensor | None = None
        self.out_norm = True
        self.feature_size = hidden  # the width of the target's features it reads

    reads_target_head = True  # a target feature is the LM head's input: drafts the target's

    def project(self, features: torch.Tensor) -> torch.Tensor:  # [n, hidden]
        return features  # the head reads the target's features as they are

    def draft_logits(self, h: torch.Tensor) -> torch.Tensor:  # [rows, hidden] -> [rows, vocab]
        return self.model.logits(h.to(self.model.dtype))

    def fuse_inputs(
        self,
        embeds: torch.Tensor,  # [n, hidden] embeddings of token t
        features: torch.Tensor,  # [n, hidden] features of position t - 1
    ) -> torch.Tensor:  # [n, 2 * hidden], fc's input
        return torch.cat([features, embeds], dim=-1)

    @property
    def cfg(self) -> LlamaConfig:
        return self.model.cfg  # vocab_size is the target's

    @classmethod
    def load(cls, paths: ModelPaths, dtype=torch.float32, draft_vocab: int = 0,
             device="cpu") -> EagleHead:
        """draft_vocab > 0 drafts from only the first that many rows of the head's vocabulary
        (the commonest tokens: draft_vocab.json is ordered by frequency in the training data).
        The LM head is most of a draft step's time; inputs still embed every token."""
        cfg = LlamaConfig.from_hf(read_hf_config(paths))
        head = cls(cfg, load_tensors(paths), DraftVocab.read(paths.root), dtype, device)
        try:
            head.card = json.loads((paths.root / EAGLE_CARD).read_text())
        except (OSError, ValueError) as exc:
            raise ModelError(f"cannot read {paths.root / EAGLE_CARD}: {exc}") from exc
        if draft_vocab < 0:
            raise ModelError(f"draft_vocab must be >= 0 (0 = all rows), got {draft_vocab}")
        m = head.model
        if draft_vocab and m.vocab_map is not None and draft_vocab < len(m.vocab_map):
            m.lm_head = m.lm_head[:draft_vocab]  # a view of leading rows: still contiguous
            m.vocab_map = m.vocab_map[:draft_vocab]
        m.tune_kernels()
        return head

    def forward(
        self,
        input_ids: torch.Tensor,  # [n] int64 target ids: token t of each entry
        features: torch.Tensor,  # [n, hidden] feature of position t - 1 of each entry
        positions: torch.Tensor,  # [n] int64 (t)
        meta: AttentionMetadata,
        kv_cache: list[tuple[torch.Tensor, torch.Tensor]],  # one (key, value) pair
        logits_indices: torch.Tensor,  # [m] int64 rows whose logits are returned
    ) -> tuple[torch.Tensor, torch.Tensor]:  # logits [m, vocab] float32, predicted [n, hidden]
        m = self.model
        ids = input_ids if m._input_map is None else m._input_map[input_ids]
        h = m.linear(self.fuse_inputs(m.embed[ids], features.to(m.dtype)), self.fc, self.fc_bias)
        cos, sin = m.rope_at(positions)
        (k_cache, v_cache), = kv_cache
        h = m.decoder_layer(h, m.layers[0], cos, sin, meta, k_cache, v_cache)
        predicted = m._rms_norm(h, m.final_norm) if self.out_norm else h
        return m.logits(predicted[logits_indices]), predicted
