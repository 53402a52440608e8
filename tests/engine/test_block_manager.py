"""White-box tests of KV block accounting and automatic prefix caching."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from jaxengine import block_manager as bm_module
from jaxengine.block_manager import BlockManager, hash_block_tokens
from jaxengine.request import Request

BS = 4


@dataclass
class FakeParams:
    max_tokens: int | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)


def make_req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, list(tokens), FakeParams())


def prefill(bm: BlockManager, req: Request, use_cache: bool = True) -> list[int]:
    """Allocate and 'compute' the whole prompt as a scheduler would, then cache full blocks."""
    blocks, num_cached = bm.get_computed_blocks(req) if use_cache else ([], 0)
    assert bm.allocate_slots(req, req.num_tokens - num_cached, blocks)
    req.num_computed_tokens = req.num_tokens
    bm.cache_full_blocks(req)
    bm.check_invariants()
    return bm.get_block_ids(req.request_id)


def test_null_block_never_handed_out_and_exhaustion() -> None:
    bm = BlockManager(num_blocks=5, block_size=BS, enable_prefix_caching=False)
    assert bm.num_free_blocks == 4 and bm.usage == 0.0
    a = make_req("a", list(range(16)))
    assert bm.allocate_slots(a, 16)
    assert sorted(bm.get_block_ids("a")) == [1, 2, 3, 4]
    assert bm.num_free_blocks == 0 and bm.usage == 1.0
    b = make_req("b", [1])
    assert not bm.allocate_slots(b, 1)
    with pytest.raises(KeyError):  # a failed allocation leaves no trace
        bm.get_block_ids("b")
    bm.check_invariants()
    bm.free(a)
    assert bm.num_free_blocks == 4
    bm.check_invariants()


def test_allocation_counts_and_decode_boundary() -> None:
    bm = BlockManager(num_blocks=10, block_size=BS, enable_prefix_caching=False)
    r = make_req("r", list(range(9)))
    assert bm.allocate_slots(r, 9)
    assert len(bm.get_block_ids("r")) == 3  # ceil(9 / 4)
    r.num_computed_tokens = 9
    r.output_token_ids.append(100)
    for pos, expected_blocks in [(9, 3), (10, 3), (11, 3), (12, 4), (13, 4)]:
        assert r.num_computed_tokens == pos
        free_before = bm.num_free_blocks
        assert bm.allocate_slots(r, 1)
        assert len(bm.get_block_ids("r")) == expected_blocks
        assert free_before - bm.num_free_blocks == (1 if pos == 12 else 0)
        r.num_computed_tokens += 1
        r.output_token_ids.append(100 + pos)
    bm.check_invariants()


def test_failed_allocation_changes_nothing() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS, enable_prefix_caching=True)
    a = make_req("a", list(range(8)))
    prefill(bm, a)
    a.output_token_ids.append(9)
    free = bm.free_block_ids()
    assert not bm.allocate_slots(a, 8)  # would need 3 more blocks, 1 free
    assert bm.free_block_ids() == free and len(bm.get_block_ids("a")) == 2
    bm.check_invariants()


def test_prefix_hit_while_first_request_runs() -> None:
    bm = BlockManager(num_blocks=16, block_size=BS, enable_prefix_caching=True)
    a = make_req("a", list(range(10)))
    a_blocks = prefill(bm, a)
    assert bm.num_cached_blocks == 2  # two full blocks; the partial third is not cached
    b = make_req("b", list(range(8)) + [50, 51, 52])
    blocks, n = bm.get_computed_blocks(b)
    assert blocks == a_blocks[:2] and n == 8
    assert bm.ref_count(blocks[0]) == 1  # the lookup alone takes nothing
    free_before = bm.num_free_blocks
    assert bm.allocate_slots(b, b.num_tokens - n, blocks)
    b_blocks = bm.get_block_ids("b")
    assert b_blocks[:2] == a_blocks[:2]  # the same physical blocks
    assert len(b_blocks) == 3 and b_blocks[2] not in a_blocks
    assert [bm.ref_count(x) for x in b_blocks] == [2, 2, 1]
    assert free_before - bm.num_free_blocks == 1
    assert bm.prefix_cache_queries == 10 + 11 and bm.prefix_cache_hits == 8
    bm.check_invariants()
    bm.free(a)
    assert [bm.ref_count(x) for x in a_blocks] == [1, 1, 0]
    bm.free(b)
    assert bm.num_free_blocks == 15
    bm.check_invariants()


def test_prefix_hit_after_first_request_freed() -> None:
    bm = BlockManager(num_blocks=16, block_size=BS, enable_prefix_caching=True)
    a = make_req("a", list(range(12)))
    a_blocks = prefill(bm, a)
    bm.free(a)
    assert bm.num_free_blocks == 15
    assert all(x in bm.free_block_ids() for x in a_blocks)
    b = make_req("b", list(range(12)) + [7])
    blocks, n = bm.get_computed_blocks(b)
    assert blocks == a_blocks and n == 12
    assert bm.allocate_slots(b, 1, blocks)
    assert bm.get_block_ids("b")[:3] == a_blocks
    assert not any(x in bm.free_block_ids() for x in a_blocks)  # revived off the free list
    assert [bm.ref_count(x) for x in a_blocks] == [1, 1, 1]
    assert bm.num_free_blocks == 15 - 4
    bm.check_invariants()


def test_never_the_whole_prompt_from_cache() -> None:
    bm = BlockManager(num_blocks=16, block_size=BS, enable_prefix_caching=True)
    a = make_req("a", list(range(8)))
    a_blocks = prefill(bm, a)
    b = make_req("b", list(range(8)))  # identical, block aligned
    blocks, n = bm.get_computed_blocks(b)
    assert blocks == a_blocks[:1] and n == 4  # the last token must be computed
    c = make_req("c", list(range(9)))
    assert bm.get_computed_blocks(c) == (a_blocks, 8)
    d = make_req("d", list(range(3)))  # shorter than a block: nothing to hit
    assert bm.get_computed_blocks(d) == ([], 0)


def test_eviction_order_lru_tail_first() -> None:
    bm = BlockManager(num_blocks=9, block_size=BS, enable_prefix_caching=True)
    a = make_req("a", list(range(12)))  # 3 full blocks
    b = make_req("b", list(range(100, 108)))  # 2 full blocks
    a_blocks = prefill(bm, a)
    b_blocks = prefill(bm, b)
    scratch = make_req("s", [1, 2, 3])  # one uncached partial block
    assert bm.allocate_slots(scratch, 3)
    s_block = bm.get_block_ids("s")[0]
    bm.free(a)
    bm.free(b)
    bm.free(scratch)
    free = bm.free_block_ids()
    # uncached blocks first, then a's blocks tail first, then b's (freed later) tail first
    assert free[-5:] == a_blocks[::-1] + b_blocks[::-1]
    assert free[0] == s_block
    num_uncached = len(free) - 5
    c = make_req("c", list(range(200, 200 + BS * (num_uncached + 2))))
    assert bm.allocate_slots(c, c.num_tokens)
    # the two evicted blocks are a's tail blocks; a's head block and b survive in the cache
    assert bm.get_computed_blocks(make_req("a2", list(range(13))))[0] == a_blocks[:1]
    assert bm.get_computed_blocks(make_req("b2", list(range(100, 109))))[0] == b_blocks
    bm.check_invariants()


def test_lookup_of_a_revived_request_refreshes_lru() -> None:
    bm = BlockManager(num_blocks=5, block_size=BS, enable_prefix_caching=True)
    a = make_req("a", list(range(8)))
    a_blocks = prefill(bm, a)
    bm.free(a)
    b = make_req("b", list(range(50, 58)))
    b_blocks = prefill(bm, b)
    bm.free(b)
    assert bm.free_block_ids() == a_blocks[::-1] + b_blocks[::-1]
    a2 = make_req("a2", list(range(8)) + [99])
    assert bm.get_computed_blocks(a2) == (a_blocks, 8)
    assert bm.allocate_slots(a2, 1, a_blocks)  # evicts b's tail block
    a2.num_computed_tokens = 9
    bm.free(a2)
    # b's old tail block now holds a2's partial (uncached) block: it goes to the front.
    # Used again, a's blocks are the most recently freed, so b's head block is evicted first.
    assert bm.free_block_ids() == [b_blocks[1], b_blocks[0]] + a_blocks[::-1]
    assert bm.get_computed_blocks(make_req("b2", list(range(50, 58))))[0] == b_blocks[:1]
    bm.check_invariants()


def test_hash_is_chained_and_stable() -> None:
    h1 = hash_block_tokens(None, [1, 2, 3, 4])
    assert h1 == hash_block_tokens(None, [1, 2, 3, 4])
    assert len(h1) == 32
    # same tokens, different parents -> different hashes
    assert hash_block_tokens(h1, [5, 6, 7, 8]) != hash_block_tokens(None, [5, 6, 7, 8])
    h2 = hash_block_tokens(None, [1, 2, 3, 5])
    assert hash_block_tokens(h1, [5, 6, 7, 8]) != hash_block_tokens(h2, [5, 6, 7, 8])
    # SHA-256 is independent of PYTHONHASHSEED: every host computes the same value
    assert h1.hex()[:16] == hash_block_tokens(None, (1, 2, 3, 4)).hex()[:16]


def test_hash_collision_does_not_share_wrong_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a deliberately colliding hash, a hit is still checked against the block's tokens."""
    monkeypatch.setattr(bm_module, "hash_block_tokens", lambda parent, tokens, lora_int_id=0: b"collide")
    bm = BlockManager(num_blocks=16, block_size=BS, enable_prefix_caching=True)
    a = make_req("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    a_blocks = prefill(bm, a)
    assert bm.num_cached_blocks == 1  # the second block's hash is taken: it stays private
    b = make_req("b", [9, 9, 9, 9, 5, 6, 7, 8, 9])
    assert bm.get_computed_blocks(b) == ([], 0)
    c = make_req("c", [1, 2, 3, 4, 9, 9, 9, 9, 9])
    assert bm.get_computed_blocks(c) == (a_blocks[:1], 4)
    prefill(bm, b)
    prefill(bm, c)
    bm.free(a)
    bm.free(b)
    bm.free(c)
    assert bm.num_free_blocks == 15
    bm.check_invariants()


def test_same_content_computed_twice_is_cached_once() -> None:
    bm = BlockManager(num_blocks=16, block_size=BS, enable_prefix_caching=True)
    a = make_req("a", list(range(9)))
    b = make_req("b", list(range(9)))
    # both allocated before either is computed: no sharing possible yet
    for r in (a, b):
        assert bm.get_computed_blocks(r) == ([], 0)
        assert bm.allocate_slots(r, 9)
    for r in (a, b):
        r.num_computed_tokens = 9
        bm.cache_full_blocks(r)
    assert bm.num_cached_blocks == 2
    c = make_req("c", list(range(9)))
    assert bm.get_computed_blocks(c)[0] == bm.get_block_ids("a")[:2]
    bm.check_invariants()
    bm.free(a)
    bm.free(b)
    bm.check_invariants()
    assert bm.num_free_blocks == 15


def test_prefix_caching_disabled() -> None:
    bm = BlockManager(num_blocks=16, block_size=BS, enable_prefix_caching=False)
    a = make_req("a", list(range(12)))
    prefill(bm, a)
    assert bm.num_cached_blocks == 0
    assert bm.get_computed_blocks(make_req("b", list(range(13)))) == ([], 0)
    assert bm.prefix_cache_queries == 0 and bm.prefix_cache_hits == 0


def test_reset_prefix_cache() -> None:
    bm = BlockManager(num_blocks=16, block_size=BS, enable_prefix_caching=True)
    a = make_req("a", list(range(12)))
    prefill(bm, a)
    bm.reset_prefix_cache()
    assert bm.num_cached_blocks == 0
    assert bm.get_computed_blocks(make_req("b", list(range(13)))) == ([], 0)
    bm.free(a)
    bm.check_invariants()
    assert bm.num_free_blocks == 15


def test_constructor_validation() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(1, 16, True)
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(8, 0, True)


# ---------------------------------------------------------------------------- sliding windows
def test_blocks_before_every_layers_window_are_freed() -> None:
    """Window 6, blocks of 4: the token at position p reads positions > p - 6, so once the next
    token is at 13 blocks 0 and 1 (positions 0-7) are never read again and go back to the pool;
    the table keeps their places as null entries."""
    bm = BlockManager(num_blocks=10, block_size=4, enable_prefix_caching=True, sliding_window=6)
    req = make_req("a", list(range(10, 22)))  # 12 prompt tokens: blocks for positions 0-11
    prefill(bm, req)
    assert bm.get_block_ids("a") == [1, 2, 3] and bm.num_free_blocks == 6
    req.output_token_ids.append(5)  # position 12 needs a new block; its window starts at 7
    assert bm.allocate_slots(req, 1)
    assert bm.get_block_ids("a") == [0, 2, 3, 4]  # positions 0-3 freed; 4-7 still read (7 > 12 - 6)
    bm.check_invariants()
    req.num_computed_tokens = 13
    for t in range(3):  # positions 13-15 fit the last block
        req.output_token_ids.append(t)
        assert bm.allocate_slots(req, 1)
        req.num_computed_tokens += 1
        bm.cache_full_blocks(req)  # as the scheduler does once a step is dispatched
    req.output_token_ids.append(9)  # position 16: a new block, window from 11
    assert bm.allocate_slots(req, 1)
    assert bm.get_block_ids("a") == [0, 0, 3, 4, bm.get_block_ids("a")[-1]]
    bm.check_invariants()
    # the freed blocks kept their prefix-cache hashes: they are evicted last, not dropped
    assert bm.num_cached_blocks == 4 and set(bm.free_block_ids()[-2:]) == {1, 2}
    bm.free(req)
    bm.check_invariants()
    assert bm.num_free_blocks == 9


def test_prefix_hit_frees_what_the_window_no_longer_reads() -> None:
    bm = BlockManager(num_blocks=12, block_size=4, enable_prefix_caching=True, sliding_window=4)
    first = make_req("a", list(range(10, 30)))  # 20 tokens, 5 blocks
    prefill(bm, first)
    bm.free(first)
    second = make_req("b", list(range(10, 30)) + [7, 8])  # the same 20 tokens, then 2 more
    blocks = prefill(bm, second)
    # 20 cached tokens: the next token (20) reads positions > 16, so blocks 0-3 are dropped at once
    assert blocks[:4] == [0, 0, 0, 0] and all(b != 0 for b in blocks[4:])
    bm.check_invariants()


def test_models_with_a_global_layer_keep_full_tables() -> None:
    bm = BlockManager(num_blocks=10, block_size=4, enable_prefix_caching=False)  # no window
    req = make_req("a", list(range(10, 30)))
    prefill(bm, req)
    req.output_token_ids.append(1)
    assert bm.allocate_slots(req, 1)
    assert 0 not in bm.get_block_ids("a")


def test_a_lora_adapter_changes_every_block_hash() -> None:
    """The first block's hash takes the adapter's id, so no block of one adapter's chain (or the
    base model's) equals another's for the same tokens."""
    tokens = [1, 2, 3, 4]
    base = bm_module.hash_block_tokens(None, tokens)
    one, two = bm_module.hash_block_tokens(None, tokens, 1), bm_module.hash_block_tokens(None, tokens, 2)
    assert len({base, one, two}) == 3
    assert bm_module.hash_block_tokens(one, tokens) != bm_module.hash_block_tokens(two, tokens)
    assert bm_module.hash_block_tokens(base, tokens, 5) == bm_module.hash_block_tokens(base, tokens)  # chained: the parent carries it
