"""A model-free stand-in for `LLMEngine` with hand-computable outputs, for the engine-loop and
server-plumbing tests (no JAX, no compile).

Token ids are characters: the tokenizer maps text to code points. A request's k-th output token
is `ord("a") + k % 26`, so a request with max_tokens=m produces the first m letters of the
alphabet (cycling). Each running request holds one "block" of a pool, so leaks are countable.
A request is scheduled and gets its first token in its first step; a step schedules each new
request's prompt plus one token per unfinished sequence of the others (`step_tokens`).
"""

from __future__ import annotations

import dataclasses
import time
from types import SimpleNamespace

from jaxengine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from jaxengine.sampling_params import SamplingParams


class FakeTokenizer:
    chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens: bool = True, **_: object) -> str:  # noqa: ANN001
        return "".join(chr(i) for i in ids)

    def convert_ids_to_tokens(self, ids):  # noqa: ANN001, ANN201
        return [chr(i) for i in ids]

    def apply_chat_template(self, messages, chat_template, tokenize, add_generation_prompt,  # noqa: ANN001, ANN201
                            continue_final_message, **template_vars):
        import jinja2
        return jinja2.Template(chat_template).render(messages=messages, **template_vars)


@dataclasses.dataclass
class _Req:
    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    outputs: list[list[int]]
    metrics: RequestMetrics
    finish: list[str | None]


class FakeEngine:
    def __init__(self, *, max_model_len: int = 64, max_num_seqs: int = 4, num_blocks: int = 16,
                 fail_at_step: int | None = None, step_delay: float = 0.0, vocab_size: int = 0x110000):
        self.config = SimpleNamespace(max_model_len=max_model_len, max_num_seqs=max_num_seqs, model="fake-model")
        self.model_config = SimpleNamespace(vocab_size=vocab_size)
        self.tokenizer = FakeTokenizer()
        self.num_blocks = num_blocks
        self.free_blocks = num_blocks
        self.fail_at_step = fail_at_step
        self.step_delay = step_delay
        self.steps = 0
        self.step_tokens = 0  # scheduled by the last step
        self.scheduled_tokens = 0  # in all
        self.requests: dict[str, _Req] = {}
        self.aborted: list[str] = []

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None,  # noqa: ANN001
                    arrival_time: float | None = None, lora_request=None) -> None:  # noqa: ANN001
        if lora_request is not None:
            raise ValueError("the fake engine serves no LoRA adapters")
        params = params or SamplingParams()
        if isinstance(prompt, dict):
            text, ids = prompt.get("prompt"), list(prompt["prompt_token_ids"])
        elif isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, ids = None, list(prompt)
        if not ids:
            raise ValueError("the prompt is empty")
        bad = [t for t in ids if not 0 <= t < self.model_config.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids out of vocabulary [0, {self.model_config.vocab_size}): {bad[:5]}")
        if params.n > self.config.max_num_seqs:
            raise ValueError(f"n={params.n} exceeds max_num_seqs={self.config.max_num_seqs}")
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if self.free_blocks < params.n:
            raise ValueError("out of blocks")
        self.free_blocks -= params.n
        metrics = RequestMetrics(arrival_time=arrival_time or time.monotonic())
        self.requests[request_id] = _Req(request_id, text, ids, params, [[] for _ in range(params.n)], metrics,
                                          [None] * params.n)

    def abort_request(self, request_ids) -> None:  # noqa: ANN001
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for rid in ids:
            req = self.requests.pop(rid, None)
            if req is not None:
                self.free_blocks += req.params.n
                self.aborted.append(rid)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[RequestOutput]:
        self.steps += 1
        if self.fail_at_step is not None and self.steps >= self.fail_at_step:
            raise RuntimeError("simulated device failure")
        if self.step_delay:
            time.sleep(self.step_delay)
        now = time.monotonic()
        results = []
        self.step_tokens = 0
        for rid, req in list(self.requests.items()):
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = now
                self.step_tokens += len(req.prompt_ids)
            else:
                self.step_tokens += sum(f is None for f in req.finish)
            for i, out in enumerate(req.outputs):
                if req.finish[i] is None:
                    out.append(ord("a") + len(out) % 26)
                    if len(out) >= (req.params.max_tokens or 8):
                        req.finish[i] = "length"
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
            req.metrics.last_token_time = now
            done = all(f is not None for f in req.finish)
            if done:
                req.metrics.finished_time = now
                del self.requests[rid]
                self.free_blocks += req.params.n
            outs = [CompletionOutput(index=i, text=self.tokenizer.decode(o), token_ids=list(o), cumulative_logprob=None,
                                     logprobs=None, finish_reason=req.finish[i]) for i, o in enumerate(req.outputs)]
            results.append(RequestOutput(rid, req.prompt, req.prompt_ids, None, outs, done, req.metrics, 0))
        self.scheduled_tokens += self.step_tokens
        return results

    def stats(self) -> dict[str, float]:
        return {"num_running": len(self.requests), "num_waiting": 0,
                "kv_cache_usage": 1 - self.free_blocks / self.num_blocks, "prefix_cache_queries": 0,
                "prefix_cache_hits": 0, "num_preemptions": 0, "step_tokens": self.step_tokens}
