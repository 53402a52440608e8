"""The scheduler's steady-decode columns (jaxengine/steady_decode.py) change nothing it outputs.

Two schedulers, one with the steady path and one without (`use_steady = False`), are driven
through the same random workloads (requests arriving, eos and stop ids, max_tokens, aborts, stop
strings, preemption for lack of blocks), one step ahead as the engine runs them and in lockstep;
every step's rows, preempted and finished ids, the requests each resolve finishes, and every
request's final state must be equal, and the steady path must have served most decode steps.
"""

from __future__ import annotations

import random

import pytest

from jaxengine.request import Request, RequestStatus
from jaxengine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from tests.engine.test_scheduler import EOS, FakeParams


def _token(rid: str, n: int, seed: int) -> int:
    """The 'model': the n-th output of a request, eos now and then, never the placeholder."""
    return (hash((rid, n, seed)) % 40) + EOS


def _rows(out: SchedulerOutput) -> list[tuple]:
    return [(s.request_id, s.start, s.num_new_tokens, list(s.token_ids), list(s.block_ids), s.samples,
             s.output_token_ids, s.num_drafts) for s in out.seqs]


def _drive(seed: int, steady: bool, overlap: bool, num_blocks: int) -> tuple[list, int]:
    rng = random.Random(seed)
    sched = Scheduler(SchedulerConfig(max_num_seqs=12, max_num_batched_tokens=40, max_model_len=64,
                                      num_blocks=num_blocks, block_size=4))
    sched.use_steady = steady
    log: list = []
    reqs: list[Request] = []
    steady_steps = 0
    prev: SchedulerOutput | None = None
    for i in range(300):
        if rng.random() < (0.5 if i < 10 else 0.05):
            params = FakeParams(max_tokens=rng.choice([None, 3, 12, 30]), ignore_eos=rng.random() < 0.5,
                                stop_token_ids=rng.sample(range(3, 42), rng.choice([0, 1])),
                                min_tokens=rng.choice([0, 0, 2]), reads_history=rng.random() < 0.1)
            r = Request(f"r{i}", [rng.randrange(3, 90) for _ in range(rng.randrange(1, 14))], params,
                        eos_token_ids=(EOS,))
            sched.add_request(r)
            reqs.append(r)
        live = [r for r in reqs if not r.is_finished]
        if live and rng.random() < 0.03:
            sched.abort_requests([rng.choice(live).request_id])
        if live and rng.random() < 0.03:  # a stop string, found by output processing
            sched.finish_requests([rng.choice(live).request_id], RequestStatus.FINISHED_STOPPED)
        out = sched.schedule()
        steady_steps += out._steady is not None
        log.append(("schedule", _rows(out), out.preempted_ids, out.finished_ids, out.num_batched_tokens))
        if not overlap and out.seqs:
            sched.advance(out)
            prev, out = out, None
        if prev is not None:
            sampled = [_token(s.request_id, s.num_output_tokens, seed) if s.samples else None for s in prev.seqs]
            log.append(("resolve", [r.request_id for r in sched.resolve(prev, sampled)]))
            prev = None
        if out is not None and out.seqs:
            sched.advance(out)
            prev = out
        sched.block_manager.check_invariants()
        if not sched.has_unfinished_requests() and i > 20:
            break
    log.append([(r.request_id, r.status, r.output_token_ids, r.num_computed_tokens, r.stop_reason) for r in reqs])
    return log, steady_steps


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("num_blocks", [24, 200])
@pytest.mark.parametrize("seed", range(6))
def test_steady_path_schedules_as_the_general_loop(seed: int, overlap: bool, num_blocks: int) -> None:
    got, steady_steps = _drive(seed, True, overlap, num_blocks)
    want, none = _drive(seed, False, overlap, num_blocks)
    assert none == 0
    assert got == want
    assert steady_steps > 0


@pytest.mark.parametrize("seed", range(4))
def test_runner_inputs_one_step_ahead_equal_reference(seed: int) -> None:
    """The runner's path for steady steps (the persistent batch reading the scheduler's columns,
    the builder rewriting only what moved, the packed sampling metadata from the slots) gives
    the per-token reference's inputs and `batch_sampling_metadata`'s, one step ahead as the
    engine runs: tokens in flight, block tables growing, rows finishing and arriving."""
    import dataclasses

    import numpy as np

    from jaxengine.input_batch import InputBuilder
    from jaxengine.packing import pack
    from jaxengine.persistent_batch import PersistentBatch
    from jaxengine.sampler import batch_sampling_metadata, rows_sampling_packed
    from tests.engine.test_host_fast_paths import _random_params
    from tests.engine.test_input_batch import BS, M, reference
    from tests.engine.test_persistent_batch import _inputs_dict

    rng = random.Random(seed)
    max_seqs, t = 6, 32
    sched = Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=t, max_model_len=M * BS,
                                      num_blocks=30, block_size=BS))
    batch, builder = PersistentBatch(max_seqs, M), InputBuilder(M, BS)
    prev: SchedulerOutput | None = None
    prev_ids: list[str] | None = None
    steady_builds = 0
    for i in range(500):
        if i < 200 and rng.random() < 0.08:
            p = dataclasses.replace(_random_params(rng), max_tokens=rng.randrange(1, 80), ignore_eos=True,
                                    repetition_penalty=1.0, frequency_penalty=0.0)
            sched.add_request(Request(f"r{i}", [rng.randrange(10, 90) for _ in range(rng.randrange(1, 30))], p,
                                      eos_token_ids=(EOS,), seed=rng.randrange(2**32)))
        out = sched.schedule()
        batch.release(out.finished_ids)
        batch.release(out.preempted_ids)
        seqs = out.seqs
        prev_rows = {s.request_id: j for j, s in enumerate(prev.seqs) if s.samples} if prev is not None else {}
        ids = None
        if seqs:
            if out.num_batched_tokens == len(seqs):
                rows = batch.rows(seqs, out.columns)
                same = prev_ids is not None and prev_ids == rows.ids
                steady_builds += same and out.columns is not None
                got = builder.build(seqs, t, max_seqs, None if same else prev_rows, None, (batch, rows), same)
                ids = rows.ids if out.all_sample else None
                packed = rows_sampling_packed(batch, rows, max_seqs)
                if packed is not None:
                    md, _, truncate = batch_sampling_metadata(seqs, (EOS,), max_seqs, 16)
                    assert packed[1] == truncate
                    np.testing.assert_array_equal(packed[0], pack(md))
            else:
                got = builder.build(seqs, t, max_seqs, prev_rows)
            want = reference(seqs, t, max_seqs, prev_rows)
            for k, v in want.items():
                np.testing.assert_array_equal(_inputs_dict(got)[k], v, err_msg=k)
        if prev is not None:
            sched.resolve(prev, [_token(s.request_id, s.num_output_tokens, seed) if s.samples else None
                                 for s in prev.seqs])
        prev, prev_ids = None, None
        if seqs:
            sched.advance(out)
            prev, prev_ids = out, ids
        if i > 200 and not sched.has_unfinished_requests():
            break
    assert steady_builds > 20


def test_drafts_set_in_the_steady_state_are_scheduled() -> None:
    """Drafts proposed for a request of a steady decode go through `set_drafts`: the next step is
    scheduled by the general loop and carries them."""
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, num_blocks=32,
                                      block_size=4))
    reqs = [Request(f"r{i}", [5, 6, 7], FakeParams(max_tokens=30), eos_token_ids=(EOS,)) for i in range(2)]
    for r in reqs:
        sched.add_request(r)
    for _ in range(3):  # prefill, then two decodes: the second comes from the columns
        out = sched.schedule()
        sched.update_from_output(out, [40] * len(out.seqs))
    assert out._steady is not None and out.columns is not None
    sched.set_drafts(reqs[1], [41, 42])
    out = sched.schedule()
    assert out.columns is None and [s.num_drafts for s in out.seqs] == [0, 2]
    assert out.seqs[1].token_ids == [40, 41, 42]
