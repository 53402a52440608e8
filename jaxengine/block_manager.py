"""Host-side bookkeeping of the paged KV cache: block tables, ref counts, prefix cache.

The device cache holds `num_blocks` blocks of `block_size` token slots per layer. Block 0 is
the null block: padding rows of block tables point at it, so it is never handed out; usable
blocks are 1..num_blocks-1.

Invariants (checked by `check_invariants`):
- a block is on the free list  <=>  its ref count is 0;
- a block's ref count = the number of request block tables that hold it;
- `_cached[h] == b`  <=>  `_block_hash[b] == h` (one block per hash, one hash per block).

Automatic prefix caching. Once a block is full of computed tokens it gets a hash that chains
its parent block's hash and its own token ids (SHA-256: stable across processes, so every
host of a multi-host run makes the same decisions, and collisions are out of reach; the
block's token ids are also kept and compared on a hit). A freed cached block keeps its hash
and goes to the END of the free list, so it is evicted last; it leaves the hash map only when
it is popped for reuse (lazy eviction). A request's blocks are freed tail first, so its tail
blocks, the least likely to be shared, are evicted before its head. Freed blocks without a
hash go to the FRONT: reusing them loses nothing.

Sliding windows. When every layer of the model attends only to the `sliding_window` most recent
positions, a block wholly before the window of the next token to compute is never read again:
`allocate_slots` frees it and its table entry becomes the null block (attention masks those
positions, so what the null block holds does not matter). Models with any global layer keep
full tables.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jaxengine.request import Request

BlockHash = bytes
NULL_BLOCK = 0

_ROOT_HASH: BlockHash = hashlib.sha256(b"jaxengine-prefix-root").digest()


def hash_block_tokens(parent: BlockHash | None, token_ids: Sequence[int], lora_int_id: int = 0) -> BlockHash:
    """Hash of a full block: SHA-256 over the parent block's hash and this block's token ids. A
    first block (no parent) of a request with a LoRA adapter also hashes the adapter's id, so the
    chain, and every block after, never matches another adapter's (or the base model's) K/V."""
    h = hashlib.sha256(_ROOT_HASH if parent is None else parent)
    if parent is None and lora_int_id:
        h.update(b"lora" + array("q", [lora_int_id]).tobytes())
    h.update(array("q", token_ids).tobytes())
    return h.digest()


class BlockManager:
    """KV block allocation for requests, with ref-counted sharing of cached prefix blocks."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool,
                 sliding_window: int | None = None) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding_window = sliding_window  # every layer's window (None: some layer is global)
        self._ref_counts = [0] * num_blocks
        # Free blocks in eviction order: the front is handed out (and evicted) first.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
        self._block_hash: list[BlockHash | None] = [None] * num_blocks
        self._block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self._cached: dict[BlockHash, int] = {}
        self._tables: dict[str, list[int]] = {}  # request id -> block ids, in token order
        self._num_hashed: dict[str, int] = {}  # request id -> leading blocks already in the cache
        self.prefix_cache_queries = 0  # tokens looked up in the prefix cache
        self.prefix_cache_hits = 0  # of which served from it

    # ------------------------------------------------------------------ stats
    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free cached blocks included)."""
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests."""
        return 1.0 - len(self._free) / self.num_usable_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def free_block_ids(self) -> list[int]:
        """Free blocks in eviction order (first = next handed out). For tests and debugging."""
        return list(self._free)

    def cached_block(self, block_hash: BlockHash) -> int | None:
        return self._cached.get(block_hash)

    # ------------------------------------------------------------------ lookup
    @property
    def tables(self) -> dict[str, list[int]]:
        """Request id -> its block table (live: read only). The scheduler's per-step fast path."""
        return self._tables

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table (a live list: read it, never mutate it)."""
        return self._tables[request_id]

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Longest cached prefix of the request's full blocks, and its length in tokens.

        Never the whole request: its last token must be computed so that its logits exist.
        Pure lookup: no ref counts change until `allocate_slots` takes the blocks.
        """
        if not self.enable_prefix_caching or getattr(request.sampling_params, "prompt_logprobs", None) is not None:
            return [], 0  # prompt logprobs need every prompt position computed
        bs = self.block_size
        max_blocks = (request.num_tokens - 1) // bs
        hashes = request.block_hashes
        blocks: list[int] = []
        for i in range(max_blocks):
            tokens = request.token_ids_slice(i * bs, (i + 1) * bs)
            if i == len(hashes):
                hashes.append(hash_block_tokens(hashes[-1] if i else None, tokens, request.lora_int_id))
            block = self._cached.get(hashes[i])
            if block is None or self._block_tokens[block] != tuple(tokens):
                break
            blocks.append(block)
        return blocks, len(blocks) * bs

    # ------------------------------------------------------------------ allocation
    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed_blocks: Sequence[int] = ()
    ) -> bool:
        """Make room for `num_new_tokens` more tokens after the computed ones.

        `new_computed_blocks` (from `get_computed_blocks`, first allocation only) are prepended
        to the table and shared: ref count +1, off the free list. Returns False, changing
        nothing, when the free list cannot cover the new blocks.
        """
        rid, bs = request.request_id, self.block_size
        table = self._tables.get(rid)
        if table is not None:
            assert not new_computed_blocks, "computed blocks are only taken on first allocation"
            num_tokens = request.num_computed_tokens + num_new_tokens
            if num_tokens <= len(table) * bs:
                return True  # fast path: a decode inside its last block
            if self.sliding_window is not None:
                self._free_outside_window(table, request.num_computed_tokens)
            num_needed = -(-num_tokens // bs) - len(table)
            if num_needed > len(self._free):
                return False
        else:
            num_needed = -(-num_new_tokens // bs)  # computed blocks are full: new tokens start a block
            num_revived = sum(1 for b in new_computed_blocks if self._ref_counts[b] == 0)
            if num_needed > len(self._free) - num_revived:
                return False
            table = self._tables[rid] = []
            self._num_hashed[rid] = len(new_computed_blocks)
            if self.enable_prefix_caching:
                self.prefix_cache_queries += request.num_tokens
                self.prefix_cache_hits += len(new_computed_blocks) * bs
        for b in new_computed_blocks:  # before popping, so none of them gets evicted
            if self._ref_counts[b] == 0:
                del self._free[b]
            self._ref_counts[b] += 1
            table.append(b)
        for _ in range(num_needed):
            table.append(self._pop_free_block())
        if self.sliding_window is not None and new_computed_blocks:
            self._free_outside_window(table, len(new_computed_blocks) * bs)
        return True

    def _free_outside_window(self, table: list[int], first_position: int) -> None:
        """Frees the table's blocks wholly before the window of the token at `first_position`
        (it reads positions > first_position - sliding_window), leaving null entries."""
        num_out = (first_position - self.sliding_window + 1) // self.block_size
        for i in range(min(num_out, len(table))):
            b = table[i]
            if b == NULL_BLOCK:
                continue
            table[i] = NULL_BLOCK
            self._release(b)

    def _release(self, b: int) -> None:
        self._ref_counts[b] -= 1
        if self._ref_counts[b] == 0:
            self._free[b] = None
            if self._block_hash[b] is None:
                self._free.move_to_end(b, last=False)

    def _pop_free_block(self) -> int:
        block, _ = self._free.popitem(last=False)
        h = self._block_hash[block]
        if h is not None:  # lazy eviction from the prefix cache
            del self._cached[h]
            self._block_hash[block] = None
            self._block_tokens[block] = None
        self._ref_counts[block] = 1
        return block

    def free(self, request: Request) -> None:
        """Release the request's blocks (tail first, so tail blocks are evicted first)."""
        rid = request.request_id
        table = self._tables.pop(rid, None)
        self._num_hashed.pop(rid, None)
        if table is None:
            return
        for b in reversed(table):
            if b != NULL_BLOCK:  # an entry a sliding window already freed
                self._release(b)

    # ------------------------------------------------------------------ prefix cache
    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's blocks newly filled with computed tokens in the prefix cache.

        A block whose hash is already cached (another request computed the same content at
        the same time) stays private and is simply freed later.
        """
        if not self.enable_prefix_caching:
            return
        rid = request.request_id
        table = self._tables.get(rid)
        if table is None:
            return
        done = self._num_hashed[rid]
        num_full = min(request.num_computed_tokens // self.block_size, len(table))
        if num_full <= done:
            return
        bs = self.block_size
        hashes = request.block_hashes
        for i in range(done, num_full):
            tokens = request.token_ids_slice(i * bs, (i + 1) * bs)
            if i == len(hashes):
                hashes.append(hash_block_tokens(hashes[-1] if i else None, tokens, request.lora_int_id))
            b, h = table[i], hashes[i]
            if b != NULL_BLOCK and self._block_hash[b] is None and h not in self._cached:
                self._cached[h] = b
                self._block_hash[b] = h
                self._block_tokens[b] = tuple(tokens)
        self._num_hashed[rid] = num_full

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash. Blocks in use keep working; they just stop being shared."""
        for b in self._cached.values():
            self._block_hash[b] = None
            self._block_tokens[b] = None
        self._cached.clear()

    # ------------------------------------------------------------------ checks
    def check_invariants(self) -> None:
        """Assert the accounting invariants in the module docstring (O(num_blocks); tests)."""
        assert NULL_BLOCK not in self._free and self._ref_counts[NULL_BLOCK] == 0
        expected = [0] * self.num_blocks
        for table in self._tables.values():
            for i, b in enumerate(table):
                if b == NULL_BLOCK:  # only a sliding window leaves these, and only in front
                    assert self.sliding_window is not None and all(x == NULL_BLOCK for x in table[:i])
                    continue
                expected[b] += 1
        assert expected == self._ref_counts, "ref counts differ from block tables"
        free = {b for b in range(1, self.num_blocks) if self._ref_counts[b] == 0}
        assert free == set(self._free), "free list differs from blocks with ref count 0"
        for h, b in self._cached.items():
            assert self._block_hash[b] == h
        assert sum(h is not None for h in self._block_hash) == len(self._cached)
        assert self._tables.keys() == self._num_hashed.keys()
