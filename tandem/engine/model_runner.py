"""Model runner: owns the paged KV cache, flattens a batch, runs the target, returns logits.

It knows nothing of scheduling or sampling: the caller hands it, per sequence, the new tokens,
where they start and the sequence's block table (from the block manager), and how many
trailing positions it wants logits for (1 for prefill/decode, k+1 for verifying k drafts).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.paged_attention import ancestor_mask, build_attention_metadata
from tandem.engine.forward_threads import ForwardThreads, thread_invariant
from tandem.engine.llama import LlamaModel


@dataclass(frozen=True)
class SeqChunk:
    """New tokens of one sequence for one forward."""

    token_ids: list[int]  # tokens whose KV is computed now
    start_pos: int  # absolute position of token_ids[0] (= tokens already cached)
    block_table: list[int]  # covers start_pos + len(token_ids) slots
    num_logits: int = 1  # logits wanted for the last num_logits of token_ids
    # A token tree: parents[i] is the index in token_ids of token i's parent, -1 = it follows
    # the cached context. None = a chain. Slots stay consecutive; positions follow depth.
    parents: tuple[int, ...] | None = None

    def __post_init__(self):
        if not self.token_ids:
            raise ValueError("SeqChunk.token_ids is empty")
        if self.start_pos < 0:
            raise ValueError(f"SeqChunk.start_pos must be >= 0, got {self.start_pos}")
        if not 0 <= self.num_logits <= len(self.token_ids):
            raise ValueError(
                f"SeqChunk.num_logits {self.num_logits} outside [0, {len(self.token_ids)}]"
            )
        if self.parents is not None and len(self.parents) != len(self.token_ids):
            raise ValueError(f"SeqChunk.parents has {len(self.parents)} entries for "
                             f"{len(self.token_ids)} tokens")

    @property
    def is_tree(self) -> bool:
        return self.parents is not None and any(p != i - 1 for i, p in enumerate(self.parents))

    def positions(self) -> list[int]:
        """Absolute position of each token: consecutive for a chain, by depth for a tree."""
        if not self.is_tree:
            return list(range(self.start_pos, self.start_pos + len(self.token_ids)))
        pos: list[int] = []
        for i, p in enumerate(self.parents):
            if not -1 <= p < i:
                raise ValueError(f"tree token {i} has parent {p}: parents must come first")
            pos.append(self.start_pos if p < 0 else pos[p] + 1)
        return pos


def kv_bytes_per_token(model: LlamaModel) -> int:
    cfg = model.cfg
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * model.embed.element_size()


class ModelRunner:
    """A target model plus its paged KV cache of `num_blocks` blocks of `block_size` tokens."""

    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int = 16,
                 keep_features: bool = False, feature_layers: tuple[int, ...] = ()):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}"
            )
        cfg = model.cfg
        self.model = model
        self.block_size = block_size
        self.num_blocks = num_blocks
        shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        kw = {"dtype": model.dtype, "device": model.device}  # the cache lives beside the weights
        self.kv_cache = [(torch.zeros(shape, **kw), torch.zeros(shape, **kw))
                         for _ in range(cfg.num_layers)]
        # keep_features: every computed token's final hidden state too, slot for slot beside
        # its KV, float16 (about 1/40 of the KV's bytes on SmolLM2). EAGLE drafts from them,
        # so a prompt served from the prefix cache, or computed in chunks, still has every
        # position's features. [num_blocks * block_size, hidden]; with feature_layers (an
        # EAGLE-3 head's) the residual streams entering those layers instead, each hidden wide.
        self.feature_layers = tuple(feature_layers)
        width = cfg.hidden_size * max(1, len(self.feature_layers))
        self.features = (torch.zeros(num_blocks * block_size, width,
                                     dtype=torch.float16, device=model.device)
                         if keep_features else None)
        self.threads: ForwardThreads | None = None  # use_threads

    def use_threads(self, threads: ForwardThreads) -> bool:
        """Run each forward on threads.for_rows(its rows) threads, where the model gives the
        same bits at any count (forward_threads.thread_invariant); whether it will."""
        if not thread_invariant(self.model):
            return False
        self.threads = threads
        return True

    @property
    def device(self) -> torch.device:
        return self.model.device

    @classmethod
    def with_memory(cls, model: LlamaModel, kv_cache_bytes: int, block_size: int = 16,
                    keep_features: bool = False, feature_layers: tuple[int, ...] = ()):
        """Size the cache from a memory budget in bytes (the KV's; features come on top)."""
        num_blocks = kv_cache_bytes // (kv_bytes_per_token(model) * block_size)
        if num_blocks < 1:
            raise ValueError(f"kv cache budget {kv_cache_bytes} B is smaller than one block")
        return cls(model, int(num_blocks), block_size, keep_features, feature_layers)

    @torch.inference_mode()
    def forward(self, chunks: list[SeqChunk], with_hidden: bool = False):
        """Logits [sum(num_logits), vocab] float32, in chunk order. with_hidden: also the
        features of every new token (LlamaModel.forward), [sum(len(token_ids)), width]."""
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
            positions.extend(c.positions())
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
            [ancestor_mask(c.parents) if c.is_tree else None for c in chunks],
        ).to(self.device)

        def on_device(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=self.device)

        if self.threads is not None:
            self.threads.apply(len(ids))
        keep = self.features is not None
        self._before_model(chunks, with_hidden or keep)
        out = self.model.forward(on_device(ids), on_device(positions), meta, self.kv_cache,
                                 on_device(logit_rows), with_hidden=with_hidden or keep,
                                 feature_layers=self.feature_layers)
        if not keep:
            return out
        logits, hidden = out  # a tree's rows too: slots stay consecutive, as its KV's
        slots = [s for c in chunks for s in self._slots(c.block_table, c.start_pos,
                                                        c.start_pos + len(c.token_ids))]
        self.features.index_copy_(0, on_device(slots), hidden.to(torch.float16))
        return (logits, hidden) if with_hidden else logits

    def _before_model(self, chunks: list[SeqChunk], with_hidden: bool) -> None:
        """Called once the chunks are checked, just before the model runs (a tensor-parallel
        leader tells its worker ranks here: tandem.engine.tp_runner)."""

    def _slots(self, block_table: list[int], start: int, end: int) -> list[int]:
        bs = self.block_size
        if not 0 <= start <= end <= len(block_table) * bs:
            raise ValueError(f"positions [{start}, {end}) outside the block table")
        return [block_table[p // bs] * bs + p % bs for p in range(start, end)]

    def features_at(self, block_table: list[int], start: int, end: int) -> torch.Tensor:
        """The kept features of positions [start, end) of one sequence, [end - start, hidden]
        float16 (keep_features only)."""
        if self.features is None:
            raise RuntimeError("this runner keeps no features (keep_features=False)")
        idx = torch.tensor(self._slots(block_table, start, end), device=self.device)
        return self.features[idx]

    @torch.inference_mode()
    def move_kv(self, block_table: list[int], src: list[int], dst: list[int]) -> None:
        """Copy the KV at positions src to positions dst of one sequence, every layer (a tree's
        accepted path moved to consecutive positions; sources are read before any write)."""
        if len(src) != len(dst):
            raise ValueError(f"move_kv got {len(src)} sources and {len(dst)} destinations")
        pairs = [(a, b) for a, b in zip(src, dst) if a != b]
        if not pairs:
            return

        def slot(pos: int) -> int:
            return self._slots(block_table, pos, pos + 1)[0]

        from_slots = torch.tensor([slot(a) for a, _ in pairs], device=self.device)
        to_slots = torch.tensor([slot(b) for _, b in pairs], device=self.device)
        caches = [c.view(-1, *c.shape[2:]) for kv in self.kv_cache for c in kv]
        for flat in caches + ([self.features] if self.features is not None else []):
            flat.index_copy_(0, to_slots, flat[from_slots])  # the gather copies first
