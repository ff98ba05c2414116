"""BlockAllocator: exact ids, reference counts, chained-hash prefix hits, LRU eviction."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from jaxserve.engine.block_allocator import (
    NULL_BLOCK_ID,
    BlockAllocator,
    hash_block_tokens,
    hash_request_tokens,
)

BS = 4


def cached_request(alloc: BlockAllocator, tokens: list[int], salt: object = None) -> tuple[list[int], list[bytes]]:
    """Allocate blocks for ``tokens`` and register every full one, as a finished prefill would."""
    hashes = hash_request_tokens(tokens, BS, salt)
    blocks = alloc.allocate(-(-len(tokens) // BS))
    assert blocks is not None
    alloc.cache_full_blocks(blocks[: len(hashes)], hashes)
    return blocks, hashes


def test_fresh_allocator_hands_out_ids_in_order_and_never_block_zero():
    alloc = BlockAllocator(num_blocks=6, block_size=BS)
    assert alloc.num_free_blocks == 5
    assert alloc.allocate(2) == [1, 2]
    assert alloc.allocate(0) == []
    assert alloc.allocate(3) == [3, 4, 5]
    assert alloc.num_free_blocks == 0
    assert alloc.usage == 1.0
    assert alloc.allocate(1) is None
    with pytest.raises(ValueError, match="null block"):
        alloc.free([NULL_BLOCK_ID])


def test_exhaustion_returns_none_and_changes_nothing():
    alloc = BlockAllocator(num_blocks=5, block_size=BS)
    assert alloc.allocate(3) == [1, 2, 3]
    before = alloc.free_block_ids()
    assert alloc.allocate(2) is None
    assert alloc.free_block_ids() == before == [4]
    assert alloc.allocate(1) == [4]


def test_refcounts_when_a_cached_prefix_is_shared():
    alloc = BlockAllocator(num_blocks=8, block_size=BS)
    tokens = list(range(10))  # two full blocks + a partial one
    blocks, hashes = cached_request(alloc, tokens)
    assert blocks == [1, 2, 3]
    assert len(hashes) == 2
    assert [alloc.ref_count(b) for b in blocks] == [1, 1, 1]

    hits = alloc.get_computed_blocks(hashes)
    assert hits == [1, 2]
    assert [alloc.ref_count(b) for b in (1, 2, 3)] == [2, 2, 1]
    assert alloc.num_free_blocks == 4  # sharing takes no new block
    assert alloc.prefix_cache_queried_blocks == 2 and alloc.prefix_cache_hit_blocks == 2

    alloc.free(blocks)
    assert [alloc.ref_count(b) for b in (1, 2, 3)] == [1, 1, 0]
    alloc.free(hits)
    assert [alloc.ref_count(b) for b in (1, 2, 3)] == [0, 0, 0]
    # Unused but still cached: a new lookup hits and pulls them out of the free queue.
    assert alloc.block_hash(1) == hashes[0]
    assert alloc.get_computed_blocks(hashes) == [1, 2]
    assert alloc.num_free_blocks == 5
    with pytest.raises(ValueError, match="freed more times"):
        alloc.free([3])


def test_chained_hash_hits_need_same_parent_and_same_salt():
    alloc = BlockAllocator(num_blocks=16, block_size=BS)
    a = [1, 2, 3, 4, 5, 6, 7, 8]
    cached_request(alloc, a, salt="model-x")

    assert alloc.find_cached_prefix(hash_request_tokens(a, BS, "model-x")) == [1, 2]
    # Same tokens under another salt (adapter/model): no hit at all.
    assert alloc.find_cached_prefix(hash_request_tokens(a, BS, "model-y")) == []
    assert alloc.find_cached_prefix(hash_request_tokens(a, BS, None)) == []
    # Second block's tokens equal, first block differs: the chain breaks at block 0.
    b = [9, 9, 9, 9, 5, 6, 7, 8]
    assert alloc.find_cached_prefix(hash_request_tokens(b, BS, "model-x")) == []
    # Same first block, different second: only the first hits.
    c = [1, 2, 3, 4, 5, 6, 7, 0]
    assert alloc.find_cached_prefix(hash_request_tokens(c, BS, "model-x")) == [1]
    # A lookup is side-effect free.
    assert alloc.ref_count(1) == 1 and alloc.prefix_cache_queried_blocks == 0


def test_hash_is_stable_and_sensitive():
    h0 = hash_block_tokens(None, [1, 2, 3, 4], "s")
    assert h0 == hash_block_tokens(None, (1, 2, 3, 4), "s")
    assert len(h0) == 32
    assert h0 != hash_block_tokens(None, [1, 2, 3, 5], "s")
    assert h0 != hash_block_tokens(None, [1, 2, 3, 4], "t")
    assert h0 != hash_block_tokens(None, [1, 2, 3, 4], None)
    assert h0 != hash_block_tokens(h0, [1, 2, 3, 4], "s")
    # ("ab",) and ("a", "b") must not collide.
    assert hash_block_tokens(None, [1], ("ab",)) != hash_block_tokens(None, [1], ("a", "b"))
    # Not Python's salted hash(): another interpreter with another hash seed agrees.
    code = "from jaxserve.engine.block_allocator import hash_block_tokens as h; print(h(None, [1, 2, 3, 4], 's').hex())"
    env = dict(os.environ, PYTHONHASHSEED="12345")
    other = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert other.stdout.strip() == h0.hex()


def test_lru_eviction_reuses_least_recently_freed_cached_block_first():
    alloc = BlockAllocator(num_blocks=7, block_size=BS)  # 6 usable
    a_blocks, a_hashes = cached_request(alloc, list(range(8)))  # blocks 1, 2
    b_blocks, b_hashes = cached_request(alloc, list(range(100, 108)))  # blocks 3, 4
    assert (a_blocks, b_blocks) == ([1, 2], [3, 4])
    alloc.free(a_blocks)  # A first: least recently used
    alloc.free(b_blocks)
    # Never-used blocks first, then A's (tail first), then B's.
    assert alloc.free_block_ids() == [5, 6, 2, 1, 4, 3]
    assert alloc.allocate(2) == [5, 6]
    assert alloc.num_evictions == 0

    assert alloc.allocate(1) == [2]  # evicts A's tail block
    assert alloc.num_evictions == 1
    assert alloc.block_hash(2) is None
    assert alloc.find_cached_prefix(a_hashes) == [1]  # A's head survives
    assert alloc.find_cached_prefix(b_hashes) == [3, 4]

    # Touching B's blocks makes them most recently used: A's head goes next.
    alloc.free(alloc.get_computed_blocks(b_hashes))
    assert alloc.free_block_ids() == [1, 4, 3]
    assert alloc.allocate(1) == [1]
    assert alloc.find_cached_prefix(a_hashes) == []
    assert alloc.num_cached_blocks == 2


def test_tail_first_free_keeps_the_prefix_longest():
    alloc = BlockAllocator(num_blocks=4, block_size=BS)
    blocks, hashes = cached_request(alloc, list(range(12)))  # blocks 1, 2, 3 all full
    alloc.free(blocks)
    assert alloc.free_block_ids() == [3, 2, 1]
    assert alloc.allocate(1) == [3]
    assert alloc.find_cached_prefix(hashes) == [1, 2]
    assert alloc.allocate(1) == [2]
    assert alloc.find_cached_prefix(hashes) == [1]


def test_uncached_blocks_are_reused_before_cached_ones():
    alloc = BlockAllocator(num_blocks=6, block_size=BS)
    blocks, hashes = cached_request(alloc, list(range(6)))  # block 1 full (cached), block 2 partial
    scratch = alloc.allocate(2)
    assert scratch == [3, 4]
    alloc.free(blocks)
    alloc.free(scratch)
    # Uncached blocks are handed out lowest id first; the cached one waits until they are gone.
    assert alloc.free_block_ids() == [2, 3, 4, 5, 1]
    assert alloc.allocate(4) == [2, 3, 4, 5]
    assert alloc.find_cached_prefix(hashes) == [1]


def test_plain_blocks_are_handed_out_lowest_id_first():
    """Whatever order sequences free them in, plain blocks come back in ascending order,
    so concurrent sequences get neighbouring blocks (attention gathers stay local)."""
    alloc = BlockAllocator(num_blocks=10, block_size=BS, enable_prefix_caching=False)
    a, b, c = alloc.allocate(3), alloc.allocate(2), alloc.allocate(3)
    assert (a, b, c) == ([1, 2, 3], [4, 5], [6, 7, 8])
    alloc.free(c)
    alloc.free(a)
    assert alloc.free_block_ids() == [1, 2, 3, 6, 7, 8, 9]
    assert alloc.allocate(4) == [1, 2, 3, 6]
    alloc.free(b)
    assert alloc.allocate(3) == [4, 5, 7]
    assert alloc.num_free_blocks == 2 and alloc.free_block_ids() == [8, 9]


def test_touching_a_plain_free_block_takes_it_out_of_the_free_blocks():
    alloc = BlockAllocator(num_blocks=5, block_size=BS)
    alloc.touch([2])
    assert alloc.ref_count(2) == 1 and alloc.free_block_ids() == [1, 3, 4]
    assert alloc.allocate(3) == [1, 3, 4]
    assert alloc.allocate(1) is None
    alloc.free([2])
    assert alloc.allocate(1) == [2]


def test_duplicate_content_registers_once():
    alloc = BlockAllocator(num_blocks=8, block_size=BS)
    tokens = [7, 7, 7, 7]
    first, hashes = cached_request(alloc, tokens)
    second = alloc.allocate(1)
    assert alloc.cache_full_blocks(second, hashes) == 0
    assert alloc.block_hash(second[0]) is None
    assert alloc.find_cached_prefix(hashes) == first
    alloc.free(second)
    assert alloc.free_block_ids()[0] == second[0]


def test_prefix_caching_disabled():
    alloc = BlockAllocator(num_blocks=6, block_size=BS, enable_prefix_caching=False)
    blocks = alloc.allocate(2)
    hashes = hash_request_tokens(list(range(8)), BS)
    assert alloc.cache_full_blocks(blocks, hashes) == 0
    assert alloc.get_computed_blocks(hashes) == []
    alloc.free(blocks)
    assert alloc.free_block_ids() == [1, 2, 3, 4, 5]


def test_usage_and_reset():
    alloc = BlockAllocator(num_blocks=5, block_size=BS)
    blocks, hashes = cached_request(alloc, list(range(4)))
    assert alloc.usage == 0.25
    assert alloc.reset_prefix_cache() is False  # a block is in use
    alloc.free(blocks)
    assert alloc.usage == 0.0
    assert alloc.reset_prefix_cache() is True
    assert alloc.find_cached_prefix(hashes) == []


def test_bad_arguments():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockAllocator(num_blocks=1, block_size=BS)
    with pytest.raises(ValueError, match="block_size"):
        BlockAllocator(num_blocks=4, block_size=0)
    alloc = BlockAllocator(num_blocks=4, block_size=BS)
    with pytest.raises(ValueError, match="out of range"):
        alloc.touch([4])
    with pytest.raises(ValueError, match="not in use"):
        alloc.cache_full_blocks([1], [hash_block_tokens(None, [1, 2, 3, 4])])
