"""The engine: one request's life from prompt to `RequestOutput`.

`add_request` tokenizes (or takes token ids), validates the sampling parameters and hands the
request (n children for n > 1) to the scheduler. Each `step()` is schedule -> run -> update:
the scheduler picks a token budget's worth of work (decode rows first, then prefill chunks), the
model runner executes one compiled step (forward + sampling, one device-to-host transfer), the
scheduler appends the sampled tokens and finishes requests on eos / stop ids / length, the output
processor detokenizes incrementally and finishes requests on stop strings, and finished requests'
KV blocks return to the pool.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxengine.config import EngineConfig
from jaxengine.default_model import default_model_path
from jaxengine.distributed import agree_min
from jaxengine.model_runner import ModelRunner, kv_bytes_per_block, profile_step_bytes
from jaxengine.models.config import ModelConfig
from jaxengine.models.loader import dummy_params, load_params, resolve_dtype
from jaxengine.models.presets import PRESETS
from jaxengine.output_processor import OutputProcessor
from jaxengine.outputs import CompletionOutput, RequestOutput
from jaxengine.request import Request, RequestStatus
from jaxengine.sharding import make_plan
from jaxengine.sampling_params import SamplingParams
from jaxengine.scheduler import Scheduler, SchedulerConfig

logger = logging.getLogger(__name__)


def _enable_compilation_cache(path: str | None) -> None:
    if not path:
        return
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def _open_model(config: EngineConfig):
    """(model config, checkpoint or None, tokenizer or None) for the configured model."""
    from jaxengine.models.checkpoint import load_hf_tokenizer, open_checkpoint  # heavy imports only here

    model = config.model or default_model_path()
    if config.load_format == "dummy" and model in PRESETS:
        tok = load_hf_tokenizer(config.tokenizer) if config.tokenizer and not config.skip_tokenizer_init else None
        return ModelConfig.from_hf_dict(PRESETS[model]), None, tok
    ckpt = open_checkpoint(model, revision=config.revision, tokenizer=config.tokenizer)
    tokenizer = None if config.skip_tokenizer_init else ckpt.load_tokenizer()
    return ModelConfig.from_hf_dict(ckpt.hf_config), ckpt, tokenizer


class LLMEngine:
    def __init__(self, config: EngineConfig):
        t0 = time.perf_counter()
        _enable_compilation_cache(config.compilation_cache_dir)
        model_config, ckpt, self.tokenizer = _open_model(config)
        config = self._derive(config, model_config)
        dtype = resolve_dtype(config.dtype, model_config)
        if jax.process_count() > 1 and config.tensor_parallel_size != jax.device_count():
            raise ValueError(f"across {jax.process_count()} processes, tensor_parallel_size must span every device "
                             f"of the job: {jax.device_count()}, got {config.tensor_parallel_size}")
        plan = make_plan(model_config, config.tensor_parallel_size) if config.tensor_parallel_size > 1 else None
        if plan is not None and plan.kv_head_replicas > 1:
            logger.info("each of the %d KV heads is repeated on %d devices", model_config.num_kv_heads,
                        plan.kv_head_replicas)
            model_config = model_config.with_kv_head_replicas(plan.kv_head_replicas)
        mesh = plan.mesh if plan is not None else None
        if ckpt is None or config.load_format == "dummy":
            graphdef, state = dummy_params(model_config, dtype, config.seed, config.attention_backend,
                                           plan.param_sharding if plan is not None else None, mesh)
        else:
            put = (lambda path, arr: jax.device_put(arr, plan.param_sharding(path))) if plan is not None else None
            graphdef, state = load_params(ckpt, model_config, dtype, config.attention_backend, put, mesh)
        config = dataclasses.replace(config, num_kv_blocks=self._num_blocks(config, model_config, dtype, graphdef, state, plan))
        if plan is not None:
            logger.info("tensor parallel over %d devices (mesh %s)", plan.tp, dict(plan.mesh.shape))
        self.config, self.model_config = config, model_config
        self.eos_token_ids = tuple(model_config.eos_token_id)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None and not self.eos_token_ids:
            self.eos_token_ids = (self.tokenizer.eos_token_id,)
        self.runner = ModelRunner(config, model_config, graphdef, state, dtype, plan)
        if config.warmup:
            self.runner.warmup()
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=config.max_model_len, num_blocks=config.num_kv_blocks,
            block_size=config.block_size, enable_prefix_caching=config.enable_prefix_caching))
        self.outputs = OutputProcessor(self.tokenizer)
        self._seed_rng = np.random.default_rng(config.seed)
        self._request_seeds: dict[str, int] = {}
        self._ids = itertools.count()
        self._inflight = None  # (SchedulerOutput, InFlight) of the step running on the device
        # Request id -> why it failed, for requests finished with finish_reason "error" (see
        # `_fail_request`); the caller pops its entry once it has reported the failure.
        self.request_errors: dict[str, str] = {}
        # Where step time goes: waiting for the device vs everything else (host work).
        self.timing = {"steps": 0, "device_wait_s": 0.0, "step_s": 0.0}
        # False: step() returns outputs of finished requests only (offline batch use needs no
        # per-token snapshots); the server streams, so it keeps True.
        self.emit_unfinished = True
        cap = (config.num_kv_blocks - 1) * config.block_size / config.max_model_len
        logger.info("model %s (%s, %s), %d KV blocks of %d tokens: maximum concurrency %.2fx at "
                    "max_model_len %d; ready in %.1f s", config.model or "default SmolLM2-135M-Instruct",
                    model_config.architecture, jnp.dtype(dtype).name, config.num_kv_blocks, config.block_size,
                    cap, config.max_model_len, time.perf_counter() - t0)

    # -- configuration ----------------------------------------------------------------------
    @staticmethod
    def _derive(config: EngineConfig, mc: ModelConfig) -> EngineConfig:
        max_len = config.max_model_len or mc.max_position_embeddings
        if max_len > mc.max_position_embeddings:
            raise ValueError(f"max_model_len={max_len} exceeds the model's max_position_embeddings="
                             f"{mc.max_position_embeddings}")
        budget = config.max_num_batched_tokens or (512 if jax.default_backend() == "cpu" else 8192)
        if budget < config.max_num_seqs and config.max_num_batched_tokens is not None:
            raise ValueError(f"max_num_batched_tokens={budget} must be >= max_num_seqs={config.max_num_seqs}")
        return dataclasses.replace(config, max_model_len=max_len, max_num_batched_tokens=budget)

    @staticmethod
    def _num_blocks(config: EngineConfig, mc: ModelConfig, dtype: jnp.dtype, graphdef, state, plan=None) -> int:
        """Blocks that fit in free device memory (or the CPU budget), never more than useful.

        On accelerators: bytes_limit x gpu_memory_utilization, minus what is in use after the
        weights, minus the profiled peak of one step of the largest bucket.
        """
        if config.num_kv_blocks is not None:
            return config.num_kv_blocks
        # per device: the KV heads are split over the tensor-parallel devices
        per_block = kv_bytes_per_block(mc, config.block_size, dtype) // config.tensor_parallel_size
        most_useful = config.max_num_seqs * config.max_blocks_per_seq + 1
        stats = jax.local_devices()[0].memory_stats() or {}
        if "bytes_limit" in stats:
            step = profile_step_bytes(config, mc, graphdef, state, dtype, plan)
            if step is None:  # no buffer analysis: a rough bound (activations, logits, sampler copies)
                t, r = config.max_num_batched_tokens, min(config.max_num_batched_tokens, config.max_num_seqs)
                step = 2 * (t * (4 * mc.hidden_size + 3 * mc.intermediate_size) * jnp.dtype(dtype).itemsize
                            + 4 * r * mc.vocab_size * 4)
            free = stats["bytes_limit"] * config.gpu_memory_utilization - stats.get("bytes_in_use", 0)
            n = int((free - step) // per_block)
            logger.info("KV cache: %.2f GiB free after weights, %.2f GiB profiled step peak",
                        free / 2**30, step / 2**30)
        else:
            n = int(config.cpu_kv_cache_bytes // per_block)
        n = agree_min(min(n, most_useful))  # every process of a multi-host job allocates the same pool
        if (n - 1) * config.block_size < config.max_model_len:
            raise ValueError(
                f"the KV cache holds {max(n - 1, 0) * config.block_size} tokens, fewer than max_model_len="
                f"{config.max_model_len}; lower max_model_len, or raise gpu_memory_utilization / num_kv_blocks")
        return n

    # -- requests -------------------------------------------------------------------------
    def new_request_id(self) -> str:
        return str(next(self._ids))

    def tokenize(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: pass prompts as {'prompt_token_ids': [...]}")
        return list(self.tokenizer.encode(prompt))

    def add_request(self, request_id: str, prompt: str | Sequence[int] | dict,
                    params: SamplingParams | None = None, arrival_time: float | None = None) -> None:
        params = params or SamplingParams()
        text, ids = self._prompt_ids(prompt)
        self._validate(ids, params)
        if request_id in self.outputs.parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        children = []
        for i in range(params.n):
            child_params = params
            if params.n > 1:  # children sample independently; a given seed is offset per child
                seed = params.seed + i if params.seed is not None else None
                child_params = dataclasses.replace(params, n=1, seed=seed)
            cid = request_id if params.n == 1 else f"{i}_{request_id}"
            children.append(Request(cid, list(ids), child_params, eos_token_ids=self.eos_token_ids,
                                    arrival_time=arrival))
        added = []
        try:
            for child in children:
                self.scheduler.add_request(child)
                added.append(child.request_id)
        except ValueError:
            self.scheduler.abort_requests(added)
            raise
        for child in children:
            seed = child.sampling_params.seed
            self._request_seeds[child.request_id] = int(seed if seed is not None else
                                                        self._seed_rng.integers(0, 2**31 - 1))
        self.outputs.add(request_id, text, list(ids), params, children)

    def _prompt_ids(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenize(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
            if "prompt" in prompt:
                return prompt["prompt"], self.tokenize(prompt["prompt"])
            raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, (int, np.integer)) for t in prompt):
            return None, [int(t) for t in prompt]
        raise ValueError(f"unsupported prompt type {type(prompt).__name__}")

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

    def abort_request(self, request_ids: str | Sequence[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        children = [c for rid in ids for c in self.outputs.child_ids(rid)]
        self.scheduler.abort_requests(children)
        for cid in children:
            self.outputs.finish_child(cid, "abort", None)
            self._request_seeds.pop(cid, None)
        for rid in ids:
            self.outputs.pop_if_finished(rid)

    def has_unfinished_requests(self) -> bool:
        return self._inflight is not None or self.scheduler.has_unfinished_requests()

    # -- the step -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One engine iteration; the host runs one step ahead of the device.

        Step N+1 is scheduled and dispatched while step N still runs: N's sampled tokens are
        placeholders on the host (`Scheduler.advance`) and reach N+1's decode rows on the device.
        Then N's tokens come back (`Scheduler.resolve`: eos, stop ids, length) and are
        detokenized (stop strings, logprobs, RequestOutputs) while the device runs N+1. A request
        that N finishes may have a wasted row in N+1; its token is dropped, and its freed blocks
        are only reused by steps enqueued after N+1. When a running request uses penalties (which
        read every output token) the step waits for N before scheduling, as a synchronous engine.
        """
        t_start = time.perf_counter()
        try:
            return self._step()
        finally:
            self.timing["step_s"] += time.perf_counter() - t_start

    def _step(self) -> list[RequestOutput]:
        prev, self._inflight = self._inflight, None
        resolved = None
        if prev is not None and self._needs_sync():
            resolved = self._resolve(prev)
            prev = None
        sched = self.scheduler.schedule()
        handle = self._dispatch(sched, prev[1] if prev is not None else None) if sched.seqs else None
        if prev is not None:
            resolved = self._resolve(prev)
        if handle is not None:
            self.scheduler.advance(sched)
            self._inflight = (sched, handle)
        return self._process_outputs(*resolved) if resolved is not None else []

    def _needs_sync(self) -> bool:
        return self.scheduler.running_uses_penalties()

    def _resolve(self, done):
        t0 = time.perf_counter()
        sched, out = done[0], self.runner.collect(done[1])
        self.timing["device_wait_s"] += time.perf_counter() - t0
        self.timing["steps"] += 1
        sampled = [tok if s.samples else None for s, tok in zip(sched.seqs, out.token_ids.tolist())]
        finished = {r.request_id for r in self.scheduler.resolve(sched, sampled)}
        return sched, out, sampled, finished

    def _dispatch(self, sched, prev_handle):
        seeds = self._request_seeds
        return self.runner.dispatch(sched.seqs, [seeds[s.request.request_id] for s in sched.seqs],
                                    self.eos_token_ids, self._prompt_targets(sched.seqs), prev_handle,
                                    sched.num_batched_tokens)

    @staticmethod
    def _prompt_targets(seqs: list) -> np.ndarray | None:
        """Next prompt token of every row whose request asked for prompt logprobs (-1 elsewhere)."""
        if not any(s.request.sampling_params.prompt_logprobs is not None and s.start < s.request.num_prompt_tokens
                   for s in seqs):
            return None
        targets = np.full(sum(s.num_new_tokens for s in seqs), -1, np.int32)
        cursor = 0
        for s in seqs:
            req = s.request
            if req.sampling_params.prompt_logprobs is not None:
                pos = np.arange(s.start, s.start + s.num_new_tokens)
                ok = pos + 1 < req.num_prompt_tokens
                targets[cursor:cursor + s.num_new_tokens][ok] = np.asarray(req.prompt_token_ids)[pos[ok] + 1]
            cursor += s.num_new_tokens
        return targets

    def _process_outputs(self, sched, out, sampled: list[int | None], finished: set[str]) -> list[RequestOutput]:
        outputs = self.outputs
        touched: list = []  # ChildState of each child that got a token
        stopped: list[tuple[str, str]] = []
        failed: dict[str, Exception] = {}  # parent id -> what broke while processing its output
        if out.prompt_lp is not None:
            self._record_prompt_logprobs(sched.seqs, out.prompt_lp, failed)
        # Runs for every sampled row every step: the clock is read once, NaN flags are looked at
        # only when some row has one, and logprob arrays are indexed only for rows that want them.
        states, process = outputs.child_states, outputs.process_token
        nan_rows = out.nan_rows if out.nan_rows is not None and out.nan_rows.any() else None
        now = time.monotonic()
        for i, (s, token) in enumerate(zip(sched.seqs, sampled)):
            if token is None:
                continue
            cid = s.request.request_id
            st = states.get(cid)
            if st is None or st.finish_reason is not None:  # unknown, aborted or stopped a step ago
                continue
            pid = st.parent.request_id
            if nan_rows is not None and nan_rows[i]:
                failed.setdefault(pid, FloatingPointError("the model produced NaN logits for this request"))
            if failed and pid in failed:
                continue
            try:
                if st.logprobs is None:
                    stop = process(cid, token, None, None, None, None, now=now)
                else:
                    stop = process(cid, token, out.logprob[i], out.rank[i], out.top_ids[i], out.top_logprobs[i],
                                   now=now)
            except Exception as e:  # noqa: BLE001 - one request's failure (e.g. its detokenizer) is its own
                failed.setdefault(pid, e)
                continue
            if cid in finished:
                outputs.finish_child(cid, s.request.status.finish_reason, s.request.stop_reason)
            elif stop is not None:
                stopped.append((cid, stop))
            touched.append(st)
        if stopped:
            self.scheduler.finish_requests([cid for cid, _ in stopped], RequestStatus.FINISHED_STOPPED)
            for cid, stop in stopped:
                outputs.finish_child(cid, "stop", stop)
        results, seen = [self._fail_request(rid, e) for rid, e in failed.items()], set(failed)
        emit_unfinished = self.emit_unfinished
        for st in touched:
            parent = st.parent
            if not (emit_unfinished or parent.finished) or parent.request_id in seen:
                continue
            seen.add(parent.request_id)
            try:
                results.append(outputs.make_output(parent.request_id))
            except Exception as e:  # noqa: BLE001 - as above: only this request fails
                results.append(self._fail_request(parent.request_id, e))
                continue
            if parent.finished:
                for c in parent.children:
                    self._request_seeds.pop(c.request.request_id, None)
                outputs.pop_if_finished(parent.request_id)
        return results

    def _fail_request(self, request_id: str, error: Exception) -> RequestOutput:
        """Ends one request whose output processing raised: its sequences stop (blocks freed) with
        finish_reason "error", the error is kept in `request_errors` for the caller, and every
        other request goes on. Returns the request's final output."""
        logger.error("request %s failed: %s: %s", request_id, type(error).__name__, error, exc_info=error)
        children = self.outputs.child_ids(request_id)
        self.scheduler.abort_requests(children)
        for cid in children:
            if self.outputs.is_live(cid):
                self.outputs.finish_child(cid, "error", None)
            self._request_seeds.pop(cid, None)
        self.request_errors[request_id] = f"{type(error).__name__}: {error}"
        try:
            final = self.outputs.make_output(request_id)
        except Exception:  # noqa: BLE001 - the state itself is broken: report no text
            p = self.outputs.parents[request_id]
            final = RequestOutput(request_id, p.prompt, p.prompt_token_ids, None,
                                  [CompletionOutput(c.index, "", [], None, None, c.finish_reason, c.stop_reason)
                                   for c in p.children], True, p.metrics)
        self.outputs.pop_if_finished(request_id)
        return final

    def _record_prompt_logprobs(self, seqs: list, prompt_lp: tuple, failed: dict[str, Exception]) -> None:
        lp, rank, top_ids, top_lps = prompt_lp
        cursor = 0
        for s in seqs:
            req = s.request
            if req.sampling_params.prompt_logprobs is not None and s.start < req.num_prompt_tokens:
                rows = slice(cursor, cursor + s.num_new_tokens)
                try:
                    self.outputs.record_prompt_logprobs(req.request_id, s.start, lp[rows], rank[rows],
                                                        top_ids[rows], top_lps[rows])
                except Exception as e:  # noqa: BLE001 - this request fails alone (see _fail_request)
                    parent = self.outputs.child_to_parent.get(req.request_id)
                    if parent is not None:
                        failed.setdefault(parent.request_id, e)
            cursor += s.num_new_tokens

    # -- stats ------------------------------------------------------------------------------
    def stats(self) -> dict[str, float]:
        bm = self.scheduler.block_manager
        return {"num_running": self.scheduler.num_running, "num_waiting": self.scheduler.num_waiting,
                "kv_cache_usage": bm.usage, "prefix_cache_queries": bm.prefix_cache_queries,
                "prefix_cache_hits": bm.prefix_cache_hits, "num_preemptions": self.scheduler.num_preemptions}
