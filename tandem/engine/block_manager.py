"""Paged KV-cache block manager for the verifier (pure Python, no torch).

The KV cache is `num_blocks` blocks of `block_size` slots; slot id = block_id * block_size +
offset. Each sequence owns a block table and one token id per slot it holds. The first
`num_committed` of those are final (their KV is written and will never change); the rest are
tentative (draft tokens under verification, or a prompt not yet prefilled) and can be rolled
back.

Prefix sharing (tandem.engine.prefix_cache): a new sequence whose prompt starts with the same
full committed blocks as an earlier one reuses them instead of recomputing their KV. Shared
blocks are reference counted. A freed block keeps its hash and contents ("cached but free")
until it is handed out fresh.

Why no copy-on-write is needed: only full blocks of committed tokens are ever shared, a
sequence only writes at positions past its committed count (appends), and rollback cannot cut
into committed tokens; so a shared block is never written again.
"""

from __future__ import annotations

import operator
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from tandem.engine.prefix_cache import Block, PrefixCache

_MAX_TOKEN_ID = 2**63 - 1  # token ids are hashed as signed 64-bit integers


class NoFreeBlocksError(RuntimeError):
    """The cache is full: the caller preempts a sequence or queues the request."""


@dataclass(slots=True)
class _Sequence:
    token_ids: list[int]
    block_table: list[int]
    num_committed: int
    block_hashes: list[bytes]  # chain hashes of the leading full committed blocks
    dropped: int = 0  # leading blocks released past a sliding window (entries kept, unread)


def _check_tokens(token_ids: Iterable[int]) -> list[int]:
    try:
        tokens = [operator.index(t) for t in token_ids]
    except TypeError:
        raise ValueError("token_ids must be an iterable of integers") from None
    bad = [t for t in tokens if not 0 <= t <= _MAX_TOKEN_ID]
    if bad:
        raise ValueError(f"token ids must be in [0, 2**63), got {bad[:5]}")
    return tokens


def _check_count(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    return value


class BlockManager:
    """The KV blocks of each session, by `session_id` (the verifier's session id; a draft
    proposer passes its DraftRequest's session key, one per session incarnation)."""

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True) -> None:
        """prefix_caching=False: every prompt is computed in full (a data recorder wants the
        hidden states of every position)."""
        self.prefix_caching = prefix_caching
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
            if _check_count(name, value) == 0:
                raise ValueError(f"{name} must be positive, got 0")
        self._num_blocks = num_blocks
        self._block_size = block_size
        self._blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks in hand-out order (front first). An OrderedDict because a prefix hit
        # revives a cached-but-free block from the middle of the queue in O(1).
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cache = PrefixCache(self._blocks, block_size)
        self._seqs: dict[str, _Sequence] = {}

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self._num_blocks

    def has(self, session_id: str) -> bool:
        return session_id in self._seqs

    def ref_count(self, block_id: int) -> int:
        """How many sequences hold `block_id` (for metrics, debugging and tests)."""
        if _check_count("block_id", block_id) >= self._num_blocks:
            raise ValueError(f"block_id {block_id!r} is not in [0, {self._num_blocks})")
        return self._blocks[block_id].ref_count

    def can_allocate(self, token_ids: Iterable[int], use_cache: bool = True) -> bool:
        tokens = self._check_prompt(token_ids)
        hits = self._cached_prefix(tokens, use_cache)
        return self._blocks_to_take(tokens, hits) <= len(self._free)

    def allocate(self, session_id: str, token_ids: Iterable[int], use_cache: bool = True) -> int:
        """Admit a new sequence; returns how many leading tokens already have their KV cached
        (none with use_cache=False: a caller that needs every position computed)."""
        if session_id in self._seqs:
            raise ValueError(f"sequence {session_id!r} is already allocated")
        tokens = self._check_prompt(token_ids)
        hits = self._cached_prefix(tokens, use_cache)
        self._ensure_free(self._blocks_to_take(tokens, hits))
        table = [self._take_cached(block_id) for block_id, _ in hits]
        while len(table) < self._blocks_for(len(tokens)):
            table.append(self._take_fresh())
        # Cached tokens count as committed: their KV is written and final, and this makes
        # rollback unable to cut into the shared blocks.
        num_cached = len(hits) * self._block_size
        self._seqs[session_id] = _Sequence(tokens, table, num_cached, [h for _, h in hits])
        return num_cached

    def can_append(self, session_id: str, num_tokens: int) -> bool:
        seq = self._get(session_id)
        _check_count("num_tokens", num_tokens)
        return self._blocks_to_grow(seq, num_tokens) <= len(self._free)

    def append(self, session_id: str, token_ids: Iterable[int]) -> None:
        """Reserve slots for new tentative tokens. The last block is never shared (it is not
        full, or it is full of this sequence's own tokens), so appending never writes into a
        block another sequence reads."""
        seq = self._get(session_id)
        tokens = _check_tokens(token_ids)
        needed = self._blocks_to_grow(seq, len(tokens))
        self._ensure_free(needed)
        seq.block_table.extend(self._take_fresh() for _ in range(needed))
        seq.token_ids.extend(tokens)

    def rollback(self, session_id: str, num_tokens: int) -> None:
        """Drop the last `num_tokens` tentative slots (rejected drafts)."""
        seq = self._get(session_id)
        tentative = len(seq.token_ids) - seq.num_committed
        if _check_count("num_tokens", num_tokens) > tentative:
            raise ValueError(
                f"cannot roll back {num_tokens} tokens of sequence {session_id!r}: "
                f"only {tentative} are tentative (committed tokens are final)"
            )
        if num_tokens == 0:
            return  # `del x[-0:]` would clear the whole list
        del seq.token_ids[-num_tokens:]
        keep = self._blocks_for(len(seq.token_ids))
        while len(seq.block_table) > keep:
            self._release(seq.block_table.pop())

    def rewrite(self, session_id: str, token_ids: Iterable[int]) -> None:
        """Replace the token ids of the last tentative slots (a token tree's accepted path,
        whose KV was moved there), so committed blocks hash the tokens they really hold."""
        seq = self._get(session_id)
        tokens = _check_tokens(token_ids)
        if len(tokens) > len(seq.token_ids) - seq.num_committed:
            raise ValueError(f"cannot rewrite {len(tokens)} tokens of sequence {session_id!r}: "
                             "committed tokens are final")
        if tokens:
            seq.token_ids[-len(tokens):] = tokens

    def commit(self, session_id: str, num_tokens: int) -> None:
        """Mark the first `num_tokens` slots final and publish newly full blocks for sharing."""
        seq = self._get(session_id)
        _check_count("num_tokens", num_tokens)
        if not seq.num_committed <= num_tokens <= len(seq.token_ids):
            raise ValueError(
                f"cannot commit {num_tokens} tokens of sequence {session_id!r}: must be between "
                f"{seq.num_committed} (already committed) and {len(seq.token_ids)} (slots held)"
            )
        seq.num_committed = num_tokens
        self._cache.register(seq.token_ids, seq.num_committed, seq.block_table,
                             seq.block_hashes)

    def free(self, session_id: str) -> None:
        seq = self._get(session_id)
        del self._seqs[session_id]
        # Tail first: a sequence's last blocks are the least likely to be another prompt's
        # prefix, so they should be the first to be evicted.
        for block_id in reversed(seq.block_table[seq.dropped:]):
            self._release(block_id)

    def release_before(self, session_id: str, position: int) -> int:
        """Release the sequence's committed blocks that hold only positions < `position`: a
        model whose every layer has a sliding window never reads them again. Their table
        entries stay (the attention gathers them and masks them out), so positions keep
        their slots; a released block may be handed to another sequence. Returns how many
        blocks were released."""
        seq = self._get(session_id)
        upto = min(_check_count("position", position), seq.num_committed) // self._block_size
        upto = min(upto, len(seq.block_table) - 1)  # the block being written stays
        released = max(0, upto - seq.dropped)
        for block_id in seq.block_table[seq.dropped:upto]:
            self._release(block_id)
        seq.dropped = max(seq.dropped, upto)
        return released

    def block_table(self, session_id: str) -> list[int]:
        return list(self._get(session_id).block_table)

    def num_tokens(self, session_id: str) -> int:
        return len(self._get(session_id).token_ids)

    def num_committed(self, session_id: str) -> int:
        return self._get(session_id).num_committed

    def slot_mapping(self, session_id: str, start: int, end: int) -> list[int]:
        seq = self._get(session_id)
        _check_count("start", start)
        _check_count("end", end)
        if not start <= end <= len(seq.token_ids):
            raise ValueError(
                f"positions [{start}, {end}) are not within the {len(seq.token_ids)} slots "
                f"of sequence {session_id!r}"
            )
        bs, table = self._block_size, seq.block_table
        return [table[pos // bs] * bs + pos % bs for pos in range(start, end)]

    def _get(self, session_id: str) -> _Sequence:
        seq = self._seqs.get(session_id)
        if seq is None:
            raise ValueError(f"unknown sequence {session_id!r}")
        return seq

    def _check_prompt(self, token_ids: Iterable[int]) -> list[int]:
        tokens = _check_tokens(token_ids)
        if not tokens:
            raise ValueError("token_ids must not be empty: a sequence needs at least one token")
        return tokens

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self._block_size)

    def _blocks_to_grow(self, seq: _Sequence, num_tokens: int) -> int:
        return self._blocks_for(len(seq.token_ids) + num_tokens) - len(seq.block_table)

    def _blocks_to_take(self, tokens: list[int], hits: list[tuple[int, bytes]]) -> int:
        # A hit on a cached-but-free block still takes that block off the free list.
        revived = sum(1 for block_id, _ in hits if self._blocks[block_id].ref_count == 0)
        return self._blocks_for(len(tokens)) - len(hits) + revived

    def _ensure_free(self, needed: int) -> None:
        if needed > len(self._free):
            raise NoFreeBlocksError(f"need {needed} free KV blocks, {len(self._free)} free")

    def _cached_prefix(self, tokens: list[int], use_cache: bool) -> list[tuple[int, bytes]]:
        if not (use_cache and self.prefix_caching):
            return []
        return self._cache.find(tokens)

    def _take_cached(self, block_id: int) -> int:
        block = self._blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
        block.ref_count += 1
        return block_id

    def _take_fresh(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        self._cache.evict(block_id)
        self._blocks[block_id].ref_count = 1
        return block_id

    def _release(self, block_id: int) -> None:
        block = self._blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self._free[block_id] = None  # cached blocks queue at the back: least recent first
            if block.hash is None:
                # Holds nothing reusable, so hand it out before any cached block.
                self._free.move_to_end(block_id, last=False)
