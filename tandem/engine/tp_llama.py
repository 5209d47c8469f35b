"""One rank's shard of a tensor-parallel LlamaModel (tandem.engine.tp has the split).

The forward is LlamaModel's with four hooks replaced: the embedding looks up this rank's
vocabulary rows and all-reduces (exactly one rank adds a non-zero row), attention's output
and the MLP's down projection each end in one all-reduce of the partial sums, and the LM
head's vocabulary shards are all-gathered. Every rank then holds the same residual stream,
so norms, RoPE and the features EAGLE drafts from need no communication.
"""
from __future__ import annotations

import torch

from tandem.engine.checkpoint import LlamaConfig
from tandem.engine.draft_vocab import DraftVocab
from tandem.engine.llama import LayerWeights, LlamaModel
from tandem.engine.tp import TPGroup, check_shardable, load_shard, local_config, vocab_rows
from tandem.models import ModelError, ModelPaths, read_hf_config


class TPLlamaModel(LlamaModel):
    """`cfg` is this rank's shape (its heads, KV heads, MLP columns; the full vocab_size);
    `full_cfg` the checkpoint's."""

    def __init__(self, cfg: LlamaConfig, shard: dict[str, torch.Tensor], group: TPGroup,
                 dtype: torch.dtype | str = torch.float32, batch_invariant: bool = False,
                 device: torch.device | str = "cpu"):
        """`cfg` the checkpoint's, `shard` this rank's tensors (tandem.engine.tp.shard_weights
        or load_shard)."""
        self.group, self.full_cfg = group, cfg
        super().__init__(local_config(cfg, group.world_size), shard, dtype,
                         batch_invariant=batch_invariant, device=device)
        self.vocab_start = group.rank * vocab_rows(cfg.vocab_size, group.world_size)
        # rows of this shard inside the vocabulary (the last shard's padding is not)
        self.vocab_owned = max(0, min(self.embed.shape[0], cfg.vocab_size - self.vocab_start))

    @classmethod
    def load(cls, paths: ModelPaths, group: TPGroup, dtype: torch.dtype | str = torch.float32,
             tune: bool = True, batch_invariant: bool = False,
             device: torch.device | str = "cpu") -> TPLlamaModel:
        if DraftVocab.read(paths.root) is not None:
            raise ModelError("a truncated draft vocabulary is a draft's, not a tensor-parallel "
                             "target's")
        cfg = LlamaConfig.from_hf(read_hf_config(paths))
        check_shardable(cfg, group.world_size)  # before any tensor is read
        model = cls(cfg, load_shard(paths, group), group, dtype, batch_invariant, device)
        if tune or batch_invariant:
            model.tune_kernels()
        return model

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # [n] -> [n, hidden]
        local = input_ids - self.vocab_start
        owned = (local >= 0) & (local < self.vocab_owned)  # [n]
        rows = self.embed[local.clamp(0, self.embed.shape[0] - 1)]
        return self.group.all_reduce(torch.where(owned[:, None], rows, rows.new_zeros(())))

    def _attn_out(self, attn: torch.Tensor, layer: LayerWeights) -> torch.Tensor:
        # attn [n, local_heads * head_dim] -> [n, hidden]; the bias once, after the sum
        out = self.group.all_reduce(self.linear(attn, layer.o))
        return out if layer.o_bias is None else out + layer.o_bias

    def _mlp(self, x: torch.Tensor, layer: LayerWeights) -> torch.Tensor:  # [n, hidden]
        return self.group.all_reduce(super()._mlp(x, layer))

    def _head(self, h: torch.Tensor) -> torch.Tensor:  # [rows, hidden] -> [rows, vocab] fp32
        shards = self.group.all_gather_columns(self.linear(h, self.lm_head))
        return shards[:, :self.cfg.vocab_size].float()  # the last shard's padding dropped
