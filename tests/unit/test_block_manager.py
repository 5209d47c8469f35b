"""Tests for the verifier's paged KV block manager (pure Python)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tandem.engine import prefix_cache as pc_module
from tandem.engine.block_manager import BlockManager, NoFreeBlocksError
from tandem.engine.prefix_cache import block_hash

pytestmark = pytest.mark.unit

BS = 4


def snapshot(bm: BlockManager) -> tuple:
    """Everything observable plus the internals a failed call must leave untouched."""
    seqs = {
        s: (bm.block_table(s), bm.num_tokens(s), bm.num_committed(s))
        for s in sorted(bm._seqs)
    }
    blocks = [(b.ref_count, b.hash, b.token_ids) for b in bm._blocks]
    return seqs, list(bm._free), dict(bm._cache.hash_to_block), blocks


def committed_seq(bm: BlockManager, session_id: str, tokens: list[int]) -> int:
    """Allocate and prefill a sequence: its KV is written, so all its tokens are committed."""
    cached = bm.allocate(session_id, tokens)
    bm.commit(session_id, len(tokens))
    return cached


# -- construction and basics ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("num_blocks", "block_size", "match"),
    [
        (0, 4, "num_blocks must be positive"),
        (4, 0, "block_size must be positive"),
        (-1, 4, "num_blocks must be a non-negative int"),
        (4, 2.0, "block_size must be"),
    ],
)
def test_constructor_rejects_bad_sizes(num_blocks, block_size, match):
    with pytest.raises(ValueError, match=match):
        BlockManager(num_blocks, block_size)


def test_fresh_manager_is_empty():
    bm = BlockManager(8, BS)
    assert (bm.num_blocks, bm.block_size, bm.num_free_blocks, bm.usage) == (8, BS, 8, 0.0)
    assert not bm.has("a")


def test_allocate_reserves_ceil_blocks():
    bm = BlockManager(8, BS)
    assert bm.allocate("a", range(10)) == 0
    assert bm.has("a")
    assert len(bm.block_table("a")) == 3
    assert (bm.num_tokens("a"), bm.num_committed("a")) == (10, 0)
    assert bm.num_free_blocks == 5
    assert bm.usage == pytest.approx(3 / 8)


def test_slot_mapping_follows_block_table():
    bm = BlockManager(8, BS)
    bm.allocate("x", [7])  # takes block 0 so "a" gets non-trivial ids
    bm.allocate("a", range(6))
    table = bm.block_table("a")
    expected = [table[p // BS] * BS + p % BS for p in range(6)]
    assert bm.slot_mapping("a", 0, 6) == expected
    assert bm.slot_mapping("a", 3, 5) == expected[3:5]
    assert bm.slot_mapping("a", 2, 2) == []
    with pytest.raises(ValueError, match="not within the 6 slots"):
        bm.slot_mapping("a", 4, 7)
    with pytest.raises(ValueError, match="not within"):
        bm.slot_mapping("a", 5, 4)
    with pytest.raises(ValueError, match="start must be a non-negative int"):
        bm.slot_mapping("a", -1, 2)


def test_append_allocates_only_at_block_boundaries():
    bm = BlockManager(8, BS)
    bm.allocate("a", range(3))
    bm.append("a", [3])
    assert len(bm.block_table("a")) == 1
    assert bm.can_append("a", 5) and not bm.can_append("a", 100)
    bm.append("a", [4, 5, 6, 7, 8])
    assert (bm.num_tokens("a"), len(bm.block_table("a"))) == (9, 3)
    bm.append("a", [])
    assert bm.num_tokens("a") == 9


def test_rollback_frees_emptied_blocks_and_keeps_committed():
    bm = BlockManager(8, BS)
    bm.allocate("a", range(5))
    bm.commit("a", 5)
    bm.append("a", range(100, 106))  # 11 slots, 3 blocks
    table = bm.block_table("a")
    bm.rollback("a", 0)
    assert bm.block_table("a") == table
    bm.rollback("a", 4)  # 7 slots: block 3 still partly used
    assert bm.block_table("a") == table[:2]
    assert bm.num_tokens("a") == 7
    bm.rollback("a", 2)
    assert bm.num_tokens("a") == 5 and bm.num_free_blocks == 6
    with pytest.raises(ValueError, match="only 0 are tentative"):
        bm.rollback("a", 1)
    with pytest.raises(ValueError, match="num_tokens must be a non-negative int"):
        bm.rollback("a", -1)


def test_commit_is_monotonic_and_bounded():
    bm = BlockManager(8, BS)
    bm.allocate("a", range(6))
    bm.commit("a", 3)
    bm.commit("a", 3)
    with pytest.raises(ValueError, match="between 3 .already committed. and 6"):
        bm.commit("a", 2)
    with pytest.raises(ValueError, match="cannot commit 7 tokens"):
        bm.commit("a", 7)
    assert bm.num_committed("a") == 3


def test_free_returns_all_blocks():
    bm = BlockManager(8, BS)
    bm.allocate("a", range(9))
    bm.free("a")
    assert not bm.has("a") and bm.num_free_blocks == 8 and bm.usage == 0.0
    with pytest.raises(ValueError, match="unknown sequence 'a'"):
        bm.free("a")


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda bm: bm.allocate("a", [1]), "already allocated"),
        (lambda bm: bm.allocate("b", []), "must not be empty"),
        (lambda bm: bm.can_allocate([]), "must not be empty"),
        (lambda bm: bm.allocate("b", [1, -2]), r"token ids must be in \[0, 2\*\*63\)"),
        (lambda bm: bm.allocate("b", [1, 2**63]), "token ids must be in"),
        (lambda bm: bm.allocate("b", "abc"), "iterable of integers"),
        (lambda bm: bm.allocate("b", [1.5]), "iterable of integers"),
        (lambda bm: bm.append("nope", [1]), "unknown sequence 'nope'"),
        (lambda bm: bm.append("a", [None]), "iterable of integers"),
        (lambda bm: bm.can_append("a", -1), "num_tokens must be a non-negative int"),
        (lambda bm: bm.commit("a", "3"), "num_tokens must be a non-negative int"),
        (lambda bm: bm.block_table("nope"), "unknown sequence"),
        (lambda bm: bm.ref_count(99), r"block_id 99 is not in \[0, 8\)"),
    ],
)
def test_bad_inputs_raise_value_error(call, match):
    bm = BlockManager(8, BS)
    bm.allocate("a", [1, 2, 3])
    before = snapshot(bm)
    with pytest.raises(ValueError, match=match):
        call(bm)
    assert snapshot(bm) == before


# -- prefix sharing -------------------------------------------------------------------------


def test_same_prompt_shares_committed_full_blocks():
    bm = BlockManager(8, BS)
    prompt = list(range(10))
    assert committed_seq(bm, "a", prompt) == 0
    assert bm.allocate("b", prompt) == 8
    a, b = bm.block_table("a"), bm.block_table("b")
    assert a[:2] == b[:2] and a[2] != b[2]
    assert [bm.ref_count(x) for x in a] == [2, 2, 1]
    assert bm.num_committed("b") == 8  # cached tokens are final: rollback cannot reach them
    with pytest.raises(ValueError, match="only 2 are tentative"):
        bm.rollback("b", 3)
    bm.free("a")
    assert [bm.ref_count(x) for x in b] == [1, 1, 1]
    assert bm.num_free_blocks == 5


def test_fully_cached_prompt_recomputes_its_last_block():
    bm = BlockManager(8, BS)
    committed_seq(bm, "a", list(range(8)))
    assert bm.allocate("b", list(range(8))) == 4  # the last token needs logits
    assert bm.block_table("b")[0] == bm.block_table("a")[0]
    assert bm.block_table("b")[1] != bm.block_table("a")[1]
    assert bm.allocate("c", list(range(9))) == 8  # one more token: both full blocks reused
    assert bm.allocate("d", list(range(4))) == 0


def test_divergent_prompt_shares_only_common_full_blocks():
    bm = BlockManager(8, BS)
    committed_seq(bm, "a", list(range(12)))
    # diverges inside the second block: only the first block is shared
    assert bm.allocate("b", [0, 1, 2, 3, 4, 5, 99, 7, 8, 9, 10, 11]) == 4
    # same tokens in block two but a different first block: the chain hash misses
    assert bm.allocate("c", [99, 1, 2, 3, 4, 5, 6, 7, 8]) == 0


def test_tentative_tokens_are_not_shared():
    bm = BlockManager(8, BS)
    bm.allocate("a", list(range(9)))
    bm.commit("a", 7)  # only the first block is full of committed tokens
    assert bm.allocate("b", list(range(9))) == 4


def test_freed_blocks_stay_cached_until_reused():
    bm = BlockManager(8, BS)
    committed_seq(bm, "a", list(range(9)))
    old = bm.block_table("a")
    bm.free("a")
    assert bm.num_free_blocks == 8 and bm.usage == 0.0
    assert bm.allocate("b", list(range(9))) == 8
    assert bm.block_table("b")[:2] == old[:2]
    assert bm.num_free_blocks == 5


def test_cached_free_blocks_are_evicted_when_space_is_needed():
    bm = BlockManager(4, BS)
    committed_seq(bm, "a", list(range(9)))
    bm.free("a")
    bm.allocate("filler", range(100, 116))  # needs all 4 blocks: evicts the cached ones
    assert bm._cache.hash_to_block == {}
    bm.free("filler")
    assert bm.allocate("b", list(range(9))) == 0


def test_eviction_order_uncached_first_then_least_recently_freed():
    bm = BlockManager(4, BS)
    committed_seq(bm, "old", [1, 1, 1, 1])  # block 0, cached
    committed_seq(bm, "new", [2, 2, 2, 2])  # block 1, cached
    bm.free("old")
    bm.free("new")
    bm.allocate("f1", range(100, 108))  # 2 blocks: the never-used ones, cache intact
    assert len(bm._cache.hash_to_block) == 2
    bm.free("f1")
    bm.allocate("f2", range(100, 112))  # 3 blocks: f1's uncached blocks, then "old"'s
    assert set(bm._cache.hash_to_block.values()) == {1}
    bm.free("f2")
    assert bm.allocate("y", [2, 2, 2, 2, 5]) == 4
    assert bm.allocate("x", [1, 1, 1, 1, 5]) == 0


def test_a_freed_sequence_is_evicted_tail_first():
    bm = BlockManager(4, BS)
    committed_seq(bm, "a", list(range(9)))  # 2 cached blocks + 1 partial
    bm.free("a")
    bm.allocate("f", range(100, 112))  # 2 uncached blocks, then a's last cached block
    bm.free("f")
    assert bm.allocate("b", list(range(9))) == 4


def test_can_allocate_counts_revived_cached_blocks():
    bm = BlockManager(3, BS)
    committed_seq(bm, "a", list(range(9)))
    bm.free("a")
    # reusing 2 cached-but-free blocks still takes them off the free list: 3 blocks in all
    assert bm.can_allocate(list(range(9)))
    assert bm.allocate("b", list(range(9))) == 8
    assert bm.num_free_blocks == 0
    assert not bm.can_allocate([1])


def test_can_allocate_counts_hits_on_live_blocks():
    bm = BlockManager(4, BS)
    committed_seq(bm, "a", list(range(9)))  # 3 blocks, 1 free
    assert bm.can_allocate(list(range(9)))  # 2 shared + 1 fresh
    assert not bm.can_allocate(list(range(100, 109)))


def test_identical_blocks_committed_concurrently_keep_hash_map_consistent():
    bm = BlockManager(8, BS)
    prompt = list(range(9))
    bm.allocate("a", prompt)
    bm.allocate("b", prompt)  # nothing committed yet: no sharing
    bm.commit("a", 9)
    bm.commit("b", 9)
    a, b = bm.block_table("a"), bm.block_table("b")
    assert set(bm._cache.hash_to_block.values()) == set(a[:2])
    assert all(bm._blocks[x].hash is None for x in b)
    bm.free("a")
    bm.allocate("filler", range(100, 120))  # evicts a's cached blocks
    assert bm._cache.hash_to_block == {}
    bm.free("b")
    bm.free("filler")
    assert bm.num_free_blocks == 8


def test_hash_collision_is_a_miss_not_wrong_kv(monkeypatch):
    monkeypatch.setattr(pc_module, "block_hash", lambda prev, tokens: b"same")
    bm = BlockManager(8, BS)
    committed_seq(bm, "a", [1, 2, 3, 4, 5])
    assert committed_seq(bm, "b", [9, 9, 9, 9, 5]) == 0
    assert bm._cache.hash_to_block == {b"same": bm.block_table("a")[0]}
    assert bm.allocate("c", [1, 2, 3, 4, 5]) == 4


def test_block_hash_is_chained_and_deterministic_across_processes():
    h = block_hash(b"", (1, 2, 3, 4))
    assert h == block_hash(b"", (1, 2, 3, 4))
    assert h != block_hash(b"", (1, 2, 3, 5))
    assert block_hash(h, (1, 2, 3, 4)) != h
    code = (
        "from tandem.engine.prefix_cache import block_hash as f; "
        "print(f(b'', (1, 2, 3, 4)).hex())"
    )
    root = str(Path(pc_module.__file__).resolve().parents[1])
    env = {"PYTHONHASHSEED": "12345", "PYTHONPATH": root}  # a different hash() salt
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
    )
    assert out.stdout.strip() == h.hex()


# -- failures leave no trace ----------------------------------------------------------------


def test_allocate_that_does_not_fit_leaves_no_trace():
    bm = BlockManager(4, BS)
    committed_seq(bm, "a", list(range(9)))
    bm.free("a")
    bm.allocate("b", [50])
    before = snapshot(bm)
    # would revive the 2 cached blocks, then find too few fresh ones
    assert not bm.can_allocate(list(range(17)))
    with pytest.raises(NoFreeBlocksError, match="need 5 free KV blocks, 3 free"):
        bm.allocate("c", list(range(17)))
    assert snapshot(bm) == before and not bm.has("c")
    assert bm.allocate("c", list(range(9))) == 8  # the cache survived


def test_append_that_does_not_fit_leaves_no_trace():
    bm = BlockManager(2, BS)
    bm.allocate("a", range(6))
    before = snapshot(bm)
    assert not bm.can_append("a", 3)
    with pytest.raises(NoFreeBlocksError):
        bm.append("a", [1, 2, 3])
    assert snapshot(bm) == before
    bm.append("a", [1, 2])
    assert bm.num_free_blocks == 0


# -- stateful model check -------------------------------------------------------------------

SESSION_IDS = ["s0", "s1", "s2", "s3", "s4"]
# Prompts start from a few shared prefixes so prefix hits (and collisions of live and cached
# blocks) happen often.
BASES = [(), (0, 1, 2, 3), (0, 1, 2, 3, 4, 5, 6, 7), (0, 1, 2, 3, 9, 9, 9, 9), (5, 5, 5, 5)]
prompts = st.tuples(st.sampled_from(BASES), st.lists(st.integers(0, 9), max_size=6)).map(
    lambda t: list(t[0]) + t[1] or [0]
)
drafts = st.lists(st.integers(0, 9), max_size=10)


class BlockManagerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(16, BS)
        self.tokens: dict[str, list[int]] = {}
        self.committed: dict[str, int] = {}
        self.kv: dict[int, int] = {}  # slot -> token whose KV a forward wrote there

    def write_kv(self, session_id: str, start: int) -> None:
        """What the model runner does: write KV for positions [start, end) into their slots."""
        end = len(self.tokens[session_id])
        for pos, slot in zip(range(start, end), self.bm.slot_mapping(session_id, start, end)):
            self.kv[slot] = self.tokens[session_id][pos]

    @rule(session_id=st.sampled_from(SESSION_IDS), prompt=prompts)
    def allocate(self, session_id, prompt):
        if session_id in self.tokens:
            with pytest.raises(ValueError, match="already allocated"):
                self.bm.allocate(session_id, prompt)
            return
        if not self.bm.can_allocate(prompt):
            before = snapshot(self.bm)
            event("allocate: no free blocks")
            with pytest.raises(NoFreeBlocksError):
                self.bm.allocate(session_id, prompt)
            assert snapshot(self.bm) == before
            return
        cached = self.bm.allocate(session_id, prompt)
        assert cached % BS == 0 and 0 <= cached < len(prompt)
        event(f"allocate: {cached // BS} cached blocks")
        self.tokens[session_id], self.committed[session_id] = list(prompt), cached
        # the cached prefix must really hold this prompt's KV
        cached_slots = self.bm.slot_mapping(session_id, 0, cached)
        assert [self.kv.get(s) for s in cached_slots] == prompt[:cached]
        self.write_kv(session_id, cached)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), new=drafts)
    def append(self, data, new):
        session_id = data.draw(st.sampled_from(sorted(self.tokens)))
        if not self.bm.can_append(session_id, len(new)):
            before = snapshot(self.bm)
            event("append: no free blocks")
            with pytest.raises(NoFreeBlocksError):
                self.bm.append(session_id, new)
            assert snapshot(self.bm) == before
            return
        start = len(self.tokens[session_id])
        self.bm.append(session_id, new)
        self.tokens[session_id].extend(new)
        self.write_kv(session_id, start)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), n=st.integers(0, 10))
    def rollback(self, data, n):
        session_id = data.draw(st.sampled_from(sorted(self.tokens)))
        tentative = len(self.tokens[session_id]) - self.committed[session_id]
        if n > tentative:
            with pytest.raises(ValueError, match="tentative"):
                self.bm.rollback(session_id, n)
            return
        self.bm.rollback(session_id, n)
        del self.tokens[session_id][len(self.tokens[session_id]) - n :]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def commit(self, data):
        session_id = data.draw(st.sampled_from(sorted(self.tokens)))
        n = data.draw(st.integers(self.committed[session_id], len(self.tokens[session_id])))
        self.bm.commit(session_id, n)
        self.committed[session_id] = n

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        session_id = data.draw(st.sampled_from(sorted(self.tokens)))
        self.bm.free(session_id)
        del self.tokens[session_id], self.committed[session_id]

    @invariant()
    def blocks_are_consistent(self):
        bm = self.bm
        free = list(bm._free)
        assert len(free) == len(set(free)) == bm.num_free_blocks
        tables = {session_id: bm.block_table(session_id) for session_id in self.tokens}
        owned = {b for t in tables.values() for b in t}
        assert not owned & set(free)
        assert len(owned) + len(free) == bm.num_blocks
        assert bm.usage == pytest.approx(len(owned) / bm.num_blocks)
        for b in range(bm.num_blocks):
            assert bm.ref_count(b) == sum(b in t for t in tables.values())
        for session_id, table in tables.items():
            assert len(table) == len(set(table))
            assert len(table) == -(-len(self.tokens[session_id]) // BS)
        for h, b in bm._cache.hash_to_block.items():
            assert bm._blocks[b].hash == h
        assert sum(blk.hash is not None for blk in bm._blocks) == len(bm._cache.hash_to_block)

    @invariant()
    def sequences_match_shadow(self):
        assert {s for s in SESSION_IDS if self.bm.has(s)} == set(self.tokens)
        for session_id, toks in self.tokens.items():
            assert self.bm.num_tokens(session_id) == len(toks)
            assert self.bm.num_committed(session_id) == self.committed[session_id]
            # nobody overwrote this sequence's slots (shared blocks are never written again)
            assert [self.kv[s] for s in self.bm.slot_mapping(session_id, 0, len(toks))] == toks

    def teardown(self):
        for session_id in list(self.tokens):
            self.bm.free(session_id)
        assert self.bm.num_free_blocks == self.bm.num_blocks  # no leak
        assert all(b.ref_count == 0 for b in self.bm._blocks)


BlockManagerMachine.TestCase.settings = settings(
    max_examples=100,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestBlockManagerMachine = BlockManagerMachine.TestCase
