"""KV blocks past a sliding window (BlockManager.release_before, SchedulerConfig.kv_window):
a model whose every layer has a window never reads them again, so they go back to the pool
while the sequence runs; the rest of the bookkeeping is unchanged."""
import pytest

from tandem.engine.block_manager import BlockManager
from tandem.engine.checkpoint import LlamaConfig

pytestmark = pytest.mark.unit


def test_blocks_before_the_window_are_released_once():
    bm = BlockManager(8, 4)
    bm.allocate("a", range(1, 14))  # 13 tokens: 4 blocks
    bm.commit("a", 13)
    table = bm.block_table("a")
    assert bm.num_free_blocks == 4
    assert bm.release_before("a", 9) == 2  # positions 0..7 (blocks 0, 1) are out
    assert bm.num_free_blocks == 6 and bm.block_table("a") == table  # entries stay
    assert bm.release_before("a", 9) == 0  # idempotent
    assert bm.release_before("a", 4) == 0  # a smaller bound never takes blocks back
    bm.append("a", [5, 6, 7, 8])  # the sequence goes on in its live blocks
    assert bm.num_free_blocks == 5
    bm.free("a")  # frees only what it still holds
    assert bm.num_free_blocks == 8


def test_tentative_tokens_and_the_last_block_are_kept():
    bm = BlockManager(8, 4)
    bm.allocate("a", range(1, 9))  # two full blocks, none committed yet
    assert bm.release_before("a", 8) == 0  # uncommitted: still to be written
    bm.commit("a", 8)
    assert bm.release_before("a", 100) == 1  # the last block stays (it is written next)
    bm.append("a", [9, 10])
    bm.rollback("a", 2)  # drafts rejected: the live table shrinks, the released entry stays
    assert bm.num_free_blocks == 7 and len(bm.block_table("a")) == 2


def test_a_released_block_can_serve_another_sequence():
    bm = BlockManager(3, 4)
    bm.allocate("a", range(1, 12))  # 3 blocks: the cache is full
    bm.commit("a", 11)
    assert bm.release_before("a", 8) == 2
    bm.allocate("b", range(50, 58))  # two blocks: only there because "a" released its first
    assert bm.num_free_blocks == 0
    bm.free("a")
    bm.free("b")
    assert bm.num_free_blocks == 3


def test_kv_window_only_when_every_layer_has_one():
    base = dict(vocab_size=10, hidden_size=8, intermediate_size=16, num_layers=2, num_heads=2,
                num_kv_heads=1, head_dim=4, rms_norm_eps=1e-6, rope_theta=1e4,
                max_position_embeddings=64, tie_word_embeddings=True, qkv_bias=False)
    every = LlamaConfig(**base, sliding_window=12,
                        layer_types=("sliding_attention", "sliding_attention"))
    mixed = LlamaConfig(**base, sliding_window=12,
                        layer_types=("sliding_attention", "full_attention"))
    assert every.kv_window == 12 and mixed.kv_window == 0 and mixed.window(0) == 12
