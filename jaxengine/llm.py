"""`LLM`: the offline Python API, shaped like vLLM's (`generate`, `chat`, `beam_search`)."""

from __future__ import annotations

import dataclasses
import inspect
import logging
from typing import Sequence

from tqdm.auto import tqdm

from jaxengine.beam_search import BeamSearch, BeamSearchOutput
from jaxengine.config import EngineConfig
from jaxengine.engine import LLMEngine
from jaxengine.lora import LoRARequest
from jaxengine.outputs import PoolingRequestOutput, RequestOutput
from jaxengine.pooling import DecoderPoolingEngine, PoolingEngine, make_pooling_engine, wants_pooling
from jaxengine.pooling_params import PoolingParams
from jaxengine.sampling_params import BeamSearchParams, SamplingParams

logger = logging.getLogger(__name__)

PromptType = str | dict | Sequence[int]
Message = dict[str, object]


class LLM:
    """An LLM engine for offline batched generation.

    `LLM()` with no model loads the embedded default, SmolLM2-135M-Instruct.
    Every keyword is an `EngineConfig` field (max_model_len, max_num_seqs, block_size, ...).
    """

    def __init__(self, model: str | None = None, tokenizer: str | None = None, dtype: str = "auto",
                 max_model_len: int | None = None, max_num_seqs: int = 256,
                 max_num_batched_tokens: int | None = None, block_size: int = 16,
                 gpu_memory_utilization: float = 0.9, num_kv_blocks: int | None = None,
                 enable_prefix_caching: bool = True, tensor_parallel_size: int = 1, seed: int = 0,
                 load_format: str = "auto", distributed_executor_backend: str = "uni", **kwargs):
        if distributed_executor_backend != "uni":
            raise ValueError(
                f"distributed_executor_backend={distributed_executor_backend!r}: LLM() drives every GPU from this "
                "process ('uni'); one process per GPU ('mp') is started from the command line: "
                "jaxengine serve|generate ... --tensor-parallel-size N --distributed-executor-backend mp")
        config = EngineConfig(model=model, tokenizer=tokenizer, dtype=dtype, max_model_len=max_model_len,
                              max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                              block_size=block_size, gpu_memory_utilization=gpu_memory_utilization,
                              num_kv_blocks=num_kv_blocks, enable_prefix_caching=enable_prefix_caching,
                              tensor_parallel_size=tensor_parallel_size, seed=seed, load_format=load_format,
                              **kwargs)
        # A pooling model (runner="pooling", an embed / classify / score task, or an encoder
        # checkpoint) gets the pooling engine; everything else the generating engine.
        self.pooling_engine: PoolingEngine | DecoderPoolingEngine | None = None
        self.llm_engine: LLMEngine | None = None
        if wants_pooling(config):
            self.pooling_engine = make_pooling_engine(config)
        else:
            self.llm_engine = LLMEngine(config)

    def get_tokenizer(self):
        return self.pooling_engine.tokenizer if self.pooling_engine is not None else self.llm_engine.tokenizer

    def _generating(self) -> LLMEngine:
        if self.llm_engine is None:
            raise ValueError(f"{self.pooling_engine.model_config.architecture} is a pooling model: use "
                             f"{' / '.join(self.pooling_engine.supported_tasks())}, not generate / chat")
        return self.llm_engine

    def _pooling(self, task: str) -> PoolingEngine | DecoderPoolingEngine:
        if self.pooling_engine is None:
            raise ValueError(f"{self.llm_engine.model_config.architecture} was loaded to generate: {task} needs "
                             "LLM(..., runner='pooling') (an embedding, classification or cross-encoder model, or a "
                             "decoder model for last-token embeddings)")
        self.pooling_engine.check_task(task)
        return self.pooling_engine

    def generate(self, prompts: PromptType | Sequence[PromptType] | None = None,
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, prompt_token_ids: list[int] | list[list[int]] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Generates completions; results come back in input order. `prompts` are strings, token-id
        lists or vLLM's TextPrompt / TokensPrompt dicts; vLLM's older `prompt_token_ids=` keyword
        (one list or a list of lists) stands for TokensPrompts. `lora_request`: one adapter for
        every prompt, or one (or None) per prompt (needs `enable_lora=True`)."""
        if prompt_token_ids is not None:
            if prompts is not None:
                raise ValueError("give prompts or prompt_token_ids, not both")
            lists = [prompt_token_ids] if prompt_token_ids and isinstance(prompt_token_ids[0], int) else prompt_token_ids
            prompts = [{"prompt_token_ids": list(ids)} for ids in lists]
        if prompts is None:
            raise ValueError("no prompts given")
        self._generating()
        prompt_list = self._as_list(prompts)
        params = self._params_list(sampling_params, len(prompt_list))
        if lora_request is None or not isinstance(lora_request, (list, tuple)):
            loras = [lora_request] * len(prompt_list)
        else:
            loras = list(lora_request)
            if len(loras) != len(prompt_list):
                raise ValueError(f"got {len(loras)} lora requests for {len(prompt_list)} prompts")
        return self._run(prompt_list, params, use_tqdm, loras)

    def chat(self, messages: list[Message] | list[list[Message]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, chat_template: str | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             chat_template_kwargs: dict[str, object] | None = None,
             tools: list[dict[str, object]] | None = None) -> list[RequestOutput]:
        """Applies the model's chat template (or `chat_template`) to each conversation, then generates.
        `chat_template_kwargs` reach the template (e.g. Qwen3's `enable_thinking`); so do `tools`
        (OpenAI tool definitions) for templates that list them."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [{"prompt_token_ids": ids, "prompt": text} for text, ids in (
            render_chat(self._generating().tokenizer, conv, chat_template, add_generation_prompt,
                        continue_final_message, chat_template_kwargs, tools) for conv in conversations)]
        return self.generate(prompts, sampling_params, use_tqdm)

    # -- pooling -----------------------------------------------------------------------------
    def embed(self, prompts: PromptType | Sequence[PromptType], pooling_params: PoolingParams | None = None,
              use_tqdm: bool = True, truncate_prompt_tokens: int | None = None) -> list[PoolingRequestOutput]:
        """One embedding per prompt (`.outputs.embedding`), pooled as the model's
        sentence-transformers config says, normalised unless `PoolingParams(normalize=False)`."""
        engine = self._pooling("embed")
        return engine.embed(self._as_list(prompts), self._pooling_params(pooling_params, truncate_prompt_tokens,
                                                                         "embed"))

    def encode(self, prompts: PromptType | Sequence[PromptType], pooling_params: PoolingParams | None = None,
               use_tqdm: bool = True, truncate_prompt_tokens: int | None = None) -> list[PoolingRequestOutput]:
        """The raw pooled vector per prompt (`.outputs.data`, a float32 numpy array): no
        normalisation unless asked (`PoolingParams(normalize=True)`); a classifier's logits."""
        engine = self._pooling("encode")
        return engine.encode(self._as_list(prompts), self._pooling_params(pooling_params, truncate_prompt_tokens,
                                                                          "encode"))

    def classify(self, prompts: PromptType | Sequence[PromptType], pooling_params: PoolingParams | None = None,
                 use_tqdm: bool = True, truncate_prompt_tokens: int | None = None) -> list[PoolingRequestOutput]:
        """Class probabilities per prompt (`.outputs.probs`): softmax over the labels, sigmoid for
        a one-label model."""
        engine = self._pooling("classify")
        return engine.classify(self._as_list(prompts), self._pooling_params(pooling_params, truncate_prompt_tokens,
                                                                            "classify"))

    def score(self, data_1: str | Sequence[str], data_2: str | Sequence[str], use_tqdm: bool = True,
              pooling_params: PoolingParams | None = None, truncate_prompt_tokens: int | None = None
              ) -> list[PoolingRequestOutput]:
        """Scores of text pairs, as vLLM pairs them: one text against each of many, or N against
        N. A cross-encoder (one-label classifier) reads each pair together and gives the sigmoid
        of its logit; an embedding model gives the cosine similarity of the two embeddings."""
        engine = self._pooling("score")
        return engine.score(data_1, data_2, self._pooling_params(pooling_params, truncate_prompt_tokens, "score"))

    @staticmethod
    def _pooling_params(params: PoolingParams | None, truncate: int | None, task: str) -> PoolingParams:
        params = params or PoolingParams()
        if truncate is not None:
            params = dataclasses.replace(params, truncate_prompt_tokens=truncate)
        return dataclasses.replace(params, task=task)
    def beam_search(self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """vLLM's beam search: per prompt, `params.beam_width` sequences, best first (see
        jaxengine/beam_search.py). Each step runs every live beam of every prompt as one batch of
        one-token requests; prefix caching (on by default) serves the beams' shared prefixes."""
        engine = self._generating()
        prompt_ids = [engine.prompt_ids(p) for p in self._as_list(prompts)]
        search = BeamSearch(prompt_ids, params, engine.eos_token_ids, max_model_len=engine.config.max_model_len,
                            max_logprobs=engine.config.max_logprobs)
        step_params = search.step_params()
        with tqdm(total=params.max_tokens, desc="Beam search", dynamic_ncols=True, disable=not use_tqdm) as bar:
            while not search.done:
                beams = search.pending()
                outs = self._run([{"prompt_token_ids": ids} for ids in beams], [step_params] * len(beams), False)
                search.advance([out.outputs[0].logprobs[0] for out in outs])
                bar.update(1)
        return search.outputs(engine.tokenizer)

    # -- helpers ---------------------------------------------------------------------------
    @staticmethod
    def _as_list(prompts) -> list[PromptType]:
        if isinstance(prompts, (str, dict)):
            return [prompts]
        if isinstance(prompts, (list, tuple)) and prompts and all(isinstance(t, int) for t in prompts):
            return [list(prompts)]
        if not isinstance(prompts, (list, tuple)):
            raise ValueError(f"prompts must be a string, a dict or a list of them, got {type(prompts).__name__}")
        return list(prompts)

    @staticmethod
    def _params_list(sp, n: int) -> list[SamplingParams]:
        if sp is None:
            return [SamplingParams()] * n
        if isinstance(sp, SamplingParams):
            return [sp] * n
        sp = list(sp)
        if len(sp) != n:
            raise ValueError(f"got {len(sp)} sampling params for {n} prompts")
        return sp

    def _run(self, prompts: list[PromptType], params: list[SamplingParams], use_tqdm: bool,
             loras: list | None = None) -> list[RequestOutput]:
        engine = self._generating()
        ids = []
        try:
            for prompt, p, lora in zip(prompts, params, loras or [None] * len(prompts)):
                rid = engine.new_request_id()
                engine.add_request(rid, prompt, p, lora_request=lora)
                ids.append(rid)
        except ValueError:
            engine.abort_request(ids)
            raise
        order = {rid: i for i, rid in enumerate(ids)}
        engine.emit_unfinished = False  # only final outputs are returned here
        results: list[RequestOutput | None] = [None] * len(ids)
        bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True, disable=not use_tqdm,
                   postfix="est. speed input: 0.00 toks/s, output: 0.00 toks/s")
        in_toks = out_toks = 0
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished and out.request_id in order:
                        results[order[out.request_id]] = out
                        in_toks += len(out.prompt_token_ids)
                        out_toks += sum(len(o.token_ids) for o in out.outputs)
                        elapsed = bar.format_dict["elapsed"] or 1e-9
                        bar.postfix = (f"est. speed input: {in_toks / elapsed:.2f} toks/s, "
                                       f"output: {out_toks / elapsed:.2f} toks/s")
                        bar.update(1)
        finally:
            bar.close()
        missing = [ids[i] for i, r in enumerate(results) if r is None]
        if missing:
            raise RuntimeError(f"requests {missing} ended without a final output")
        return results  # type: ignore[return-value]


def render_chat(tokenizer, conversation: list[Message], chat_template: str | None,
                add_generation_prompt: bool, continue_final_message: bool = False,
                chat_template_kwargs: dict[str, object] | None = None,
                tools: list[dict[str, object]] | None = None) -> tuple[str, list[int]]:
    """Renders one conversation with the chat template; returns (text, token ids).
    `chat_template_kwargs` are extra variables for the template; `tools`: OpenAI tool
    definitions (`{"type": "function", "function": {...}}`) for templates that list them."""
    if tokenizer is None:
        raise ValueError("this model has no tokenizer, so chat is not available")
    msgs = [normalize_message(m) for m in conversation]
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise ValueError("the model has no chat template; pass chat_template=")
    extra = dict(chat_template_kwargs or {})
    # Template variables only: the rendering call's own parameters (tokenize, return_dict, ...)
    # are not the caller's to set.
    params = inspect.signature(tokenizer.apply_chat_template).parameters
    if extra and not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        raise ValueError("chat_template_kwargs: this tokenizer's chat template takes no extra variables")
    own = {name for name, p in params.items() if p.kind is not inspect.Parameter.VAR_KEYWORD}
    reserved = (own | {"conversation", "messages"} | ({"tools"} if tools else set())) & set(extra)
    if reserved:
        raise ValueError(f"chat_template_kwargs may not set {', '.join(sorted(reserved))}: they are not "
                         "template variables")
    if tools:
        extra["tools"] = tools
    text = tokenizer.apply_chat_template(msgs, chat_template=template, tokenize=False,
                                         add_generation_prompt=add_generation_prompt and not continue_final_message,
                                         continue_final_message=continue_final_message, **extra)
    ids = tokenizer.encode(text, add_special_tokens=False)
    return text, list(ids)


def normalize_message(m: Message) -> dict[str, object]:
    """Text-part content lists are joined to one string; roles and other keys pass through."""
    if not isinstance(m, dict) or "role" not in m:
        raise ValueError(f"each chat message needs a 'role', got {m!r}")
    content = m.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in ("image_url", "input_image", "image", "input_audio", "audio_url", "video_url"):
                raise ValueError(f"content part of type {kind!r}: this model takes text only; images, audio "
                                 "and video are not supported")
            if kind != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"unsupported content part {part!r}: only {{'type': 'text', 'text': ...}}")
            texts.append(part["text"])
        content = "\n".join(texts)
    elif content is not None and not isinstance(content, str):
        raise ValueError(f"message content must be a string or a list of text parts, got {type(content).__name__}")
    out = dict(m)
    out["content"] = content if content is not None else ""
    return out
