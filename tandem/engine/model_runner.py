"""Model runner: owns the paged KV cache, flattens a batch, runs the target, returns logits.

It knows nothing of scheduling or sampling: the caller hands it, per sequence, the new tokens,
where they start and the sequence's block table (from the block manager), and how many
trailing positions it wants logits for (1 for prefill/decode, k+1 for verifying k drafts).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.paged_attention import build_attention_metadata
from tandem.engine.llama import LlamaModel


@dataclass(frozen=True)
class SeqChunk:
    """New tokens of one sequence for one forward."""

    token_ids: list[int]  # tokens whose KV is computed now
    start_pos: int  # absolute position of token_ids[0] (= tokens already cached)
    block_table: list[int]  # covers start_pos + len(token_ids) slots
    num_logits: int = 1  # logits wanted for the last num_logits of token_ids

    def __post_init__(self):
        if not self.token_ids:
            raise ValueError("SeqChunk.token_ids is empty")
        if self.start_pos < 0:
            raise ValueError(f"SeqChunk.start_pos must be >= 0, got {self.start_pos}")
        if not 0 <= self.num_logits <= len(self.token_ids):
            raise ValueError(
                f"SeqChunk.num_logits {self.num_logits} outside [0, {len(self.token_ids)}]"
            )


def kv_bytes_per_token(model: LlamaModel) -> int:
    cfg = model.cfg
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * model.embed.element_size()


class ModelRunner:
    """A target model plus its paged KV cache of `num_blocks` blocks of `block_size` tokens."""

    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int = 16):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}"
            )
        cfg = model.cfg
        self.model = model
        self.block_size = block_size
        self.num_blocks = num_blocks
        shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.kv_cache = [
            (torch.zeros(shape, dtype=model.dtype), torch.zeros(shape, dtype=model.dtype))
            for _ in range(cfg.num_layers)
        ]

    @classmethod
    def with_memory(cls, model: LlamaModel, kv_cache_bytes: int, block_size: int = 16):
        """Size the cache from a memory budget in bytes."""
        num_blocks = kv_cache_bytes // (kv_bytes_per_token(model) * block_size)
        if num_blocks < 1:
            raise ValueError(f"kv cache budget {kv_cache_bytes} B is smaller than one block")
        return cls(model, int(num_blocks), block_size)

    @torch.inference_mode()
    def forward(self, chunks: list[SeqChunk], with_hidden: bool = False):
        """Logits [sum(num_logits), vocab] float32, in chunk order. with_hidden: also the
        final normed hidden state of every new token, [sum(len(token_ids)), hidden]."""
        if not chunks:
            raise ValueError("forward needs at least one SeqChunk")
        max_pos = self.model.cfg.max_position_embeddings
        ids, positions, logit_rows = [], [], []
        for c in chunks:
            end = c.start_pos + len(c.token_ids)
            if end > max_pos:
                raise ValueError(f"sequence length {end} exceeds the model's context {max_pos}")
            if any(b < 0 or b >= self.num_blocks for b in c.block_table):
                raise ValueError(f"block table {c.block_table} has ids outside the cache")
            base = len(ids)
            ids.extend(c.token_ids)
            positions.extend(range(c.start_pos, end))
            end_row = base + len(c.token_ids)
            logit_rows.extend(range(end_row - c.num_logits, end_row))
        vocab = self.model.cfg.vocab_size
        if any(t < 0 or t >= vocab for t in ids):
            raise ValueError(f"token ids must be in [0, {vocab})")
        meta = build_attention_metadata(
            [len(c.token_ids) for c in chunks],
            [c.start_pos + len(c.token_ids) for c in chunks],
            [c.block_table for c in chunks],
            self.block_size,
        )
        return self.model.forward(
            torch.tensor(ids, dtype=torch.int64),
            torch.tensor(positions, dtype=torch.int64),
            meta,
            self.kv_cache,
            torch.tensor(logit_rows, dtype=torch.int64),
            with_hidden=with_hidden,
        )
