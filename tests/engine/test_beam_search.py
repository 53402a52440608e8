"""Beam search (`LLM.beam_search`): every beam equals transformers' `generate(num_beams=...)` on a tiny
random Llama (float32, CPU), with and without EOS; several prompts in one call; results sorted by
length-penalised score; later steps served by the prefix cache; bad parameters refused. The
search itself (`BeamSearch`) is also checked on hand-made logprobs, without a model."""

from __future__ import annotations

import math

import pytest
import torch

from jaxengine import LLM, BeamSearchParams
from jaxengine.beam_search import BeamSearch, beam_search_score
from jaxengine.outputs import Logprob
from tests.engine.test_engine import PROMPTS, make_llm
from tests.tiny_checkpoints import load_reference, make_checkpoint

# Prompts whose best beam is not the greedy sequence, and whose beams part early.
BEAM_PROMPTS = [PROMPTS[1], PROMPTS[6]]
# A token the tiny Llama's beams produce after PROMPTS[1] (third place, in beams that did not
# pick it second): made the EOS of a copy of the checkpoint, it ends beams at several lengths.
EOS_FOR_TEST = 48324


def reference_beams(ref, ids: list[int], width: int, max_tokens: int, length_penalty: float = 1.0,
                    eos_token_id: int | None = None) -> tuple[list[list[int]], list[float]]:
    """transformers' beams (generated ids, EOS included, padding cut) and their scores.
    early_stopping="never": search until no live beam can beat the finished ones (see
    jaxengine/beam_search.py); transformers' default stops earlier on a length heuristic."""
    with torch.no_grad():
        gen = ref.generate(torch.tensor([ids]), num_beams=width, num_return_sequences=width, do_sample=False,
                           max_new_tokens=max_tokens, length_penalty=length_penalty, early_stopping="never",
                           eos_token_id=eos_token_id, pad_token_id=0, return_dict_in_generate=True,
                           output_scores=True)
    beams = []
    for seq in gen.sequences[:, len(ids):].tolist():
        if eos_token_id is not None and eos_token_id in seq:
            seq = seq[:seq.index(eos_token_id) + 1]
        beams.append(seq)
    return beams, gen.sequences_scores.tolist()


@pytest.fixture(scope="module")
def llama(tiny_model_factory, xla_cache_dir) -> tuple[str, LLM]:
    path = tiny_model_factory("llama")
    return path, make_llm(path, xla_cache_dir)


@pytest.mark.parametrize("width", [2, 3])
def test_beams_equal_transformers(llama, width):
    path, llm = llama
    ref = load_reference(path)
    params = BeamSearchParams(beam_width=width, max_tokens=6, ignore_eos=True)
    outs = llm.beam_search(BEAM_PROMPTS, params)  # both prompts in one call
    assert len(outs) == len(BEAM_PROMPTS)
    tok = llm.get_tokenizer()
    for prompt, out in zip(BEAM_PROMPTS, outs):
        ids = tok.encode(prompt)
        want, scores = reference_beams(ref, ids, width, 6)
        assert [s.output_token_ids for s in out.sequences] == want
        assert [s.tokens[:len(ids)] for s in out.sequences] == [ids] * width  # vLLM's: tokens hold the prompt
        for s, score in zip(out.sequences, scores):
            assert beam_search_score(s, 1.0) == pytest.approx(score, abs=1e-4)
            assert len(s.logprobs) == 6 and s.finish_reason == "length" and s.stop_reason is None
            assert s.cum_logprob == pytest.approx(sum(lp[t].logprob for lp, t in zip(s.logprobs, s.output_token_ids)))
            assert s.output_text == tok.decode(s.output_token_ids) and s.text == tok.decode(s.tokens)
    # the best beam is not the greedy sequence here: the search really searched
    greedy = llm.beam_search(BEAM_PROMPTS, BeamSearchParams(beam_width=1, max_tokens=6, ignore_eos=True))
    assert all(g.sequences[0].output_token_ids != o.sequences[0].output_token_ids for g, o in zip(greedy, outs))


def test_prompts_batched_equal_one_by_one_and_sorted(llama):
    _, llm = llama
    params = BeamSearchParams(beam_width=3, max_tokens=5, ignore_eos=True, length_penalty=0.5)
    prompts = [PROMPTS[0], {"prompt": PROMPTS[2]}, {"prompt_token_ids": llm.get_tokenizer().encode(PROMPTS[5])}]
    together = llm.beam_search(prompts, params)
    for prompt, out in zip(prompts, together):
        [alone] = llm.beam_search(prompt, params)
        assert [s.tokens for s in alone.sequences] == [s.tokens for s in out.sequences]
        scores = [beam_search_score(s, 0.5) for s in out.sequences]
        assert scores == sorted(scores, reverse=True) and len(scores) == 3


def test_eos_ends_beams_as_in_transformers(tiny_model_factory, smollm2_tokenizer_dir, xla_cache_dir, tmp_path):
    """The same weights with a token the beams produce as EOS: beams finish at different lengths, and
    the length penalty decides their order, as in transformers."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)
    path = make_checkpoint("llama", str(tmp_path / "eos"), tokenizer=tok, eos_token_id=EOS_FOR_TEST)
    llm = make_llm(path, xla_cache_dir)
    assert llm.llm_engine.eos_token_ids == (EOS_FOR_TEST,)
    ref = load_reference(path)
    ids = tok.encode(PROMPTS[1])
    stopped = 0
    for length_penalty in (1.0, 0.0, 2.0):
        [out] = llm.beam_search(PROMPTS[1], BeamSearchParams(beam_width=3, max_tokens=6, length_penalty=length_penalty))
        want, scores = reference_beams(ref, ids, 3, 6, length_penalty, EOS_FOR_TEST)
        assert [s.output_token_ids for s in out.sequences] == want, length_penalty
        for s, score in zip(out.sequences, scores):
            assert beam_search_score(s, length_penalty) == pytest.approx(score, abs=1e-4)
            ended = s.output_token_ids[-1] == EOS_FOR_TEST
            assert (s.finish_reason, s.stop_reason) == (("stop", EOS_FOR_TEST) if ended else ("length", None))
            stopped += ended
            if ended:  # the EOS's text is left out unless asked for
                assert s.output_text == tok.decode(s.output_token_ids[:-1])
    assert stopped  # EOS really ended beams
    [kept] = llm.beam_search(PROMPTS[1], BeamSearchParams(3, 6, include_stop_str_in_output=True))
    [s] = [s for s in kept.sequences if s.stop_reason is not None][:1]
    assert s.output_text == tok.decode(s.output_token_ids)


def test_later_steps_hit_the_prefix_cache(llama):
    _, llm = llama
    engine = llm.llm_engine
    seen = []
    step = engine.step

    def recording_step():  # noqa: ANN202
        outs = step()
        seen.extend(outs)
        return outs

    engine.step = recording_step
    try:
        llm.beam_search(PROMPTS[3], BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True))
    finally:
        del engine.step
    num_prompt = len(llm.get_tokenizer().encode(PROMPTS[3]))
    assert num_prompt >= 16
    later = [o for o in seen if len(o.prompt_token_ids) > num_prompt]  # steps 2..4: prompt + beam tokens
    assert len(later) == 2 * 3
    # every later step reads the prompt's full blocks from the cache
    assert all((o.num_cached_tokens or 0) >= num_prompt // 16 * 16 for o in later)
    bm = engine.scheduler.block_manager
    assert not engine.has_unfinished_requests() and bm.num_free_blocks == engine.config.num_kv_blocks - 1


@pytest.mark.parametrize("kw, match", [
    (dict(beam_width=0, max_tokens=4), "beam_width must be at least 1"),
    (dict(beam_width=2, max_tokens=0), "max_tokens must be at least 1"),
    (dict(beam_width=2, max_tokens=4, length_penalty=math.inf), "length_penalty must be a finite number"),
    (dict(beam_width=2, max_tokens=4, length_penalty=math.nan), "length_penalty must be a finite number"),
    (dict(beam_width=11, max_tokens=4), "beam_width must be at most 10"),
    (dict(beam_width=2.0, max_tokens=4), "beam_width must be an integer"),
    (dict(beam_width=2, max_tokens=4, temperature=3.0), "temperature must be in"),
])
def test_bad_params_raise(kw, match):
    with pytest.raises(ValueError, match=match):
        BeamSearchParams(**kw)


def test_engine_limits_raise(llama):
    _, llm = llama
    with pytest.raises(ValueError, match="above the engine's max_logprobs=4"):
        BeamSearch([(None, [1, 2])], BeamSearchParams(3, 4), [2], max_model_len=64, max_logprobs=4)
    with pytest.raises(ValueError, match="exceeds max_model_len=256"):
        llm.beam_search({"prompt_token_ids": [5] * 250}, BeamSearchParams(2, 8))
    with pytest.raises(ValueError, match="must be BeamSearchParams"):
        llm.beam_search("hi", {"beam_width": 2})  # type: ignore[arg-type]


def _entry(logprobs: dict[int, float]) -> dict[int, Logprob]:
    ranked = sorted(logprobs.items(), key=lambda kv: -kv[1])
    return {t: Logprob(lp, rank) for rank, (t, lp) in enumerate(ranked, 1)}


def test_search_on_hand_made_logprobs():
    """Width 2, EOS = 9. Step 1: EOS is the second candidate, so it finishes, and the third stays live.
    Step 2: the two best candidates stay live; the EOS ranked fourth does not finish. Step 3 (the
    last): only the two best candidates finish; the EOS ranked fourth does not."""
    search = BeamSearch([(None, [1])], BeamSearchParams(2, 3, length_penalty=1.0), [9], max_model_len=64,
                        max_logprobs=20)
    assert search.pending() == [[1]]
    search.advance([_entry({5: -0.1, 9: -1.0, 6: -2.0, 7: -3.0})])
    assert search.pending() == [[1, 5], [1, 6]]
    search.advance([_entry({5: -2.5, 8: -2.6, 9: -2.7, 3: -4.0}), _entry({4: -0.1, 9: -5.0, 2: -6.0, 3: -7.0})])
    assert search.pending() == [[1, 6, 4], [1, 5, 5]]  # cum -2.1 and -2.6
    search.advance([_entry({1: -0.1, 2: -0.2, 3: -0.3, 9: -9.0}), _entry({9: -0.01, 1: -1.0, 2: -2.0, 3: -3.0})])
    assert search.done
    [out] = search.outputs()
    got = [(s.tokens[1:], round(s.cum_logprob, 3), s.finish_reason) for s in out.sequences]
    # finished: [9] -1.0 (score -1.0), [6, 4, 1] -2.2 (-0.733), [6, 4, 2] -2.3 (-0.767)
    assert got == [([6, 4, 1], -2.2, "length"), ([6, 4, 2], -2.3, "length")]
    with pytest.raises(AssertionError, match="the search is over"):
        search.advance([])
