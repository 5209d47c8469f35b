"""Paged attention for a flattened variable-length batch (CPU torch reference).

Every sequence in the batch contributes `q_len` new tokens (1 for decode, k+1 for verification,
many for prefill) laid out back to back (cumulative offsets `cu_seqlens_q`). Their keys and
values are written into a paged cache through `slot_mapping`; each query then attends causally
to its own sequence's cached keys through its block table. The CUDA path in `kernels.flash` is
checked against this one.

Token trees: a sequence's new tokens may be the nodes of a draft tree (parents before
children) instead of a chain. They still take consecutive cache slots, but node i sees only the
context and its own ancestors (`tree_masks[b]`, [q, q] ancestor-or-self), and its position
(RoPE) is its depth, which the caller passes; after verification the accepted path's KV is
moved into place (tandem.engine.model_runner.ModelRunner.move_kv).
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class AttentionMetadata:
    """Per-forward layout, built once and shared by every layer."""

    cu_seqlens_q: torch.Tensor  # [batch + 1] int64, offsets of each sequence's new tokens
    seq_lens: torch.Tensor  # [batch] int64, context length incl. the new tokens
    block_tables: torch.Tensor  # [batch, max_blocks] int64, padded with 0
    slot_mapping: torch.Tensor  # [num_tokens] int64, cache slot of each new token
    max_seqlen_q: int
    max_seqlen_k: int
    # Derived gather/mask tensors for the CPU path (see build_attention_metadata).
    kv_slots: torch.Tensor  # [batch, max_seqlen_k] int64, slot of every key position
    q_rows: torch.Tensor  # [batch, max_seqlen_q] int64, row in the flat batch (padded: 0)
    q_valid: torch.Tensor  # [batch * max_seqlen_q] bool, which padded rows are real
    # [batch, 1, max_seqlen_q, max_seqlen_k] bool; None = no mask, or one per group (below)
    mask: torch.Tensor | None
    has_tree: bool = False  # some sequence's new tokens are a tree (an explicit mask needed)
    # A batch mixing 1-token rows (decode) with longer ones (prefill chunks, verification):
    # the torch path attends each kind apart, so decode rows are not padded to the longest
    # query. (flat token rows of the group [n] int64, the group's own layout); () = one group.
    groups: tuple[tuple[torch.Tensor, AttentionMetadata], ...] = ()
    # With a tree: which of its sequence's new tokens each row sees ([num_tokens, max_q] bool,
    # a chain's rows causal), for kernels that read the context unmasked (attention_cpu).
    new_visible: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return int(self.seq_lens.shape[0])

    def to(self, device: torch.device) -> AttentionMetadata:
        """The same layout on `device` (built on the CPU from Python lists, then copied once
        per forward rather than once per layer)."""
        if self.seq_lens.device == torch.device(device):
            return self
        moved = {f.name: getattr(self, f.name).to(device, non_blocking=True)
                 for f in fields(self) if isinstance(getattr(self, f.name), torch.Tensor)}
        groups = tuple((rows.to(device), m.to(device)) for rows, m in self.groups)
        return replace(self, **moved, groups=groups)


def _check_int_list(name: str, values, minimum: int) -> None:
    if any((not isinstance(v, int)) or v < minimum for v in values):
        raise ValueError(f"{name} must be integers >= {minimum}, got {list(values)}")


def ancestor_mask(parents: list[int] | tuple[int, ...]) -> torch.Tensor:
    """[q, q] bool: row i is true at i and every ancestor of i. parents[i] < i is node i's
    parent among the new tokens, -1 for a node hanging off the cached context."""
    q = len(parents)
    mask = torch.eye(q, dtype=torch.bool)
    for i, p in enumerate(parents):
        if not -1 <= p < i:
            raise ValueError(f"tree node {i} has parent {p}: parents must come first")
        if p >= 0:
            mask[i] |= mask[p]
    return mask


def _check_layout(
    q_lens: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    tree_masks: list[torch.Tensor | None] | None,
) -> list[tuple[int, torch.Tensor]]:
    """ValueError naming what is wrong; else the (sequence, tree mask) pairs given."""
    if not (len(q_lens) == len(seq_lens) == len(block_tables)) or not q_lens:
        raise ValueError(
            f"q_lens, seq_lens and block_tables must be non-empty and equally long, got "
            f"{len(q_lens)}, {len(seq_lens)}, {len(block_tables)}"
        )
    _check_int_list("q_lens", q_lens, 1)
    _check_int_list("seq_lens", seq_lens, 1)
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    for i, (q, s, table) in enumerate(zip(q_lens, seq_lens, block_tables)):
        if q > s:
            raise ValueError(f"sequence {i}: {q} new tokens exceed its context length {s}")
        if len(table) * block_size < s:
            raise ValueError(
                f"sequence {i}: block table of {len(table)} blocks cannot hold {s} tokens"
            )
    trees = [(i, t) for i, t in enumerate(tree_masks or ()) if t is not None]
    for i, tree in trees:
        if tuple(tree.shape) != (q_lens[i], q_lens[i]):
            raise ValueError(f"sequence {i}: tree mask {tuple(tree.shape)} for {q_lens[i]} "
                             "new tokens")
    return trees


def build_attention_metadata(
    q_lens: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    tree_masks: list[torch.Tensor | None] | None = None,
) -> AttentionMetadata:
    """Layout for sequences with `q_lens[i]` new tokens ending at context length `seq_lens[i]`;
    tree_masks[i], if given, is sequence i's [q_i, q_i] ancestor mask (see ancestor_mask)."""
    trees = _check_layout(q_lens, seq_lens, block_tables, block_size, tree_masks)
    batch, max_q, max_k = len(q_lens), max(q_lens), max(seq_lens)
    max_blocks = max(len(t) for t in block_tables)
    tables = torch.zeros(batch, max_blocks, dtype=torch.int64)
    for i, table in enumerate(block_tables):
        tables[i, : len(table)] = torch.tensor(table, dtype=torch.int64)
    q_len_t = torch.tensor(q_lens, dtype=torch.int64)
    seq_len_t = torch.tensor(seq_lens, dtype=torch.int64)
    cu = torch.zeros(batch + 1, dtype=torch.int64)
    cu[1:] = torch.cumsum(q_len_t, 0)

    pos_k = torch.arange(max_k)
    kv_slots = tables.gather(1, (pos_k // block_size).expand(batch, -1).clamp(max=max_blocks - 1))
    kv_slots = kv_slots * block_size + pos_k % block_size  # [batch, max_k]
    slot_mapping = torch.cat(
        [kv_slots[i, s - q : s] for i, (q, s) in enumerate(zip(q_lens, seq_lens))]
    )

    pos_q = torch.arange(max_q)
    q_valid = pos_q[None, :] < q_len_t[:, None]  # [batch, max_q]
    q_rows = torch.where(q_valid, cu[:-1, None] + pos_q[None, :], 0)
    groups, mask = (), None
    if batch > 1 and max_q > 1 and min(q_lens) == 1:  # each group has its own mask
        groups = tuple(_group(sel, q_lens, seq_lens, block_tables, block_size, tree_masks, cu)
                       for sel in ([i for i, q in enumerate(q_lens) if q == 1],
                                   [i for i, q in enumerate(q_lens) if q > 1]))
    elif trees or not (batch == 1 and max_q in (1, max_k)):
        mask = _mask(q_len_t, seq_len_t, q_valid, pos_q, pos_k)
        for i, tree in trees:
            q, s = q_lens[i], seq_lens[i]
            mask[i, :q, s - q:s] = tree
    new_visible = None
    if trees:
        row_seq = torch.repeat_interleave(torch.arange(batch), q_len_t)
        new_visible = pos_q[None, :] <= (torch.arange(int(cu[-1])) - cu[row_seq])[:, None]
        for i, tree in trees:
            new_visible[int(cu[i]):int(cu[i + 1]), :q_lens[i]] = tree
    return AttentionMetadata(
        cu_seqlens_q=cu,
        seq_lens=seq_len_t,
        block_tables=tables,
        slot_mapping=slot_mapping,
        max_seqlen_q=max_q,
        max_seqlen_k=max_k,
        kv_slots=kv_slots,
        q_rows=q_rows,
        q_valid=q_valid.reshape(-1),
        mask=None if mask is None else mask[:, None],
        has_tree=bool(trees),
        groups=groups,
        new_visible=new_visible,
    )


def _mask(
    q_len_t: torch.Tensor,  # [batch] int64
    seq_len_t: torch.Tensor,  # [batch] int64
    q_valid: torch.Tensor,  # [batch, max_q] bool
    pos_q: torch.Tensor,  # [max_q] int64
    pos_k: torch.Tensor,  # [max_k] int64
) -> torch.Tensor:  # [batch, max_q, max_k] bool
    """Causal over each sequence's own keys. Query i of sequence b sits at absolute position
    seq_len - q_len + i and sees keys <= it."""
    q_abs = (seq_len_t - q_len_t)[:, None] + pos_q[None, :]  # [batch, max_q]
    mask = pos_k[None, None, :] <= q_abs[:, :, None]
    mask &= pos_k[None, None, :] < seq_len_t[:, None, None]
    # Padded query rows see key 0 only, so softmax stays finite; their output is dropped.
    mask |= (~q_valid[:, :, None]) & (pos_k[None, None, :] == 0)
    return mask


def per_group(attend, query, key_cache, value_cache, meta: AttentionMetadata, scale: float):
    """`attend` over each group of a mixed batch apart, scattered back into the flat rows."""
    out = torch.empty_like(query)
    for rows, group in meta.groups:
        out[rows] = attend(query[rows], key_cache, value_cache, group, scale)
    return out


def _group(sel: list[int], q_lens, seq_lens, block_tables, block_size, tree_masks,
           cu: torch.Tensor) -> tuple[torch.Tensor, AttentionMetadata]:
    """The layout of the sequences `sel` alone, and their rows in the whole flat batch."""
    rows = torch.cat([torch.arange(int(cu[i]), int(cu[i + 1])) for i in sel])
    trees = [tree_masks[i] for i in sel] if tree_masks else None
    return rows, build_attention_metadata([q_lens[i] for i in sel], [seq_lens[i] for i in sel],
                                          [block_tables[i] for i in sel], block_size, trees)


def write_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> None:
    """Store the new tokens' keys and values in their cache slots."""
    kvh, dim = key_cache.shape[2], key_cache.shape[3]
    key_cache.view(-1, kvh, dim).index_copy_(0, slot_mapping, key)
    value_cache.view(-1, kvh, dim).index_copy_(0, slot_mapping, value)


def gather_blocks(cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """[batch, kv_heads, max_seqlen_k, dim]: each sequence's cache blocks copied whole, in
    table order (the same values as a gather of meta.kv_slots, a quarter of its time here:
    one copy per block, not one per slot; a batched step ran it in every layer)."""
    batch, num_blocks = meta.block_tables.shape
    _, block_size, kvh, dim = cache.shape
    rows = cache.index_select(0, meta.block_tables.reshape(-1))
    return rows.view(batch, num_blocks * block_size, kvh, dim)[:, :meta.max_seqlen_k
                                                                ].transpose(1, 2)


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Causal attention of each sequence's new queries over its cached keys (GQA aware)."""
    if meta.groups:
        return per_group(paged_attention, query, key_cache, value_cache, meta, scale)
    _, heads, dim = query.shape
    kvh = key_cache.shape[2]
    if heads % kvh:
        raise ValueError(f"num_heads {heads} is not a multiple of num_kv_heads {kvh}")
    batch, max_q = meta.q_rows.shape
    # [batch, kv_heads, max_k, dim]: each sequence's keys gathered through its block table.
    k, v = gather_blocks(key_cache, meta), gather_blocks(value_cache, meta)
    if batch == 1:
        q = query[None].transpose(1, 2)  # no padding needed
    else:
        q = query[meta.q_rows].transpose(1, 2)  # [batch, heads, max_q, dim]
    causal = meta.mask is None and max_q > 1
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=meta.mask, is_causal=causal, scale=scale, enable_gqa=heads != kvh
    )  # [batch, heads, max_q, dim]
    out = out.transpose(1, 2).reshape(batch * max_q, heads, dim)
    if batch == 1 or max_q == 1:  # every row real: no boolean index (a host sync, which a
        return out                # CUDA graph cannot capture)
    return out[meta.q_valid]


def row_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """paged_attention, batch-invariant: each query row attends alone, over exactly the keys
    it sees, contiguous. SDPA's blocking over several rows and padded keys changes the
    reduction order, so the same row gives other low bits in a decode step, a verify chunk,
    a prefill or beside a longer sequence; one row at a time it cannot. Slower (a call per
    row): the price of `--batch-invariant`."""
    if meta.groups:  # a mixed batch's masks live in its groups
        return per_group(row_attention, query, key_cache, value_cache, meta, scale)
    _, heads, dim = query.shape
    kvh = key_cache.shape[2]
    flat_k, flat_v = key_cache.view(-1, kvh, dim), value_cache.view(-1, kvh, dim)
    out = torch.empty_like(query)
    cu = meta.cu_seqlens_q.tolist()
    for b, seq_len in enumerate(meta.seq_lens.tolist()):
        start, q_len = cu[b], cu[b + 1] - cu[b]
        slots = meta.kv_slots[b, :seq_len]
        k_all = flat_k[slots].transpose(0, 1)  # [kv_heads, seq_len, dim]
        v_all = flat_v[slots].transpose(0, 1)
        for i in range(q_len):
            if meta.mask is not None:  # a tree (or padding): the row's own visible keys
                seen = meta.mask[b, 0, i, :seq_len].nonzero().squeeze(1)
                k, v = k_all[:, seen], v_all[:, seen]
            else:
                last = seq_len - q_len + i + 1
                k, v = k_all[:, :last].contiguous(), v_all[:, :last].contiguous()
            q = query[start + i][None, :, None]  # [1, heads, 1, dim]
            o = F.scaled_dot_product_attention(q, k[None], v[None], scale=scale,
                                               enable_gqa=heads != kvh)
            out[start + i] = o[0, :, 0]
    return out
