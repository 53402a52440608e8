"""Beam search driven from the host, as vLLM's `LLM.beam_search` drives it: every step is one batch
of ordinary one-token requests, one per live beam, and the prefix cache shares what beams have in
common (the prompt and the tokens chosen so far) as cached KV blocks, so each step computes only
the tail of each beam that does not fill a block yet.

One call's life (`BeamSearch` is pure Python; `LLM.beam_search` and `AsyncEngine.beam_search` run
its requests):
1. Each prompt starts with one live beam: the prompt itself.
2. `pending()` lists every live beam's token ids (prompt + beam), all prompts together; the
   caller runs them as one batch of requests with `step_params()` (max_tokens=1,
   logprobs=2*beam_width) and hands each request's top logprobs back to `advance()`.
3. `advance` extends each beam by its 2*beam_width most likely tokens, summing logprobs (raw
   log-softmax of the logits). Per prompt the candidates are ranked by cum_logprob: an EOS
   candidate among the best beam_width finishes ("stop"; unless ignore_eos), the best beam_width
   non-EOS candidates stay live. At step max_tokens the best beam_width candidates finish
   ("length", or "stop" for EOS).
4. `outputs()` sorts each prompt's finished sequences by
   `cum_logprob / num_generated_tokens ** length_penalty` (an EOS counts as generated) and keeps
   the best beam_width.

This is transformers' `generate(num_beams=W, do_sample=False, early_stopping="never")`: same
candidates (the top 2W over all beams), same rule for finishing, same score. (Its default
`early_stopping=False` may stop before max_tokens on a length heuristic; "never" stops only when
no live beam can beat the finished ones, which changes nothing that is returned.) vLLM differs
in two details: it divides by the whole sequence length (prompt included, EOS excluded), and
it finishes every EOS candidate, not only those among the best beam_width.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from jaxengine.outputs import Logprob
from jaxengine.sampling_params import BeamSearchParams, SamplingParams

PromptIds = tuple[str | None, list[int]]  # (the prompt's text if it came as text, its token ids)


@dataclasses.dataclass
class BeamSearchSequence:
    """One beam. As in vLLM, `tokens` and `text` include the prompt; `output_token_ids` and
    `output_text` are the generated part alone."""

    tokens: list[int]  # prompt + generated token ids
    logprobs: list[dict[int, Logprob]]  # per generated token: that step's top logprobs
    cum_logprob: float = 0.0  # sum of the generated tokens' logprobs
    text: str | None = None  # decoded `tokens` (filled in by `outputs()`; None without a tokenizer)
    finish_reason: str | None = None  # "stop" (EOS) or "length"
    stop_reason: int | None = None  # the EOS token id that ended it
    num_prompt_tokens: int = 0
    output_text: str | None = None  # decoded output; the EOS only with include_stop_str_in_output

    @property
    def output_token_ids(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens:]

    @property
    def num_generated_tokens(self) -> int:
        return len(self.tokens) - self.num_prompt_tokens


@dataclasses.dataclass
class BeamSearchOutput:
    """One prompt's result: beam_width sequences, best (highest `beam_search_score`) first."""

    sequences: list[BeamSearchSequence]


def beam_search_score(seq: BeamSearchSequence, length_penalty: float) -> float:
    """transformers' length-penalised score: cum_logprob / generated_length ** length_penalty."""
    return seq.cum_logprob / (max(seq.num_generated_tokens, 1) ** length_penalty)


@dataclasses.dataclass
class _Instance:
    """One prompt's search state."""

    live: list[BeamSearchSequence]
    finished: list[BeamSearchSequence] = dataclasses.field(default_factory=list)


class BeamSearch:
    """The beams of every prompt of one call; see the module docstring for the protocol."""

    def __init__(self, prompts: Sequence[PromptIds], params: BeamSearchParams, eos_token_ids: Sequence[int], *,
                 max_model_len: int, max_logprobs: int):
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be BeamSearchParams, got {type(params).__name__}")
        if not prompts:
            raise ValueError("no prompts given")
        if 2 * params.beam_width > max_logprobs:
            raise ValueError(f"beam_width={params.beam_width} needs 2 * beam_width = {2 * params.beam_width} top "
                             f"logprobs per step, above the engine's max_logprobs={max_logprobs}")
        for _, ids in prompts:
            if len(ids) + params.max_tokens > max_model_len:
                raise ValueError(f"a prompt of {len(ids)} tokens plus max_tokens={params.max_tokens} exceeds "
                                 f"max_model_len={max_model_len}")
        self.params = params
        self.eos = frozenset() if params.ignore_eos else frozenset(int(t) for t in eos_token_ids)
        self.instances = [_Instance([BeamSearchSequence(list(ids), [], num_prompt_tokens=len(ids))])
                          for _, ids in prompts]
        self.step = 0  # steps taken (= tokens in every live beam)

    @property
    def done(self) -> bool:
        return self.step >= self.params.max_tokens or not any(inst.live for inst in self.instances)

    def step_params(self) -> SamplingParams:
        """What each step's one-token requests ask for (EOS is the search's business, not theirs)."""
        return SamplingParams(max_tokens=1, logprobs=2 * self.params.beam_width,
                              temperature=self.params.temperature, ignore_eos=True, detokenize=False)

    def pending(self) -> list[list[int]]:
        """Token ids (prompt + beam) of every live beam, prompt by prompt."""
        return [beam.tokens for inst in self.instances for beam in inst.live]

    def advance(self, top_logprobs: Sequence[dict[int, Logprob]]) -> None:
        """One step: `top_logprobs[i]` is the next-token logprobs of `pending()[i]`."""
        assert not self.done, "the search is over"
        num_live = sum(len(inst.live) for inst in self.instances)
        assert len(top_logprobs) == num_live, f"{len(top_logprobs)} results for {num_live} beams"
        self.step += 1
        at = 0
        for inst in self.instances:
            entries = top_logprobs[at:at + len(inst.live)]
            at += len(inst.live)
            self._advance_one(inst, entries)

    def _advance_one(self, inst: _Instance, entries: Sequence[dict[int, Logprob]]) -> None:
        width = self.params.beam_width
        last = self.step >= self.params.max_tokens
        # (cum_logprob, beam, token): only the top 2W of each beam; a sampled token outside them
        # (temperature > 0) is not a candidate, so the result does not depend on sampling.
        candidates = sorted(((beam.cum_logprob + lp.logprob, b, tid)
                             for b, (beam, entry) in enumerate(zip(inst.live, entries))
                             for tid, lp in entry.items() if lp.rank is not None and lp.rank <= 2 * width),
                            key=lambda c: -c[0])
        live: list[BeamSearchSequence] = []
        for rank, (cum, b, tid) in enumerate(candidates):
            if rank >= width and (last or len(live) >= width):
                break
            eos = tid in self.eos
            if rank >= width and eos:
                continue  # only the best W may finish (transformers' rule)
            parent, entry = inst.live[b], entries[b]
            seq = BeamSearchSequence(parent.tokens + [tid], parent.logprobs + [entry], cum,
                                     num_prompt_tokens=parent.num_prompt_tokens)
            if eos:
                seq.finish_reason, seq.stop_reason = "stop", tid
                inst.finished.append(seq)
            elif last:
                seq.finish_reason = "length"
                inst.finished.append(seq)
            else:
                live.append(seq)
        inst.live = live

    def outputs(self, tokenizer=None) -> list[BeamSearchOutput]:  # noqa: ANN001 - a transformers tokenizer
        """Per prompt, the best beam_width sequences by `beam_search_score`, with their text."""
        lp, width = self.params.length_penalty, self.params.beam_width
        results = []
        for inst in self.instances:
            pool = inst.finished + [dataclasses.replace(s, finish_reason="length") for s in inst.live]
            best = sorted(pool, key=lambda s: -beam_search_score(s, lp))[:width]
            if tokenizer is not None:
                for s in best:
                    s.text = tokenizer.decode(s.tokens)
                    s.output_text = self._output_text(tokenizer, s)
            results.append(BeamSearchOutput(best))
        return results

    def _output_text(self, tokenizer, seq: BeamSearchSequence) -> str:  # noqa: ANN001
        ids = seq.output_token_ids
        if seq.stop_reason is None:
            return tokenizer.decode(ids, skip_special_tokens=True)
        text = tokenizer.decode(ids[:-1], skip_special_tokens=True)
        if self.params.include_stop_str_in_output:
            text += tokenizer.decode(ids[-1:], skip_special_tokens=False)
        return text
