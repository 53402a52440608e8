"""White-box tests of the scheduler: token budget, ordering, prefix hits, preemption, stops."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from jaxengine.request import Request, RequestStatus
from jaxengine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput

BS = 4
EOS = 2


@dataclass
class FakeParams:
    max_tokens: int | None = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    reads_history: bool = False


def make_sched(**kw: int | bool) -> Scheduler:
    cfg = dict(
        max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64, num_blocks=33, block_size=BS
    )
    cfg.update(kw)
    return Scheduler(SchedulerConfig(**cfg))  # type: ignore[arg-type]


def make_req(rid: str, prompt: list[int] | int, **params: object) -> Request:
    tokens = list(range(10, 10 + prompt)) if isinstance(prompt, int) else prompt
    return Request(rid, tokens, FakeParams(**params), eos_token_ids=(EOS,))  # type: ignore[arg-type]


def fake_token(req: Request) -> int:
    """A deterministic 'model': the next token depends only on the tokens so far (never eos)."""
    return 10 + (sum(req.all_token_ids) * 31 + req.num_tokens) % 50


def sample(sched: Scheduler, out: SchedulerOutput, override: dict[str, int] | None = None) -> list[int | None]:
    override = override or {}
    return [
        override.get(s.request_id, fake_token(req)) if s.samples else None
        for s, req in zip(out.seqs, out._requests)
    ]


def step(sched: Scheduler, override: dict[str, int] | None = None) -> tuple[SchedulerOutput, list[Request]]:
    out = sched.schedule()
    finished = sched.update_from_output(out, sample(sched, out, override))
    sched.block_manager.check_invariants()
    return out, finished


def run_to_end(sched: Scheduler, max_steps: int = 1000) -> None:
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return
        step(sched)
    raise AssertionError("requests did not drain")


def test_prefill_in_one_step_then_decode() -> None:
    sched = make_sched()
    r = make_req("r", 10)
    sched.add_request(r)
    out, _ = step(sched)
    [s] = out.seqs
    assert (s.start, s.num_new_tokens, s.is_decode, s.samples) == (0, 10, False, True)
    assert len(s.block_ids) == 3 and out.num_batched_tokens == 10
    assert r.num_computed_tokens == 10 and r.num_output_tokens == 1
    assert r.status is RequestStatus.RUNNING and r.first_token_time is not None
    out, _ = step(sched)
    [s] = out.seqs
    assert (s.start, s.num_new_tokens, s.is_decode, s.samples) == (10, 1, True, True)
    assert r.num_output_tokens == 2


def test_chunked_prefill_under_small_budget() -> None:
    sched = make_sched(max_num_batched_tokens=4)
    r = make_req("r", 10)
    sched.add_request(r)
    chunks = []
    for _ in range(3):
        out, _ = step(sched)
        [s] = out.seqs
        chunks.append((s.start, s.num_new_tokens, s.samples, len(s.block_ids)))
    assert chunks == [(0, 4, False, 1), (4, 4, False, 2), (8, 2, True, 3)]
    assert r.num_output_tokens == 1


def test_budget_shared_between_running_and_waiting() -> None:
    sched = make_sched(max_num_batched_tokens=8)
    a, b = make_req("a", 5), make_req("b", 6)
    sched.add_request(a)
    sched.add_request(b)
    out, _ = step(sched)
    assert [(s.request_id, s.num_new_tokens, s.samples) for s in out.seqs] == [
        ("a", 5, True),
        ("b", 3, False),
    ]
    out, _ = step(sched)  # a decodes, b finishes its prompt
    assert [(s.request_id, s.start, s.num_new_tokens) for s in out.seqs] == [
        ("a", 5, 1),
        ("b", 3, 3),
    ]
    assert out.num_batched_tokens == 4


def test_decode_crossing_block_boundary_allocates_one_block() -> None:
    sched = make_sched()
    r = make_req("r", 8, max_tokens=None)
    sched.add_request(r)
    step(sched)  # prefill: 8 tokens, 2 blocks
    free = sched.block_manager.num_free_blocks
    assert len(sched.block_manager.get_block_ids("r")) == 2
    for pos in range(8, 14):
        out, _ = step(sched)
        assert out.seqs[0].start == pos
        blocks_needed = pos // BS + 1
        assert len(out.seqs[0].block_ids) == blocks_needed
        assert free - sched.block_manager.num_free_blocks == blocks_needed - 2


def test_decode_rows_come_first() -> None:
    sched = make_sched(max_num_batched_tokens=6)
    d = make_req("d", 3)
    sched.add_request(d)
    step(sched)  # d is decoding now
    p = make_req("p", 8)
    sched.add_request(p)
    out, _ = step(sched)  # p admitted behind d with a 5-token chunk
    assert [s.num_new_tokens for s in out.seqs] == [1, 5]
    # Put the prefilling request first in running order: rows still list decodes first.
    sched.running.reverse()
    out, _ = step(sched)
    assert [(s.request_id, s.is_decode) for s in out.seqs] == [("d", True), ("p", False)]
    assert out.seqs[1].num_new_tokens == 3 and out.seqs[1].samples


def test_max_num_seqs_respected() -> None:
    sched = make_sched(max_num_seqs=2)
    reqs = [make_req(f"r{i}", 3, max_tokens=2 + i) for i in range(4)]
    for r in reqs:
        sched.add_request(r)
    out, _ = step(sched)
    assert [s.request_id for s in out.seqs] == ["r0", "r1"]
    assert sched.num_running == 2 and sched.num_waiting == 2
    out, finished = step(sched)  # r0 reaches max_tokens=2
    assert [r.request_id for r in finished] == ["r0"]
    out, _ = step(sched)
    assert out.finished_ids == ["r0"]
    assert [s.request_id for s in out.seqs] == ["r1", "r2"]
    while sched.has_unfinished_requests():
        out, _ = step(sched)
        assert len(out.seqs) <= 2
    assert [r.num_output_tokens for r in reqs] == [2, 3, 4, 5]


def test_prefix_hit_through_scheduler() -> None:
    sched = make_sched()
    a = make_req("a", list(range(100, 113)))
    sched.add_request(a)
    step(sched)
    b = make_req("b", list(range(100, 112)) + [7, 8])
    sched.add_request(b)
    out, _ = step(sched)
    sb = next(s for s in out.seqs if s.request_id == b.request_id)
    assert b.num_cached_tokens == 12 and sb.start == 12 and sb.num_new_tokens == 2
    assert sb.block_ids[:3] == sched.block_manager.get_block_ids("a")[:3]
    assert [sched.block_manager.ref_count(x) for x in sb.block_ids[:3]] == [2, 2, 2]


def test_prefix_reused_after_first_request_finished() -> None:
    sched = make_sched()
    a = make_req("a", list(range(100, 109)), max_tokens=1)
    sched.add_request(a)
    out, finished = step(sched)
    a_blocks = list(out.seqs[0].block_ids)
    assert finished == [a] and sched.block_manager.num_free_blocks == 32
    b = make_req("b", list(range(100, 109)))
    sched.add_request(b)
    out, _ = step(sched)
    assert out.finished_ids == ["a"]
    assert b.num_cached_tokens == 8 and out.seqs[0].block_ids[:2] == a_blocks[:2]
    assert sched.block_manager.prefix_cache_hits == 8


def _pool_sched(**kw: int | bool) -> Scheduler:
    # 8 usable blocks of 4 tokens: 32 token slots
    return make_sched(num_blocks=9, max_model_len=32, **kw)


def test_preempts_the_tail_request() -> None:
    sched = _pool_sched()
    a, b = make_req("a", 16, max_tokens=8), make_req("b", 16, max_tokens=8)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)  # both prefilled: 4 + 4 blocks, pool empty
    assert sched.block_manager.num_free_blocks == 0
    out, _ = step(sched)  # a needs a 5th block: b is preempted
    assert out.preempted_ids == ["b"] and [s.request_id for s in out.seqs] == [a.request_id]
    assert b.status is RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.num_output_tokens == 1 and list(sched.waiting) == [b]
    assert sched.num_preemptions == 1


def test_request_preempts_itself_when_it_is_the_tail() -> None:
    sched = _pool_sched()
    a, b = make_req("a", 15, max_tokens=8), make_req("b", 16, max_tokens=8)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)
    out, _ = step(sched)  # a fits in its 4th block; b needs a 5th and is the tail
    assert out.preempted_ids == ["b"] and [s.request_id for s in out.seqs] == [a.request_id]
    assert a.num_output_tokens == 2 and b.status is RequestStatus.PREEMPTED


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preempted_request_resumes_and_finishes(prefix_caching: bool) -> None:
    def run(num_blocks: int) -> tuple[dict[str, list[int]], int]:
        sched = make_sched(
            num_blocks=num_blocks, max_model_len=32, enable_prefix_caching=prefix_caching
        )
        reqs = [make_req(f"r{i}", 8 + i, max_tokens=14, ignore_eos=True) for i in range(3)]
        for r in reqs:
            sched.add_request(r)
        run_to_end(sched)
        assert sched.block_manager.num_free_blocks == num_blocks - 1
        assert all(r.status is RequestStatus.FINISHED_LENGTH for r in reqs)
        return {r.request_id: r.output_token_ids for r in reqs}, sched.num_preemptions

    roomy, n_roomy = run(num_blocks=64)
    tight, n_tight = run(num_blocks=9)
    assert n_roomy == 0 and n_tight > 0
    assert tight == roomy and all(len(v) == 14 for v in tight.values())


def test_resumed_request_keeps_first_schedule_cache_count() -> None:
    sched = _pool_sched()
    a, b = make_req("a", 16, max_tokens=8), make_req("b", 16, max_tokens=8)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)
    step(sched)  # b preempted
    run_to_end(sched)
    assert b.num_cached_tokens == 0  # its resume hit the cache, but that is not a prompt hit
    assert b.num_output_tokens == 8


def test_abort_waiting_and_running_frees_every_block() -> None:
    sched = make_sched(max_num_seqs=2)
    reqs = [make_req(f"r{i}", 9) for i in range(4)]
    for r in reqs:
        sched.add_request(r)
    step(sched)
    assert sched.num_running == 2 and sched.num_waiting == 2
    sched.abort_requests(["r0", "r3", "unknown"])
    assert sched.num_running == 1 and sched.num_waiting == 1
    assert reqs[0].status is RequestStatus.FINISHED_ABORTED
    assert reqs[0].status.finish_reason == "abort"
    sched.abort_requests(["r1", "r2"])
    assert not sched.has_unfinished_requests()
    assert sched.block_manager.num_free_blocks == 32
    sched.block_manager.check_invariants()
    out = sched.schedule()
    assert out.seqs == [] and sorted(out.finished_ids) == ["r0", "r1", "r2", "r3"]


def test_abort_between_schedule_and_update_skips_the_row() -> None:
    sched = make_sched()
    a, b = make_req("a", 5), make_req("b", 5)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    sched.abort_requests(["a"])
    finished = sched.update_from_output(out, sample(sched, out))
    assert finished == [] and a.num_output_tokens == 0 and b.num_output_tokens == 1
    sched.block_manager.check_invariants()


def test_finish_requests_for_a_stop_string() -> None:
    sched = make_sched()
    a = make_req("a", 5)
    sched.add_request(a)
    step(sched)
    a.stop_reason = "###"
    sched.finish_requests(["a"], RequestStatus.FINISHED_STOPPED)
    assert a.status.finish_reason == "stop" and a.finished_time is not None
    assert sched.block_manager.num_free_blocks == 32
    assert sched.schedule().finished_ids == ["a"]
    with pytest.raises(ValueError, match="not a finished status"):
        sched.finish_requests(["a"], RequestStatus.RUNNING)


def _decode_until_done(params: dict[str, object], tokens: list[int], **kw: int) -> Request:
    """Feed `tokens` as the sampled tokens, one per step, until the request finishes."""
    sched = make_sched(**kw)
    r = make_req("r", 4, **params)
    sched.add_request(r)
    for t in tokens:
        _, finished = step(sched, {"r": t})
        if finished:
            assert finished == [r] and sched.block_manager.num_free_blocks == sched.config.num_blocks - 1
            return r
    raise AssertionError("request did not finish")


def test_stop_on_eos() -> None:
    r = _decode_until_done({}, [20, 21, EOS, 22])
    assert r.output_token_ids == [20, 21, EOS] and r.status is RequestStatus.FINISHED_STOPPED
    assert r.stop_reason is None and r.status.finish_reason == "stop"


def test_ignore_eos() -> None:
    r = _decode_until_done({"ignore_eos": True, "max_tokens": 4}, [EOS] * 10)
    assert r.output_token_ids == [EOS] * 4 and r.status is RequestStatus.FINISHED_LENGTH


def test_eos_before_min_tokens_is_ignored() -> None:
    r = _decode_until_done({"min_tokens": 3}, [EOS, EOS, 20, EOS])
    assert r.output_token_ids == [EOS, EOS, 20, EOS] and r.status is RequestStatus.FINISHED_STOPPED


def test_stop_token_ids() -> None:
    r = _decode_until_done({"stop_token_ids": [7, 8]}, [20, 8, 21])
    assert r.output_token_ids == [20, 8] and r.stop_reason == 8
    assert r.status is RequestStatus.FINISHED_STOPPED
    r = _decode_until_done({"stop_token_ids": [7], "min_tokens": 2}, [7, 7, 7])
    assert r.output_token_ids == [7, 7] and r.stop_reason == 7


def test_max_tokens() -> None:
    r = _decode_until_done({"max_tokens": 3}, [20] * 10)
    assert r.output_token_ids == [20] * 3 and r.status.finish_reason == "length"


def test_stop_token_beats_length_on_the_last_token() -> None:
    r = _decode_until_done({"max_tokens": 2, "stop_token_ids": [9]}, [20, 9])
    assert r.status is RequestStatus.FINISHED_STOPPED and r.stop_reason == 9


def test_max_model_len_without_max_tokens() -> None:
    r = _decode_until_done({"max_tokens": None}, [20] * 100, max_model_len=12)
    assert r.num_tokens == 12 and r.num_output_tokens == 8
    assert r.status is RequestStatus.FINISHED_LENGTH


def test_add_request_errors() -> None:
    sched = make_sched(max_model_len=16)
    with pytest.raises(ValueError, match="empty"):
        sched.add_request(make_req("a", []))
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add_request(make_req("b", 16))
    sched.add_request(make_req("c", 15))
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(make_req("c", 3))
    assert sched.num_waiting == 1


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="max_num_seqs"):
        make_sched(max_num_seqs=0)
    with pytest.raises(ValueError, match="block_size"):
        make_sched(block_size=0)
    with pytest.raises(ValueError, match="num_blocks"):
        make_sched(num_blocks=1)
    with pytest.raises(ValueError, match="larger than the KV cache"):
        make_sched(num_blocks=9, max_model_len=33)


def test_update_rejects_wrong_number_of_tokens() -> None:
    sched = make_sched()
    sched.add_request(make_req("a", 5))
    out = sched.schedule()
    with pytest.raises(ValueError, match="sampled tokens"):
        sched.update_from_output(out, [])


def test_status_properties() -> None:
    assert not RequestStatus.PREEMPTED.is_finished and RequestStatus.PREEMPTED.finish_reason is None
    assert RequestStatus.FINISHED_LENGTH.is_finished
    assert RequestStatus.FINISHED_LENGTH.finish_reason == "length"
    r = make_req("r", [1, 2, 3])
    r.output_token_ids += [4, 5]
    assert r.all_token_ids == [1, 2, 3, 4, 5] and r.num_tokens == 5
    assert r.token_ids_slice(2, 4) == [3, 4] and r.token_ids_slice(3, 5) == [4, 5]


# ---------------------------------------------------------------------- randomized stress
def _expected_outputs(req: Request, max_model_len: int) -> list[int]:
    """What the fake model generates for this request with nothing in the way."""
    sp = req.sampling_params
    ref = Request("ref", list(req.prompt_token_ids), sp)
    while True:
        t = fake_token(ref)
        ref.output_token_ids.append(t)
        n = ref.num_output_tokens
        if n >= sp.min_tokens and t in sp.stop_token_ids:
            return ref.output_token_ids
        if (sp.max_tokens is not None and n >= sp.max_tokens) or ref.num_tokens >= max_model_len:
            return ref.output_token_ids


@pytest.mark.parametrize("seed", range(12))
def test_random_workload_keeps_accounting_and_drains(seed: int) -> None:
    rng = random.Random(seed)
    sched = make_sched(
        max_num_seqs=rng.choice([2, 4, 6]),
        max_num_batched_tokens=rng.choice([5, 16, 40]),
        max_model_len=40,
        num_blocks=rng.choice([11, 16, 30]),
        enable_prefix_caching=rng.random() < 0.8,
    )
    bm, cfg = sched.block_manager, sched.config
    prefixes = [[rng.randrange(10, 60) for _ in range(rng.randrange(1, 20))] for _ in range(3)]
    kv: dict[tuple[int, int], int] = {}  # (block, offset) -> token whose K/V the slot holds
    reqs: list[Request] = []
    for t in range(3000):  # arrivals for 100 steps, then drain
        if t < 100:
            for _ in range(rng.choice([0, 0, 1, 2])):
                prompt = rng.choice(prefixes)[: rng.randrange(0, 20)]
                prompt = (prompt + [rng.randrange(10, 60) for _ in range(rng.randrange(1, 15))])[:39]
                params = dict(
                    max_tokens=rng.choice([None, 1, 5, 20]),
                    stop_token_ids=rng.sample(range(10, 60), k=rng.choice([0, 1])),
                    min_tokens=rng.choice([0, 2]),
                )
                r = make_req(f"q{len(reqs)}", prompt, **params)
                reqs.append(r)
                sched.add_request(r)
        if rng.random() < 0.05 and sched.has_unfinished_requests():
            victim = rng.choice([r for r in reqs if not r.is_finished])
            sched.abort_requests([victim.request_id])
        out = sched.schedule()
        assert out.num_batched_tokens == sum(s.num_new_tokens for s in out.seqs)
        assert out.num_batched_tokens <= cfg.max_num_batched_tokens
        assert sched.num_running <= cfg.max_num_seqs
        seen_prefill = False
        for s in out.seqs:
            seen_prefill |= not s.is_decode
            assert not (s.is_decode and seen_prefill), "decode rows must come first"
            r = sched.get_request(s.request_id)
            assert s.block_ids == bm.get_block_ids(r.request_id)
            assert s.token_ids == r.all_token_ids[s.start:s.start + s.num_new_tokens]  # the runner's copy
            assert s.spec is r.spec and s.spec.prompt_token_ids == r.prompt_token_ids
            if s.samples:
                assert s.num_output_tokens == r.num_output_tokens
            assert len(s.block_ids) * BS >= s.start + s.num_new_tokens
            tokens = r.all_token_ids
            for p in range(s.start):  # the cache holds exactly this request's earlier tokens
                assert kv[(s.block_ids[p // BS], p % BS)] == tokens[p]
            for p in range(s.start, s.start + s.num_new_tokens):
                block = s.block_ids[p // BS]
                assert bm.ref_count(block) == 1, "writing into a shared block"
                kv[(block, p % BS)] = tokens[p]
        bm.check_invariants()
        sched.update_from_output(out, sample(sched, out))
        bm.check_invariants()
        if t >= 100 and not sched.has_unfinished_requests():
            break
    assert not sched.has_unfinished_requests()
    assert bm.num_free_blocks == cfg.num_blocks - 1 and bm.usage == 0.0
    assert sched.schedule().seqs == []
    for r in reqs:
        assert r.is_finished
        if r.status is not RequestStatus.FINISHED_ABORTED:
            assert r.output_token_ids == _expected_outputs(r, cfg.max_model_len)


# ---------------------------------------------------------------------------- running ahead
def _run_ahead(sched: Scheduler, max_steps: int = 1000) -> dict[str, list[int]]:
    """Drive the scheduler as the engine does: schedule N+1 before N's tokens are resolved."""
    from jaxengine.scheduler import PLACEHOLDER

    outputs: dict[str, list[int]] = {}
    inflight = None
    for _ in range(max_steps):
        if not sched.has_unfinished_requests() and inflight is None:
            return outputs
        nxt = sched.schedule()
        if inflight is not None:
            out, tokens = inflight
            for req in sched.resolve(out, tokens):
                outputs[req.request_id] = list(req.output_token_ids)
        inflight = None
        if nxt.seqs:
            for s, req in zip(nxt.seqs, nxt._requests):  # only a decode row's input may be a placeholder
                assert PLACEHOLDER not in req.all_token_ids[: s.start + s.num_new_tokens - 1]
                assert PLACEHOLDER not in s.token_ids[:-1]
            sched.advance(nxt)
            # the "device" samples from real inputs: the previous placeholders are resolved by now
            inflight = (nxt, [(_next_after(req) if s.samples else None) for s, req in zip(nxt.seqs, nxt._requests)])
        sched.block_manager.check_invariants()
    raise AssertionError("did not drain")


def _next_after(req: Request) -> int:
    """fake_token of the request as it was before its placeholder was appended."""
    toks = req.all_token_ids[:-1]
    return 10 + (sum(toks) * 31 + len(toks)) % 50


def test_running_ahead_gives_the_same_tokens_as_lockstep() -> None:
    lock, ahead = make_sched(num_blocks=17), make_sched(num_blocks=17)
    for s in (lock, ahead):
        for i, n in enumerate((5, 20, 9, 33)):
            s.add_request(make_req(f"r{i}", n, max_tokens=12 + i))
    want: dict[str, list[int]] = {}
    for _ in range(1000):
        if not lock.has_unfinished_requests():
            break
        _, fin = step(lock)
        want.update({r.request_id: list(r.output_token_ids) for r in fin})
    got = _run_ahead(ahead)
    assert got == want
    assert ahead.num_preemptions > 0  # the small pool forced preemption while running ahead
    assert ahead.block_manager.num_free_blocks == 16


def test_finish_drops_the_placeholder_of_a_step_in_flight() -> None:
    from jaxengine.scheduler import PLACEHOLDER

    sched = make_sched()
    sched.add_request(make_req("a", 5))
    out = sched.schedule()
    sched.advance(out)
    req = sched.get_request("a")
    assert req.output_token_ids == [PLACEHOLDER]
    sched.finish_requests(["a"], RequestStatus.FINISHED_STOPPED)
    assert req.output_token_ids == [] and sched.block_manager.num_free_blocks == 32
    assert sched.resolve(out, [7]) == []  # the late token of a finished request is dropped
