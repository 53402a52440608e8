"""`LLMEngine`: vLLM's engine interface (add_request / step / abort_request) over the engine core.

Construction opens the model (HF folder, GGUF file, hub id or a dummy preset), places its
weights (sharded over the mesh under tensor parallelism), sizes the KV cache from free device
memory (or takes the size an earlier start kept in its program bundle) and compiles every bucket,
or on the CPU backend each program on its first use; programs of an earlier start with the same
key are loaded instead (jaxengine.program_bundle). `startup` records where that time went
(jaxengine.startup). Then one request's life:

1. `add_request` tokenizes the prompt (or takes token ids), validates it against the model and
   the sampling parameters (`ValueError` for bad input), draws a seed for unseeded sampling and
   fans n > 1 out into n child requests that share the prompt.
2. `step()` runs one iteration of the engine core (`jaxengine/engine_core.py`): schedule ->
   dispatch -> resolve -> outputs. It returns the `RequestOutput`s of the step that resolved.
3. `abort_request` ends requests at once: their KV blocks return to the pool.
`LLM` (offline batches) and `AsyncEngine` (the server's engine thread) drive this class.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from typing import Sequence

import jax.numpy as jnp
import numpy as np

from jaxengine.config import EngineConfig
from jaxengine.engine_core import EngineCore
from jaxengine.grammar import GrammarBackend
from jaxengine.loading import load_model
from jaxengine.model_runner import ModelRunner
from jaxengine.output_processor import OutputProcessor
from jaxengine.outputs import RequestOutput
from jaxengine.request import Request
from jaxengine.sampling_params import SamplingParams
from jaxengine.scheduler import Scheduler, SchedulerConfig
from jaxengine.startup import StartupTimings, freeze_startup_heap

logger = logging.getLogger(__name__)

# Architectures whose layers take LoRA deltas (models/llama.py's q/k/v/o and gate/up/down).
LORA_ARCHITECTURES = frozenset({"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"})


class LLMEngine:
    def __init__(self, config: EngineConfig):
        t0 = time.perf_counter()
        self.startup = StartupTimings.begin(config.compilation_cache_dir)  # where the start's time went
        m = load_model(config, self.startup)
        self.config, self.model_config, self.tokenizer, self.eos_token_ids = (
            m.config, m.model_config, m.tokenizer, m.eos_token_ids)
        self.lora_manager = self._lora_manager(m.config, m.model_config)
        with self.startup.phase("runner_init"):
            self.runner = ModelRunner(m.config, m.model_config, m.graphdef, m.state, m.dtype, m.attention, m.plan,
                                      m.eos_token_ids, self.lora_manager, bundle=m.bundle)
            if m.draft is not None:
                from jaxengine.draft_model import DraftModel
                self.runner.draft = DraftModel(m.config, m.draft, m.dtype)
        self.startup.ahead_of_time = bool(m.config.warmup)
        if m.config.warmup:
            with self.startup.phase("warmup"):
                self.runner.warmup()
        config = m.config
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=config.max_model_len, num_blocks=config.num_kv_blocks,
            block_size=config.block_size, enable_prefix_caching=config.enable_prefix_caching,
            sliding_window=m.model_config.kv_window, max_loras=config.max_loras if config.enable_lora else 0))
        self.outputs = OutputProcessor(self.tokenizer)
        # Structured outputs (jaxengine/grammar.py; its tokenizer view is built on first use).
        self.grammar = (GrammarBackend(self.tokenizer, m.model_config.vocab_size, self.eos_token_ids)
                        if self.tokenizer is not None else None)
        self.core = EngineCore(self.scheduler, self.runner, self.outputs, self.grammar)
        self._seed_rng = np.random.default_rng(config.seed)
        self._ids = itertools.count()
        cap = (config.num_kv_blocks - 1) * config.block_size / config.max_model_len
        logger.info("model %s (%s, %s), %d KV blocks of %d tokens: maximum concurrency %.2fx at "
                    "max_model_len %d; ready in %.1f s", config.model or "default SmolLM2-135M-Instruct",
                    m.model_config.architecture, jnp.dtype(m.dtype).name, config.num_kv_blocks, config.block_size,
                    cap, config.max_model_len, time.perf_counter() - t0)
        self.startup.finish(m.bundle)
        logger.info("%s", self.startup.summary())
        freeze_startup_heap()

    @staticmethod
    def _lora_manager(config: EngineConfig, mc):
        """The host side of LoRA (jaxengine.lora), or None when it is off."""
        if not config.enable_lora:
            return None
        from jaxengine.lora import LoRAConfig, LoRAManager

        if mc.architecture not in LORA_ARCHITECTURES:
            raise ValueError(f"enable_lora: LoRA adapters run on {', '.join(sorted(LORA_ARCHITECTURES))} so far, "
                             f"not {mc.architecture}")
        return LoRAManager(mc, LoRAConfig(max_loras=config.max_loras, max_lora_rank=config.max_lora_rank,
                                          max_cpu_loras=config.max_cpu_loras))

    # -- LoRA adapters (vLLM's LLMEngine names) -----------------------------------------------
    def add_lora(self, lora_request) -> bool:
        """Loads an adapter on the host (validated: a bad folder or rank is a ValueError); it
        reaches a device slot when a request first uses it."""
        self._require_lora().add(lora_request)
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        """Unloads an adapter; False if it is unknown. A ValueError while unfinished requests use
        it: their next steps would need its weights (unload it once they finish)."""
        manager = self._require_lora()
        users = self.scheduler.num_requests_with_lora(lora_int_id)
        if users:
            raise ValueError(f"LoRA adapter {lora_int_id} is in use by {users} unfinished request(s); "
                             "unload it once they finish")
        return manager.remove(lora_int_id)

    def list_loras(self) -> set[int]:
        return {r.lora_int_id for r in self._require_lora().list()}

    def _require_lora(self):
        if self.lora_manager is None:
            raise ValueError("LoRA adapters need enable_lora=True")
        return self.lora_manager

    # -- requests -------------------------------------------------------------------------
    def new_request_id(self) -> str:
        return str(next(self._ids))

    def tokenize(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: pass prompts as {'prompt_token_ids': [...]}")
        return list(self.tokenizer.encode(prompt))

    def add_request(self, request_id: str, prompt: str | Sequence[int] | dict,
                    params: SamplingParams | None = None, arrival_time: float | None = None,
                    lora_request=None) -> None:
        """Validates and queues a request (n > 1: n child requests sharing the prompt).
        `lora_request`: a jaxengine.lora.LoRARequest, loaded on first use.
        Bad input raises `ValueError` and adds nothing."""
        params = params or SamplingParams()
        lora_id = 0
        if lora_request is not None:
            self._require_lora().add(lora_request)
            lora_id = lora_request.lora_int_id
        text, ids = self.prompt_ids(prompt)
        ids = self._truncate(ids, params)
        params.update_from_tokenizer(self.tokenizer)
        self._validate(ids, params)
        if params.structured_outputs is not None:
            self.compile_grammar(params.structured_outputs)
        if request_id in self.outputs.parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        children = []
        for i in range(params.n):
            child_params = params
            if params.n > 1:  # children sample independently; a given seed is offset per child
                seed = params.seed + i if params.seed is not None else None
                child_params = dataclasses.replace(params, n=1, seed=seed)
                child_params.update_from_tokenizer(self.tokenizer)
            seed = child_params.seed
            if seed is None:
                seed = int(self._seed_rng.integers(0, 2**31 - 1))
            cid = request_id if params.n == 1 else f"{i}_{request_id}"
            children.append(Request(cid, list(ids), child_params, eos_token_ids=self.eos_token_ids, seed=int(seed),
                                    arrival_time=arrival, lora_int_id=lora_id, grammar=self._matcher(params)))
        self.core.add_request(request_id, text, list(ids), params, children)

    def grammar_backend(self) -> GrammarBackend:
        if self.grammar is None:
            raise ValueError("structured_outputs need a tokenizer; this model has none")
        return self.grammar

    def compile_grammar(self, so) -> None:
        """Checks and compiles a structured-output constraint (cached by its spec): a ValueError
        naming the field for an invalid schema, regex or grammar. The server calls this from its
        request handlers, so the engine thread finds the grammar compiled."""
        self.grammar_backend().compile(so)

    def _matcher(self, params: SamplingParams):
        so = params.structured_outputs
        return None if so is None else self.grammar_backend().new_matcher(so)

    def prompt_ids(self, prompt) -> tuple[str | None, list[int]]:
        """(text if given, token ids) of a prompt: a string, a token-id list or a prompt dict."""
        if isinstance(prompt, str):
            return prompt, self.tokenize(prompt)
        if isinstance(prompt, dict):
            for key in ("multi_modal_data", "mm_processor_kwargs"):
                if prompt.get(key):
                    raise ValueError(f"{key}: model {self.model_config.architecture} takes text only; images, "
                                     "audio and video are not supported")
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
            if "prompt" in prompt:
                return prompt["prompt"], self.tokenize(prompt["prompt"])
            raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, (int, np.integer)) for t in prompt):
            return None, [int(t) for t in prompt]
        raise ValueError(f"unsupported prompt type {type(prompt).__name__}")

    def _truncate(self, ids: list[int], params: SamplingParams) -> list[int]:
        """The prompt's last `truncate_prompt_tokens` tokens (-1: max_model_len - 1), as vLLM."""
        k = params.truncate_prompt_tokens
        if k is None:
            return ids
        k = self.config.max_model_len - 1 if k == -1 else k
        if k >= self.config.max_model_len:
            raise ValueError(f"truncate_prompt_tokens={k} must be below max_model_len={self.config.max_model_len}")
        return ids[-k:]

    def _validate(self, ids: list[int], params: SamplingParams) -> None:
        if not ids:
            raise ValueError("the prompt is empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids out of vocabulary [0, {vocab}): {bad[:5]}")
        if len(ids) >= self.config.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens, the model accepts at most "
                             f"max_model_len - 1 = {self.config.max_model_len - 1}")
        if params.n > self.config.max_num_seqs:
            raise ValueError(f"n={params.n} exceeds max_num_seqs={self.config.max_num_seqs}")
        if params.logprobs is not None and params.logprobs > self.config.max_logprobs:
            raise ValueError(f"logprobs={params.logprobs} exceeds max_logprobs={self.config.max_logprobs}")
        if params.prompt_logprobs is not None and params.prompt_logprobs > self.config.max_logprobs:
            raise ValueError(f"prompt_logprobs={params.prompt_logprobs} exceeds max_logprobs={self.config.max_logprobs}")
        for name, tokens in (("logit_bias", params.logit_bias or ()), ("allowed_token_ids", params.allowed_token_ids or ())):
            out_of_vocab = [t for t in tokens if t >= vocab]
            if out_of_vocab:
                raise ValueError(f"{name} has token ids out of vocabulary [0, {vocab}): {out_of_vocab[:5]}")

    def abort_request(self, request_ids: str | Sequence[str]) -> None:
        """Ends requests with finish_reason "abort" (unknown or finished ids are ignored)."""
        self.core.abort_requests([request_ids] if isinstance(request_ids, str) else list(request_ids))

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """One engine iteration (`EngineCore.step`): the outputs of the step that just resolved."""
        return self.core.step()

    # -- what callers read ------------------------------------------------------------------
    @property
    def request_errors(self) -> dict[str, str]:
        """Request id -> why it failed (finish_reason "error"); the caller pops what it reported."""
        return self.outputs.errors

    @property
    def emit_unfinished(self) -> bool:
        """False: `step()` returns outputs of finished requests only (offline batches)."""
        return self.outputs.emit_unfinished

    @emit_unfinished.setter
    def emit_unfinished(self, value: bool) -> None:
        self.outputs.emit_unfinished = value

    @property
    def timing(self) -> dict[str, float]:
        """Steps resolved, and step time split into device wait and the rest (host work)."""
        return self.core.timing

    def stats(self) -> dict[str, float]:
        """Scheduler state now, cumulative cache and preemption counts, and `step_tokens`: the
        tokens (prefill + decode) the last `step()` scheduled, 0 if it scheduled nothing."""
        bm = self.scheduler.block_manager
        out = {"num_running": self.scheduler.num_running, "num_waiting": self.scheduler.num_waiting,
               "kv_cache_usage": bm.usage, "prefix_cache_queries": bm.prefix_cache_queries,
               "prefix_cache_hits": bm.prefix_cache_hits, "num_preemptions": self.scheduler.num_preemptions,
               "step_tokens": self.core.last_step_tokens}
        if self.config.speculative_config is not None:  # speculative decoding's counters, so far
            st = self.core.spec_stats
            out.update(spec_num_drafts=st.num_drafts, spec_num_draft_tokens=st.num_draft_tokens,
                       spec_num_accepted_tokens=st.num_accepted_tokens, spec_accepted_per_pos=list(st.accepted_per_pos))
        return out
