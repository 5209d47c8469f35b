"""CUDA graphs for decode steps: one graph per (batch bucket, key-length bucket), replayed
with padded inputs.

A decode step (every sequence adds one token and wants its logits) is launch-bound on a GPU
at small batch: hundreds of small kernels per forward. A graph records them once and replays
them with one launch. Graphs need static shapes and static tensor addresses, so a step is
padded up to its bucket:

- the batch to the next of `buckets` (1, 2, 4, ..., 64): the padding rows are dummy sequences
  of one token whose key and value land in a reserved scratch block and which see only it;
- the keys each row reads to the next power-of-two multiple of the block size: positions past
  a row's own length read the scratch slot and are masked out.

The pure padding functions (bucket_for, kv_bucket, pad_decode) carry the logic and are tested
on the CPU; GraphDecoder runs the same padded forward eagerly on the CPU (`capture=False`), so
only the capture itself needs a GPU. Anything a graph does not cover (a prefill, a
verification chunk, a tree, a batch or context past the largest bucket) falls back to
ModelRunner.forward. A runner that keeps features (EAGLE's) gets them from the graph too.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kernels.paged_attention import AttentionMetadata
from tandem.engine.graph_modes import GRAPH_MODES, check_mode, measured_gain  # noqa: F401
from tandem.engine.model_runner import ModelRunner, SeqChunk

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
log = logging.getLogger(__name__)


def bucket_for(n: int, buckets: tuple[int, ...] = DEFAULT_BUCKETS) -> int | None:
    """The smallest bucket holding n rows; None past the largest."""
    if n < 1:
        raise ValueError(f"a decode batch has at least one row, got {n}")
    return next((b for b in sorted(buckets) if b >= n), None)


def kv_bucket(seq_len: int, block_size: int) -> int:
    """Keys read per row: the next power-of-two number of blocks holding seq_len."""
    if seq_len < 1 or block_size < 1:
        raise ValueError(f"seq_len and block_size must be >= 1, got {seq_len}, {block_size}")
    blocks = -(-seq_len // block_size)
    return block_size * (1 << (blocks - 1).bit_length())


@dataclass(frozen=True)
class GraphKey:
    batch: int  # padded rows
    kv_len: int  # padded keys per row

    def __post_init__(self):
        if self.batch < 1 or self.kv_len < 1:
            raise ValueError(f"a graph key needs batch and kv_len >= 1, got {self}")


@dataclass(frozen=True)
class PaddedDecode:
    """One decode step's inputs padded to a GraphKey (plain lists: built on the CPU). The
    keys' slots and mask are derived from tables and seq_lens on the device (derive_layout),
    inside the graph, so a step copies only these few numbers."""

    token_ids: list[int]  # [batch]
    positions: list[int]  # [batch]
    seq_lens: list[int]  # [batch] keys each row really has (padding rows: 1)
    tables: list[list[int]]  # [batch][kv_len // block_size] blocks, padded with the scratch
    rows: int  # the real rows, first

    def __post_init__(self):
        n = len(self.token_ids)
        widths = {len(t) for t in self.tables}
        if not (len(self.positions) == len(self.seq_lens) == len(self.tables) == n) or \
                not 0 < self.rows <= n or len(widths) != 1:
            raise ValueError("PaddedDecode fields disagree on the batch size or table width")


def derive_layout(
    tables: torch.Tensor,  # [batch, kv_len // block_size] int64
    seq_lens: torch.Tensor,  # [batch] int64
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(kv_slots [batch, kv_len], mask [batch, kv_len] bool, slot_mapping [batch]): the slot of
    every key a row reads, which of them it sees (its first seq_len), and where its new
    token's KV goes (its last). Torch ops only, no host sync: capturable."""
    kv_len = tables.shape[1] * block_size
    pos = torch.arange(kv_len, device=tables.device)  # [kv_len]
    kv_slots = tables[:, pos // block_size] * block_size + pos % block_size
    mask = pos[None, :] < seq_lens[:, None]
    slot_mapping = kv_slots.gather(1, (seq_lens - 1)[:, None]).squeeze(1)
    return kv_slots, mask, slot_mapping


def is_decode(chunks: list[SeqChunk]) -> bool:
    """A plain decode step: one chain token per sequence, its logits wanted."""
    return bool(chunks) and all(len(c.token_ids) == 1 and c.num_logits == 1 and
                                c.parents is None for c in chunks)


def pad_decode(chunks: list[SeqChunk], block_size: int, key: GraphKey,
               scratch_block: int) -> PaddedDecode:
    """A decode step padded to `key`: real rows first, then dummies on the scratch block."""
    if not is_decode(chunks) or len(chunks) > key.batch:
        raise ValueError(f"pad_decode takes at most {key.batch} one-token decode chunks")
    width = key.kv_len // block_size
    tokens, positions, lens, tables = [], [], [], []
    for c in chunks:
        seq_len = c.start_pos + 1
        if seq_len > key.kv_len or len(c.block_table) * block_size < seq_len:
            raise ValueError(f"a row of {seq_len} keys does not fit {key} / its block table")
        used = c.block_table[:-(-seq_len // block_size)]
        tokens.append(c.token_ids[0])
        positions.append(c.start_pos)
        lens.append(seq_len)
        tables.append(used + [scratch_block] * (width - len(used)))
    pad = key.batch - len(chunks)
    return PaddedDecode(tokens + [0] * pad, positions + [0] * pad, lens + [1] * pad,
                        tables + [[scratch_block] * width] * pad, len(chunks))


class _Slot:
    """One GraphKey's static input tensors, its layout and (on a GPU) its captured graph."""

    def __init__(self, runner: ModelRunner, key: GraphKey):
        dev, b, k = runner.device, key.batch, key.kv_len
        self.runner, self.key = runner, key
        self.ids = torch.zeros(b, dtype=torch.int64, device=dev)  # [batch]
        self.positions = torch.zeros(b, dtype=torch.int64, device=dev)  # [batch]
        self.logit_rows = torch.arange(b, device=dev)  # [batch]
        self.meta = AttentionMetadata(
            cu_seqlens_q=torch.arange(b + 1, device=dev),
            seq_lens=torch.ones(b, dtype=torch.int64, device=dev),
            block_tables=torch.zeros(b, k // runner.block_size, dtype=torch.int64, device=dev),
            slot_mapping=torch.zeros(b, dtype=torch.int64, device=dev),
            max_seqlen_q=1, max_seqlen_k=k,
            kv_slots=torch.zeros(b, k, dtype=torch.int64, device=dev),
            q_rows=torch.arange(b, device=dev)[:, None],
            q_valid=torch.ones(b, dtype=torch.bool, device=dev),
            mask=torch.zeros(b, 1, 1, k, dtype=torch.bool, device=dev))
        self.graph = None
        self.logits: torch.Tensor | None = None  # [batch, vocab] float32, the last run's
        self.hidden: torch.Tensor | None = None  # [batch, hidden], the last run's

    def load(self, p: PaddedDecode) -> None:
        """Copy a padded step into the static tensors (in place: the graph reads them)."""
        m = self.meta
        small = torch.tensor([p.token_ids, p.positions, p.seq_lens], dtype=torch.int64)
        for dst, src in zip((self.ids, self.positions, m.seq_lens), small.to(m.seq_lens.device)):
            dst.copy_(src)
        m.block_tables.copy_(torch.tensor(p.tables, dtype=torch.int64), non_blocking=True)

    def run(self) -> None:
        """The padded forward: the layout derived from the tables, then logits and final
        hidden states of every row, which a runner that keeps features also stores slot for
        slot (as ModelRunner.forward does)."""
        r, m = self.runner, self.meta
        kv_slots, mask, slot_mapping = derive_layout(m.block_tables, m.seq_lens, r.block_size)
        m.kv_slots.copy_(kv_slots)
        m.mask.copy_(mask[:, None, None])
        m.slot_mapping.copy_(slot_mapping)
        self.logits, self.hidden = r.model.forward(self.ids, self.positions, m, r.kv_cache,
                                                   self.logit_rows, with_hidden=True,
                                                   feature_layers=r.feature_layers)
        if r.features is not None:
            r.features.index_copy_(0, m.slot_mapping, self.hidden.to(torch.float16))

    def capture(self, pool, warmup: int = 2) -> None:
        """Record run() as a CUDA graph (the loaded inputs must be padding only: warm-up and
        capture write their KV, which then lands in the scratch block)."""
        side = torch.cuda.Stream(self.runner.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):
                self.run()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.run()


class GraphDecoder:
    """ModelRunner.forward for decode steps through per-bucket CUDA graphs.

    `scratch_block` is a KV block the block manager never hands out (the padding rows write
    there). capture=False runs the same padded forward eagerly (the CPU test of the layout).
    """

    def __init__(self, runner: ModelRunner, scratch_block: int,
                 buckets: tuple[int, ...] = DEFAULT_BUCKETS, max_kv_len: int = 0,
                 capture: bool | None = None):
        capture = runner.device.type == "cuda" if capture is None else capture
        if capture and runner.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, the runner is on {runner.device}")
        if not 0 <= scratch_block < runner.num_blocks or not buckets or min(buckets) < 1:
            raise ValueError(f"bad scratch block {scratch_block} or buckets {buckets}")
        self.runner, self.scratch_block, self.capture = runner, scratch_block, capture
        self.buckets = tuple(sorted(buckets))
        self.max_kv_len = max_kv_len or runner.model.cfg.max_position_embeddings
        self.slots: dict[GraphKey, _Slot] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.replays = self.fallbacks = 0

    def key_for(self, chunks: list[SeqChunk]) -> GraphKey | None:
        """The graph a step would replay; None: it falls back to the eager forward."""
        if not is_decode(chunks):
            return None
        batch = bucket_for(len(chunks), self.buckets)
        kv_len = kv_bucket(max(c.start_pos + 1 for c in chunks), self.runner.block_size)
        if batch is None or kv_len > self.max_kv_len:
            return None
        return GraphKey(batch, kv_len)

    @torch.inference_mode()
    def forward(self, chunks: list[SeqChunk], with_hidden: bool = False):
        """ModelRunner.forward's contract: logits [len(chunks), vocab] float32, and with
        with_hidden the rows' final hidden states [len(chunks), hidden]."""
        key = self.key_for(chunks)
        if key is None:
            self.fallbacks += 1
            return self.runner.forward(chunks, with_hidden=with_hidden)
        self._check(chunks)
        slot = self.slots.get(key) or self._new_slot(key)
        slot.load(pad_decode(chunks, self.runner.block_size, key, self.scratch_block))
        if slot.graph is not None:
            slot.graph.replay()
            self.replays += 1
        else:
            slot.run()
        n = len(chunks)
        logits = slot.logits[:n].clone()
        return (logits, slot.hidden[:n].clone()) if with_hidden else logits

    def _check(self, chunks: list[SeqChunk]) -> None:
        vocab, blocks = self.runner.model.cfg.vocab_size, self.runner.num_blocks
        for c in chunks:
            if not 0 <= c.token_ids[0] < vocab:
                raise ValueError(f"token ids must be in [0, {vocab})")
            if any(b < 0 or b >= blocks or b == self.scratch_block for b in c.block_table):
                raise ValueError(f"block table {c.block_table} has ids outside the cache "
                                 "or the scratch block")

    def _new_slot(self, key: GraphKey) -> _Slot:
        slot = _Slot(self.runner, key)
        if self.capture:
            slot.load(_all_padding(key, self.runner.block_size, self.scratch_block))
            slot.capture(self.pool)
        self.slots[key] = slot
        return slot


def _all_padding(key: GraphKey, block_size: int, scratch_block: int) -> PaddedDecode:
    """A step of padding rows only (what a graph is captured with)."""
    b = key.batch
    return PaddedDecode([0] * b, [0] * b, [1] * b,
                        [[scratch_block] * (key.kv_len // block_size)] * b, b)


def graph_decoder(mode: str, runner: ModelRunner, gpu_check_result: str = ""
                  ) -> GraphDecoder | None:
    """The verifier's GraphDecoder when `--cuda-graphs` says so (auto: on where the gpu-check
    result at `gpu_check_result` measured a gain on this GPU model, else off; on without a
    GPU: a clear error), else None. It takes the cache's last block as its scratch: the block
    manager must hand out one block fewer."""
    gain = None
    if mode == "auto" and runner.device.type == "cuda":
        gain = measured_gain(gpu_check_result, torch.cuda.get_device_name(runner.device))
    if not check_mode(mode, runner.device.type, gain):
        return None
    if runner.num_blocks < 2:
        raise ValueError("--cuda-graphs needs a KV cache of at least 2 blocks")
    log.info("cuda graphs (%s): decode steps replayed per batch bucket %s", mode,
             DEFAULT_BUCKETS)
    return GraphDecoder(runner, scratch_block=runner.num_blocks - 1)
