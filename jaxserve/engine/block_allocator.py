"""Logical KV-cache block allocator with prefix caching (host side only).

The physical cache (device arrays) lives with the model runner; this module
only decides which block ids a sequence owns. It never touches a device.

Blocks
    Ids ``0 .. num_blocks - 1``. Block 0 is the *null block*: it is never
    handed out, so padding tokens can write into it and 0 can pad block
    tables. A fresh allocator hands out ``1, 2, 3, ...`` in that order.

Reference counts
    A block in use has ``ref_count >= 1``; a block shared by several
    sequences through the prefix cache has one reference per sequence.

Free blocks
    Blocks with ``ref_count == 0`` are free, in two groups, and allocation
    takes from the first before the second:

    1. *plain* free blocks (no hash: never used, or holding nothing worth
       keeping) are handed out **lowest id first**. New blocks of the
       sequences running together then sit close to each other in the
       physical cache, in ascending order, so attention's block gathers walk
       memory almost sequentially instead of hopping over the whole cache
       (measured on the 64-prompt offline benchmark, repeated runs in one
       process: 640 tok/s median with freed blocks reused last-freed-first,
       698 with lowest-first);
    2. *cached* free blocks (holding a hashed full block) form an LRU queue:
       a freed one goes to its tail and eviction takes its head, so cached
       blocks are evicted least recently used first. :meth:`free` walks a
       sequence's blocks tail first, so a finished request's tail blocks
       are evicted before its head (prefix) blocks, which are the ones most
       likely to be shared by a later request.

Prefix caching
    Only full blocks are cached. A block is keyed by a chained hash of its
    parent block's hash, its token ids and ``extra_keys`` (a salt for the
    model, adapter or tenant), so equal tokens after a different prefix or
    under a different salt never match. A cached block keeps its hash while
    it sits in the free queue; it loses it only when it is evicted, i.e.
    popped from the queue to serve as a fresh block.

Running out of blocks is a return value (``allocate`` returns ``None``),
never an exception; exceptions here mean a caller bug (double free, bad id).
"""

from __future__ import annotations

import collections
import hashlib
import heapq
from collections.abc import Iterable, Sequence
from typing import cast

import numpy as np

NULL_BLOCK_ID = 0

BlockHash = bytes
"""A block's chained hash: 32 bytes of BLAKE2b."""

_DIGEST_SIZE = 32


def _encode_extra_keys(extra: object) -> bytes:
    """A stable, unambiguous byte encoding of the extra keys.

    Supported: ``None``, ``bytes``, ``str``, ``int`` (and ``bool``) and
    tuples/lists of those, nested. Every item carries a type tag and a length
    so distinct values never encode alike.
    """
    if extra is None:
        return b"n"
    if isinstance(extra, bytes):
        return b"b" + len(extra).to_bytes(8, "little") + extra
    if isinstance(extra, str):
        raw = extra.encode("utf-8")
        return b"s" + len(raw).to_bytes(8, "little") + raw
    if isinstance(extra, (int, np.integer)):
        raw = str(int(extra)).encode("ascii")
        return b"i" + len(raw).to_bytes(8, "little") + raw
    if isinstance(extra, (tuple, list)):
        parts = [_encode_extra_keys(item) for item in extra]
        return b"t" + len(parts).to_bytes(8, "little") + b"".join(parts)
    raise TypeError(f"extra_keys must be None, bytes, str, int or a tuple of those, got {type(extra).__name__}")


def hash_block_tokens(
    parent_hash: BlockHash | None,
    token_ids: Sequence[int],
    extra_keys: object = None,
) -> BlockHash:
    """Chained hash of one full block.

    Stable across processes and runs (BLAKE2b over a fixed packing, not
    Python's salted ``hash()``): ``parent_hash`` (``None`` for the first
    block), the token ids as little-endian int64 and the encoded extra keys.
    """
    h = hashlib.blake2b(digest_size=_DIGEST_SIZE, person=b"jaxserve-kvblk")
    if parent_hash is None:
        h.update(b"\x00")
    else:
        if len(parent_hash) != _DIGEST_SIZE:
            raise ValueError(f"parent_hash must be {_DIGEST_SIZE} bytes, got {len(parent_hash)}")
        h.update(b"\x01")
        h.update(parent_hash)
    tokens = np.asarray(token_ids, dtype="<i8")
    h.update(len(tokens).to_bytes(8, "little"))
    h.update(tokens.tobytes())
    h.update(_encode_extra_keys(extra_keys))
    return h.digest()


def hash_request_tokens(
    token_ids: Sequence[int],
    block_size: int,
    extra_keys: object = None,
    parent_hash: BlockHash | None = None,
) -> list[BlockHash]:
    """Chained hashes of every *full* block of ``token_ids`` (a trailing
    partial block gets none)."""
    hashes: list[BlockHash] = []
    parent = parent_hash
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[start : start + block_size], extra_keys)
        hashes.append(parent)
    return hashes


class BlockAllocator:
    """Hands out block ids, counts references, caches full blocks by hash.

    ``num_blocks`` includes the null block, so ``num_blocks - 1`` blocks are
    usable.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 2:
            raise ValueError(
                f"num_blocks must be an integer >= 2 (block 0 is the reserved null block), got {num_blocks!r}"
            )
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = bool(enable_prefix_caching)
        self._ref_count = [0] * num_blocks
        self._block_hash: list[BlockHash | None] = [None] * num_blocks
        self._hash_to_block: dict[BlockHash, int] = {}
        # Plain free blocks: a min-heap (entries of blocks since taken are
        # skipped lazily) and the set of those really free.
        self._plain_heap: list[int] = list(range(1, num_blocks))
        self._plain: set[int] = set(self._plain_heap)
        # Cached free blocks, least recently used first.
        self._cached: collections.OrderedDict[int, None] = collections.OrderedDict()
        # Counters (cumulative, in blocks).
        self.prefix_cache_queried_blocks = 0
        self.prefix_cache_hit_blocks = 0
        self.num_evictions = 0

    # ------------------------------------------------------------ inspection

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks an ``allocate`` could hand out now (cached-but-unused blocks
        count as free: they are evicted on demand)."""
        return len(self._plain) + len(self._cached)

    @property
    def num_used_blocks(self) -> int:
        return self.num_usable_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by a sequence (0.0 .. 1.0)."""
        return self.num_used_blocks / self.num_usable_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks that currently hold a registered hash (in use or free)."""
        return len(self._hash_to_block)

    def ref_count(self, block_id: int) -> int:
        self._check_id(block_id)
        return self._ref_count[block_id]

    def block_hash(self, block_id: int) -> BlockHash | None:
        self._check_id(block_id)
        return self._block_hash[block_id]

    def free_block_ids(self) -> list[int]:
        """Free blocks in the order allocation takes them: plain ones lowest id
        first, then cached ones least recently used first. For tests and debugging."""
        return sorted(self._plain) + list(self._cached)

    # ------------------------------------------------------------ prefix cache

    def find_cached_prefix(self, block_hashes: Iterable[BlockHash]) -> list[int]:
        """Block ids of the longest cached prefix of ``block_hashes``.

        Pure lookup: no reference taken, no counter moved, LRU order kept.
        """
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        for h in block_hashes:
            block = self._hash_to_block.get(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def num_blocks_to_touch(self, block_ids: Iterable[int]) -> int:
        """How many of ``block_ids`` are unused now, i.e. how many free blocks
        a :meth:`touch` of them would take out of the free queue."""
        return sum(1 for b in block_ids if self._ref_count[b] == 0)

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take one more reference on each block (pulling unused ones out of
        the free queue, so they can no longer be evicted)."""
        for b in block_ids:
            self._check_id(b)
            if self._ref_count[b] == 0:
                if b in self._cached:
                    del self._cached[b]
                else:
                    self._plain.discard(b)  # its heap entry is skipped when popped
            self._ref_count[b] += 1

    def get_computed_blocks(self, block_hashes: Sequence[BlockHash]) -> list[int]:
        """Longest cached prefix of ``block_hashes``, referenced for the caller.

        The caller owns one reference to each returned block and gives it
        back with :meth:`free`. Counts one query per hash looked up and one
        hit per block returned.
        """
        if not self.enable_prefix_caching:
            return []
        hits = self.find_cached_prefix(block_hashes)
        self.prefix_cache_queried_blocks += len(block_hashes)
        self.prefix_cache_hit_blocks += len(hits)
        self.touch(hits)
        return hits

    def cache_full_blocks(self, block_ids: Sequence[int], block_hashes: Sequence[BlockHash]) -> int:
        """Register newly filled blocks under their hashes (pairwise).

        A block already registered is skipped. If another block already holds
        the same hash (two sequences computed the same content at once), the
        newcomer stays unregistered and is recycled as a plain block when
        freed. Returns how many blocks were registered.
        """
        if len(block_ids) != len(block_hashes):
            raise ValueError(f"{len(block_ids)} blocks but {len(block_hashes)} hashes")
        if not self.enable_prefix_caching:
            return 0
        registered = 0
        for b, h in zip(block_ids, block_hashes):
            self._check_id(b)
            if self._ref_count[b] == 0:
                raise ValueError(f"block {b} is not in use; only held blocks can be cached")
            current = self._block_hash[b]
            if current is not None:
                if current != h:
                    raise ValueError(f"block {b} is already cached under a different hash")
                continue
            if h in self._hash_to_block:
                continue
            self._block_hash[b] = h
            self._hash_to_block[h] = b
            registered += 1
        return registered

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Only done when no block is in use (a hash
        on a block some sequence holds cannot be dropped safely); returns
        whether the cache was reset."""
        if self.num_used_blocks:
            return False
        self._hash_to_block.clear()
        self._block_hash = [None] * self.num_blocks
        for b in self._cached:
            self._plain.add(b)
            heapq.heappush(self._plain_heap, b)
        self._cached.clear()
        return True

    # ------------------------------------------------------------ allocation

    def allocate(self, n: int) -> list[int] | None:
        """``n`` fresh blocks (ref count 1, no hash), or ``None`` if fewer than
        ``n`` are free. Evicts cached free blocks least recently used first."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > self.num_free_blocks:
            return None
        out: list[int] = []
        while len(out) < n:
            if self._plain:
                b = heapq.heappop(self._plain_heap)
                if b not in self._plain:  # taken by touch() since it was pushed
                    continue
                self._plain.remove(b)
            else:
                b, _unused = self._cached.popitem(last=False)
                del self._hash_to_block[cast(bytes, self._block_hash[b])]  # a cached block has its hash
                self._block_hash[b] = None
                self.num_evictions += 1
            self._ref_count[b] = 1
            out.append(b)
        return out

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference on each block of a sequence's table, walking it
        from the tail. Blocks reaching zero become free: cached ones at the
        tail of the LRU queue (most recently used), uncached ones plain."""
        for b in reversed(block_ids):
            self._check_id(b)
            count = self._ref_count[b]
            if count <= 0:
                raise ValueError(f"block {b} freed more times than it was referenced")
            self._ref_count[b] = count - 1
            if count == 1:
                if self._block_hash[b] is None:
                    self._plain.add(b)
                    heapq.heappush(self._plain_heap, b)
                else:
                    self._cached[b] = None

    # ------------------------------------------------------------ internals

    def _check_id(self, block_id: int) -> None:
        if not (0 < block_id < self.num_blocks):
            if block_id == NULL_BLOCK_ID:
                raise ValueError("block 0 is the null block and is never allocated, referenced or freed")
            raise ValueError(f"block id {block_id} out of range 1..{self.num_blocks - 1}")
