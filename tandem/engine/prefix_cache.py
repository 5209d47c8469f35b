"""Prefix sharing for the paged KV cache (pure Python, no torch).

Once a block is full of committed tokens it is registered under a chained hash of (previous
block's hash, its token ids), and a new sequence whose prompt starts with the same blocks
reuses them instead of recomputing their KV. A freed block keeps its hash and contents
("cached but free") until the block manager hands it out fresh, which makes it forget them.
Allocation, reference counts and the free list are tandem.engine.block_manager's.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass


def block_hash(prev_hash: bytes, token_ids: tuple[int, ...]) -> bytes:
    """Chained hash of one full block: it stands for the whole prefix up to this block.

    blake2b over a fixed little-endian encoding, so it is the same in every process (Python's
    hash() is salted per process and could not be shared between workers).
    """
    digest = hashlib.blake2b(prev_hash, digest_size=16)
    digest.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return digest.digest()


@dataclass(slots=True)
class Block:
    """One KV block: how many sequences hold it and, while registered, the prefix it caches."""

    block_id: int
    ref_count: int = 0
    hash: bytes | None = None  # set only while this block is the one registered for it
    token_ids: tuple[int, ...] = ()  # the committed tokens `hash` stands for


class PrefixCache:
    """The hash -> block index over the block manager's blocks (shared, not copied)."""

    def __init__(self, blocks: list[Block], block_size: int) -> None:
        self.blocks = blocks
        self.block_size = block_size
        self.hash_to_block: dict[bytes, int] = {}

    def find(self, tokens: list[int]) -> list[tuple[int, bytes]]:
        """The leading full blocks of `tokens` found in the cache, as (block_id, hash).

        Only blocks that end before the last token are candidates: the model must run on at
        least the last token to produce logits, so a fully cached prompt reuses all but its
        last block and recomputes that one in a fresh block.
        """
        bs, prev, hits = self.block_size, b"", []
        for i in range((len(tokens) - 1) // bs):
            chunk = tuple(tokens[i * bs : (i + 1) * bs])
            h = block_hash(prev, chunk)
            block_id = self.hash_to_block.get(h)
            # Compare the tokens too: a hash collision must cost a miss, never wrong KV.
            if block_id is None or self.blocks[block_id].token_ids != chunk:
                break
            hits.append((block_id, h))
            prev = h
        return hits

    def register(self, token_ids: list[int], num_committed: int, block_table: list[int],
                 block_hashes: list[bytes]) -> None:
        """Register a sequence's newly full committed blocks, extending its `block_hashes`
        (the chain hashes of its leading full committed blocks) in place."""
        bs = self.block_size
        for i in range(len(block_hashes), num_committed // bs):
            chunk = tuple(token_ids[i * bs : (i + 1) * bs])
            h = block_hash(block_hashes[-1] if block_hashes else b"", chunk)
            block_hashes.append(h)
            # Another sequence may have computed and registered an identical block meanwhile.
            # Keep ours private rather than re-point the entry, so a registered hash always
            # names exactly one block and evicting that block drops exactly its own entry.
            if h not in self.hash_to_block:
                block = self.blocks[block_table[i]]
                self.hash_to_block[h] = block.block_id
                block.hash, block.token_ids = h, chunk

    def evict(self, block_id: int) -> None:
        """The block's KV is about to be overwritten: it must no longer answer lookups."""
        block = self.blocks[block_id]
        if block.hash is not None:
            del self.hash_to_block[block.hash]
            block.hash, block.token_ids = None, ()
