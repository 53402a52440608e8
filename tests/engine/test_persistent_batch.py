"""The persistent batch (jaxengine/persistent_batch.py) against the per-row builders it shortcuts.

A real scheduler with a small KV pool runs random requests (adds, aborts, finishes, preemption);
each one-token step is built both ways: the inputs from the persistent batch's slots must equal the
per-token reference, its sampling metadata must equal `batch_sampling_metadata`'s, a running
request keeps its slot, and slots of finished, aborted and preempted requests are reused.
"""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest

from jaxengine.input_batch import InputBuilder
from jaxengine.packing import pack
from jaxengine.persistent_batch import PersistentBatch
from jaxengine.request import Request
from jaxengine.sampler import batch_sampling_metadata, rows_sampling_metadata, rows_sampling_packed
from jaxengine.scheduler import Scheduler, SchedulerConfig
from tests.engine.test_host_fast_paths import EOS, _random_params
from tests.engine.test_input_batch import BS, M, reference

MAX_SEQS = 6


def _inputs_dict(inputs) -> dict[str, np.ndarray]:
    return {"input_ids": inputs.input_ids, "positions": inputs.positions, "prev_index": inputs.prev_index,
            "slot_mapping": inputs.attn.slot_mapping, "kv_lens": inputs.attn.kv_lens,
            "block_tables": inputs.attn.block_tables, "query_start_loc": inputs.attn.query_start_loc,
            "logits_indices": inputs.logits_indices}


@pytest.mark.parametrize("columns", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_persistent_rows_equal_per_row_build(seed: int, columns: bool) -> None:
    """`columns`: steady decode steps hand the batch the scheduler's columns (as the runner does)."""
    rng = random.Random(seed)
    sched = Scheduler(SchedulerConfig(max_num_seqs=MAX_SEQS, max_num_batched_tokens=32, max_model_len=M * BS,
                                      num_blocks=14, block_size=BS))
    batch = PersistentBatch(MAX_SEQS, M)
    builder = InputBuilder(M, BS)
    reqs: list[Request] = []
    prev_slots: dict[str, int] = {}
    fast_steps = reused = column_steps = 0
    for step in range(600):
        if step < 80 and rng.random() < 0.3:
            p = dataclasses.replace(_random_params(rng), max_tokens=rng.randrange(1, 60), ignore_eos=True)
            r = Request(f"r{step}", [rng.randrange(10, 90) for _ in range(rng.randrange(1, 40))], p,
                        eos_token_ids=EOS, seed=rng.randrange(0, 2**40))
            reqs.append(r)
            sched.add_request(r)
        if rng.random() < 0.03:
            live = [r for r in reqs if not r.is_finished]
            if live:
                sched.abort_requests([rng.choice(live).request_id])
        out = sched.schedule()
        batch.release(out.finished_ids)
        batch.release(out.preempted_ids)
        for rid in out.finished_ids + out.preempted_ids:
            prev_slots.pop(rid, None)
        seqs = out.seqs
        if seqs and out.num_batched_tokens == len(seqs):
            fast_steps += 1
            column_steps += out.columns is not None
            rows = batch.rows(seqs, out.columns if columns else None)
            slots = rows.slots.tolist()
            assert len(set(slots)) == len(slots)
            for s, slot in zip(seqs, slots):
                if s.request_id in prev_slots:  # still running: same slot
                    assert prev_slots[s.request_id] == slot, s.request_id
                elif slot in prev_slots.values():
                    raise AssertionError(f"slot {slot} of a running request given to {s.request_id}")
            reused += sum(1 for slot in slots if slot not in prev_slots.values())
            prev_slots.update({s.request_id: slot for s, slot in zip(seqs, slots)})
            got = _inputs_dict(builder.build(seqs, 8, MAX_SEQS, None, None, (batch, rows)))
            want = reference(seqs, 8, MAX_SEQS, {})
            for k, v in want.items():
                np.testing.assert_array_equal(got[k], v, err_msg=k)
            fast = rows_sampling_metadata(batch, rows, MAX_SEQS)
            md, processors, truncate = batch_sampling_metadata(seqs, EOS, MAX_SEQS, 16)
            assert (fast is None) == (processors or md.banned_ids.max() >= 0 or any(
                s.start + 1 - len(s.spec.prompt_token_ids) < s.spec.params.min_tokens for s in seqs))
            if fast is not None:
                fmd, ftrunc = fast
                assert ftrunc == truncate
                for f in dataclasses.fields(md):
                    a, b = getattr(fmd, f.name), getattr(md, f.name)
                    assert a.dtype == b.dtype and a.shape == b.shape, f.name
                    np.testing.assert_array_equal(a, b, err_msg=f.name)
                packed, ptrunc = rows_sampling_packed(batch, rows, MAX_SEQS)  # what the runner sends
                assert ptrunc == truncate
                np.testing.assert_array_equal(packed, pack(md))
            else:
                assert rows_sampling_packed(batch, rows, MAX_SEQS) is None
        sched.update_from_output(out, [rng.randrange(10, 90) if s.samples else None for s in seqs])
        if step >= 80 and not sched.has_unfinished_requests():
            break
    assert not sched.has_unfinished_requests()
    assert fast_steps > 20 and sched.num_preemptions > 0 and column_steps > 0
    assert len(batch._slot_of) <= MAX_SEQS  # releases kept up: no slot leaked


def test_stale_slot_is_refilled_without_release() -> None:
    """A request preempted (or an id reused) without a release has a new block-table list: its
    row is filled again instead of reading the old slot's table."""
    from jaxengine.request import RequestSpec
    from jaxengine.sampling_params import SamplingParams
    from jaxengine.scheduler import ScheduledSeq

    batch = PersistentBatch(2, M)
    spec = RequestSpec(SamplingParams(temperature=0.0), 1, [5, 6, 7])
    first = ScheduledSeq("a", 3, 1, [-1], [4, 9], True, spec, None)
    rows = batch.rows([first])
    np.testing.assert_array_equal(batch.block_tables[rows.slots[0], :3], [4, 9, 0])
    first.block_ids.append(11)  # grows in place: the table row is rewritten
    rows = batch.rows([first])
    np.testing.assert_array_equal(batch.block_tables[rows.slots[0], :3], [4, 9, 11])
    again = ScheduledSeq("a", 3, 1, [-1], [8], True, spec, None)  # readmitted: a new list, same length
    rows2 = batch.rows([again])
    assert rows2.slots[0] == rows.slots[0]
    np.testing.assert_array_equal(batch.block_tables[rows2.slots[0], :2], [8, 0])
    # more new requests than free slots (releases missed): the batch starts over
    many = [ScheduledSeq(str(i), 0, 1, [1], [i + 1], True, spec, None) for i in range(4)]
    rows3 = batch.rows(many)
    assert sorted(rows3.slots.tolist()) == [0, 1, 2, 3]
    np.testing.assert_array_equal(batch.block_tables[rows3.slots, 0], [1, 2, 3, 4])
