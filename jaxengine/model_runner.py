"""Owns the device side: parameters, the paged KV cache, and the compiled step programs.

Per token bucket T one forward program (KV caches donated, logits for R = min(T, max_num_seqs)
rows); per row count R eight small sampler programs (`SAMPLER_VARIANTS`: plain and with the
structured-output bitmask, each with and without top-k / top-p truncation; with logits
processors (penalties, logit_bias, allowed_token_ids, bad_words) and the bitmask; and for steps
where no row asks for logprobs, lean forms that compute none: plain with and without truncation,
and greedy, which only takes each row's argmax). With warm-up on,
all of them are compiled ahead of time at start-up and running a shape that was not compiled is a
bug and raises; with it off, each is compiled on its first use. Either way a program of an earlier
start with the same key is loaded from the program bundle instead (jaxengine.program_bundle).
The host waits once per step, for the sampler's output. A step is enqueued in one go (`dispatch`), or as its forward first and its
sampler later (`dispatch_forward` then `dispatch_sampler`): the engine computes the bitmask of
constrained rows while the forward runs. Steps of one-token rows (decode) build their inputs and
sampling metadata from the persistent batch's slots (jaxengine/persistent_batch.py).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import logging
import math
import os
import threading
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm.auto import tqdm

from jaxengine.attention_backend import AttentionBackend
from jaxengine.config import EngineConfig, pick_bucket, token_buckets
from jaxengine.input_batch import InputBuilder, StepInputs, abstract_inputs, prompt_logprob_targets
from jaxengine.models.config import ModelConfig
from jaxengine.models.lora import TP_AXIS, LoRAInputs, layer_shapes, token_mask, write_slot
from jaxengine.packing import Layout, pack, unpack
from jaxengine.persistent_batch import BatchRows, PersistentBatch
from jaxengine.sampler import (batch_sampling_metadata, build_sampling_metadata, lean_mode, resolve_history,
                               rows_sampling_metadata, rows_sampling_packed, sample)
from jaxengine.scheduler import SchedulerOutput
from jaxengine.xla_options import program_options

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class RunnerOutput:
    """Host-side results of one step, one entry per scheduled sequence (plain numpy)."""

    token_ids: np.ndarray  # [num_seqs] int32 sampled token of each sequence's last row
    logprob: np.ndarray  # [num_seqs] f32 raw log-probability of the sampled token
    rank: np.ndarray  # [num_seqs] int32 1-based rank of the sampled token
    top_ids: np.ndarray  # [num_seqs, max_logprobs] int32
    top_logprobs: np.ndarray  # [num_seqs, max_logprobs] f32
    prompt_lp: tuple | None = None  # (logprob [T], rank [T], top_ids [T, k], top_logprobs [T, k]) per token row
    nan_rows: np.ndarray | None = None  # [num_seqs] bool: the row's logits hold a NaN
    # Pooling engines, per sequence [num_seqs, D] f32: the final hidden state of its last row, of its
    # first row, and the sum over its rows this step (LAST, CLS and MEAN pooling).
    pooled: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
    # Speculative steps: token_ids, logprob and rank are [num_seqs, K + 1] and top_* [num_seqs, K + 1, L];
    # each row's first num_tokens[i] entries are its output tokens (accepted drafts, then one more).
    num_tokens: np.ndarray | None = None


def _forward(graphdef, state, kv_caches, packed: jax.Array, prev_tokens: jax.Array, lora_layers=None, *,
             layout: Layout, attention: AttentionBackend, lora_rank: int = 0):
    """packed: the step's StepInputs as one int32 buffer of `layout` (jaxengine.packing).
    prev_tokens [max_num_seqs] int32: the previous step's samples, still on the device; rows
    with prev_index >= 0 take their input token from there (scheduling ran ahead of them).
    attention: the runner's attention backend (static: it picks the kernel traced in).
    lora_layers: the LoRA slot arrays (models/lora.py), each token's adapter chosen by its
    `lora_slot`; None: the base model only (the program of steps without adapters)."""
    inputs: StepInputs = unpack(packed, layout)
    model = nnx.merge(graphdef, state)
    from_prev = prev_tokens[jnp.maximum(inputs.prev_index, 0)]
    input_ids = jnp.where(inputs.prev_index >= 0, from_prev, inputs.input_ids)
    if lora_layers is None:
        hidden, kv_caches = model(input_ids, inputs.positions, kv_caches, inputs.attn, attention)
    else:
        mask = token_mask(inputs.lora_slot, lora_layers[0]["q_b"].shape[0] // lora_rank, lora_rank)
        hidden, kv_caches = model(input_ids, inputs.positions, kv_caches, inputs.attn, attention,
                                  lora=LoRAInputs(mask, lora_layers))
    logits = model.compute_logits(hidden[inputs.logits_indices])
    return kv_caches, logits, hidden


def _pool_rows(hidden: jax.Array, last_rows: jax.Array, query_start_loc: jax.Array
               ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """hidden [T, D]; last_rows [R] (each sequence's last new token); query_start_loc [R + 1] ->
    per sequence [R, D] float32: its last row, its first row and the sum of its rows (padding
    tokens, past the last sequence, count for none)."""
    h = hidden.astype(jnp.float32)
    r = last_rows.shape[0]
    seg = jnp.searchsorted(query_start_loc[1:], jnp.arange(h.shape[0]), side="right")  # [T] row of each token
    sums = jax.ops.segment_sum(h, seg, num_segments=r + 1)[:r]
    return jnp.take(h, last_rows, axis=0), jnp.take(h, query_start_loc[:-1], axis=0), sums


def _flat(fn, graphdef, treedef, **static):
    """fn(graphdef, state, ...) -> f(leaves, ...): parameters travel as a flat tuple of arrays,
    which costs the host less to dispatch every step than an nnx.State."""
    def wrapped(leaves, *args):
        return fn(graphdef, jax.tree.unflatten(treedef, leaves), *args, **static)
    # fn's name names the compiled module (jit__forward, ...), which is how profiles tell programs apart
    wrapped.__name__ = wrapped.__qualname__ = fn.__name__
    return wrapped


PROMPT_LOGPROB_CHUNK = 128  # rows of [rows, V] float32 logits alive at once


def _prompt_logprobs(graphdef, state, hidden: jax.Array, targets: jax.Array, *, k: int):
    """Raw log-probabilities of each row's next prompt token, its rank and the top-k, chunked
    over rows so at most PROMPT_LOGPROB_CHUNK x V logits exist at a time.

    hidden [T, D], targets [T] int32 (-1: row not wanted) ->
    (logprob [T], rank [T], top_ids [T, k], top_logprobs [T, k]).
    """
    model = nnx.merge(graphdef, state)
    t, d = hidden.shape
    c = math.gcd(t, PROMPT_LOGPROB_CHUNK)

    def one(args):
        h, tgt = args
        lp = jax.nn.log_softmax(model.compute_logits(h), axis=-1)  # [c, V]
        safe = jnp.maximum(tgt, 0)
        chosen = jnp.take_along_axis(lp, safe[:, None], axis=-1)[:, 0]
        rank = 1 + jnp.sum(lp > chosen[:, None], axis=-1).astype(jnp.int32)
        top_lp, top_ids = jax.lax.top_k(lp, k)
        return chosen, rank, top_ids.astype(jnp.int32), top_lp

    out = jax.lax.map(one, (hidden.reshape(t // c, c, d), targets.reshape(t // c, c)))
    return tuple(x.reshape((t,) + x.shape[2:]) for x in out)


def _abstract(tree):
    """Shape, dtype and placement of every array in `tree`: what ahead-of-time lowering needs."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), tree)


def profile_step_bytes(config: EngineConfig, model_config: ModelConfig, graphdef, state, dtype: jnp.dtype,
                       plan, attention: AttentionBackend, xla_options: dict | None = None) -> int | None:
    """Device memory one step of the largest bucket needs beyond weights and KV cache, per device.

    Compiles that bucket's forward against a 2-block cache (the temporaries do not depend on the
    pool size) plus the processors sampler, placed as the runner places them (`plan`: sharded over
    the mesh), and reads XLA's buffer assignment of one device. None when the backend reports no
    memory analysis. `attention`: the backend the runner will use. `xla_options`: added to the
    forward's compiler options (lab/gpu_checks/kv_profile_probe.py compares settings).
    """
    t = token_buckets(config.max_num_batched_tokens)[-1]
    r = min(t, config.max_num_seqs)
    c = model_config
    rep = plan.replicated() if plan is not None else None
    kv = jax.ShapeDtypeStruct((2, c.num_kv_heads, config.block_size, attention.kv_head_dim(c.head_dim)),
                              attention.kv_dtype(dtype),
                              sharding=plan.kv_sharding() if plan is not None else None)

    layout = Layout.of(abstract_inputs(t, r, config.max_blocks_per_seq))
    lowered = [(jax.jit(functools.partial(_forward, graphdef, layout=layout, attention=attention),
                        donate_argnums=(1,)).lower(
        _abstract(state), [(kv, kv)] * c.num_layers, layout.abstract(rep),
        jax.ShapeDtypeStruct((config.max_num_seqs,), jnp.int32, sharding=rep)),
        {**program_options(state, t), **(xla_options or {})})]
    md = Layout.of(build_sampling_metadata([], r, config.max_model_len, processors=True,
                                           mask_words=-(-c.vocab_size // 32)))
    lowered.append((jax.jit(functools.partial(_sample_padded, layout=md, use_processors=True,
                                              pad_to=config.max_num_seqs, use_bitmask=True)).lower(
        jax.ShapeDtypeStruct((r, c.vocab_size), jnp.float32, sharding=rep), md.abstract(rep),
        jax.ShapeDtypeStruct((config.max_num_seqs,), jnp.int32, sharding=rep)), {}))
    spec = config.speculative_config
    if spec is not None:  # the verify program of speculative steps (its logits, and any weight copy XLA makes)
        rv, k = min(r, spec.disable_by_batch_size), spec.num_speculative_tokens
        spec_layout = Layout.of(SpecInputs(np.zeros((rv, k + 1), np.int32), np.zeros((rv, k), np.int32),
                                           np.zeros(rv, np.int32)))
        md_v = Layout.of(build_sampling_metadata([], rv, 1, processors=False))
        lowered.append((jax.jit(functools.partial(_verify_step, graphdef, spec_layout=spec_layout,
                                                  md_layout=md_v, truncate=True)).lower(
            _abstract(state), jax.ShapeDtypeStruct((t, c.hidden_size), dtype, sharding=rep),
            spec_layout.abstract(rep), md_v.abstract(rep)), program_options(state, rv * (k + 1))))
    with concurrent.futures.ThreadPoolExecutor(len(lowered)) as pool:  # the programs compile side by side
        programs = list(pool.map(lambda lo: lo[0].compile(compiler_options=lo[1]), lowered))
    total = 0
    for compiled in programs:
        ma = compiled.memory_analysis()
        if ma is None:
            return None
        total += ma.temp_size_in_bytes + ma.output_size_in_bytes + ma.argument_size_in_bytes
    # Arguments counted above include this device's share of the weights (once per program that
    # takes them: the forward and the verify program): take them back out.
    weights = sum(math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize for a in jax.tree.leaves(state))
    return max(total - weights * (len(programs) - 1), 0)


# Tracing and lowering hold Python's lock; XLA's compile does not. Warm-up threads take turns
# at tracing and lowering, one program at a time, so each program's compile starts as soon as its
# own lowering is done; sharing the interpreter among all of them instead would finish every
# lowering near the end, with the compiles all after.
LOWERING = threading.Lock()

# True: decode-only steps get forward programs of their own where the attention kernel has a
# decode-only path (AttentionBackend.for_decode_only_steps), in each token bucket such a step can
# take. Off by default: on the H100 (Llama-3-8B shape) they took 256/256 x 1000 from 13,011 to
# 13,247 output tok/s and batch-1 decode from 5.91 to 5.87 ms/token, and the cold start from 32.4
# to 39.1 s of compiling (five more programs to trace and lower, one at a time), against a 45 s
# cold-start target (benchmarks/results/step_trace_h100.md). A code-path switch: the program
# bundle's key holds it.
DECODE_ONLY_PROGRAMS = False
# Whether steps where no row asks for logprobs take the sampler's lean forms (no logprobs, ranks or
# top logprobs computed; greedy rows only an argmax). Off: every step takes the full sampler.
LEAN_SAMPLER = True

# The sampler programs compiled per row count: (logits processors, structured-output bitmask,
# top-k / top-p truncation; None: decided on the device, see jaxengine.sampler.sample), and the
# lean forms for steps where no row asks for logprobs (a fourth entry: jaxengine.sampler.lean_mode).
SAMPLER_VARIANTS = ((False, False, False), (False, False, True), (False, True, False), (False, True, True),
                    (True, True, None), (False, False, False, "sample"), (False, False, True, "sample"),
                    (False, False, False, "greedy"))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SpecInputs:
    """A speculative step's rows for the verify program (R = verify rows, K = drafts per row)."""

    positions: jax.Array  # [R, K + 1] int32 token rows of hidden whose logits verify (last token, then drafts)
    draft_ids: jax.Array  # [R, K] int32, -1 past the row's drafts
    num_drafts: jax.Array  # [R] int32


def _verify_step(graphdef, state, hidden: jax.Array, packed_spec: jax.Array, packed_md: jax.Array, *,
                 spec_layout: Layout, md_layout: Layout, truncate: bool):
    """Logits at every verified position, then the rejection sampler (jaxengine.rejection_sampler),
    plus a [R] flag for rows whose logits hold a NaN."""
    from jaxengine.rejection_sampler import verify

    sp: SpecInputs = unpack(packed_spec, spec_layout)
    r, k1 = sp.positions.shape
    model = nnx.merge(graphdef, state)
    logits = model.compute_logits(hidden[sp.positions.reshape(-1)]).reshape(r, k1, -1)
    out = verify(logits, sp.draft_ids, sp.num_drafts, unpack(packed_md, md_layout), truncate=truncate)
    return out, jnp.any(jnp.isnan(logits), axis=(1, 2))


def _sample_padded(logits: jax.Array, packed_md: jax.Array, prev_tokens: jax.Array, *, layout: Layout,
                   use_processors: bool, pad_to: int, use_bitmask: bool = False, truncate: bool | None = None,
                   lean: str | None = None):
    """The sampler on metadata packed with `layout`, plus its tokens padded to [pad_to] (a fixed
    shape the next forward reads) and a [R] flag for rows whose logits hold a NaN (that request
    is failed alone, not sampled from). `prev_tokens` [max_num_seqs]: the step before's tokens,
    which fill the history entries still in flight (sampler.resolve_history)."""
    md = unpack(packed_md, layout)
    if use_processors:  # the only variant that reads the history
        md = dataclasses.replace(md, history=resolve_history(md.history, prev_tokens))
    out = sample(logits, md, use_processors=use_processors, use_bitmask=use_bitmask, truncate=truncate, lean=lean)
    nan_rows = jnp.any(jnp.isnan(logits), axis=-1)
    return out, jnp.pad(out.token_ids, (0, pad_to - out.token_ids.shape[0])), nan_rows


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype: jnp.dtype, head_dim: int | None = None) -> int:
    """Bytes of one KV block over all layers; `head_dim`: the cache's head size where the
    attention backend pads it (AttentionBackend.kv_head_dim), else the model's."""
    h = head_dim or cfg.head_dim
    return 2 * cfg.num_layers * cfg.num_kv_heads * block_size * h * jnp.dtype(dtype).itemsize


class ModelRunner:
    """Runs steps of the scheduler's output on the device; reads nothing else of the engine."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, graphdef, state, dtype: jnp.dtype,
                 attention: AttentionBackend, plan=None, eos_token_ids: tuple[int, ...] = (), lora_manager=None,
                 bundle=None):
        """`attention`: the backend every forward program traces (chosen once, at start-up).
        `plan` (a jaxengine.sharding.ShardingPlan) places the KV cache over the mesh and keeps
        step inputs and outputs replicated; None runs on the default device. `eos_token_ids`:
        the model's, banned with each row's stop ids until its min_tokens are out. `bundle` (a
        jaxengine.program_bundle.ProgramBundle, bound to this KV-cache size): programs are read
        from it before compiling and written to it after; None: always compiled."""
        self.config = config
        self.bundle = bundle
        self.eos_token_ids = tuple(eos_token_ids)
        self.model_config = model_config
        self.graphdef = graphdef
        self.state = state
        self.dtype = dtype
        self.token_buckets = token_buckets(config.max_num_batched_tokens, jax.default_backend())
        self.builder = InputBuilder(config.max_blocks_per_seq, config.block_size)
        # Row-stable state of the running requests: decode steps gather from it (jaxengine/persistent_batch.py).
        self.batch = PersistentBatch(config.max_num_seqs, config.max_blocks_per_seq)
        self.num_blocks = config.num_kv_blocks
        self.plan = plan
        self.kv_sharding = plan.kv_sharding() if plan is not None else None
        self._rep = plan.replicated() if plan is not None else None
        self.attention = attention
        # Decode-only steps (every row one token) run programs of their own where the kernel
        # launches less for them (AttentionBackend.for_decode_only_steps), in the token buckets
        # such a step can take; None: the one program per bucket serves every step.
        self.attention_decode = attention.for_decode_only_steps() if DECODE_ONLY_PROGRAMS else None
        self.decode_buckets = (tuple(t for t in self.token_buckets
                                     if t <= pick_bucket(self.token_buckets, config.max_num_seqs))
                               if self.attention_decode is not None else ())
        self.kv_caches = self._allocate_kv()
        # stand-in for the previous step's tokens when nothing is in flight
        self._no_prev = jax.device_put(np.zeros((config.max_num_seqs,), np.int32), self._rep)
        self._forward_fns: dict[int, jax.stages.Compiled] = {}
        self._forward_decode_fns: dict[int, jax.stages.Compiled] = {}
        self._sample_fns: dict[tuple[int, bool, bool, bool | None], jax.stages.Compiled] = {}
        self.mask_words = -(-model_config.vocab_size // 32)  # width of the structured-output bitmask
        self._prompt_lp_fns: dict[int, jax.stages.Compiled] = {}
        self._pool_fns: dict[int, jax.stages.Compiled] = {}
        self._forward_lora_fns: dict[int, jax.stages.Compiled] = {}
        self.spec = config.speculative_config  # jaxengine.spec_decode.SpeculativeConfig, or None
        self._verify_fns: dict[tuple[int, bool], jax.stages.Compiled] = {}
        self.draft = None  # speculative decoding's draft model (jaxengine.draft_model.DraftModel), or None
        self._lora_write: jax.stages.Compiled | None = None
        self.lora_manager = lora_manager  # jaxengine.lora.LoRAManager, or None without LoRA
        self.lora_layers = self._allocate_lora() if lora_manager is not None else None
        self.pooling = config.is_pooling  # every step also hands back each sequence's last hidden state
        leaves, self.param_treedef = jax.tree.flatten(state)
        self.param_leaves = tuple(leaves)
        self._params_abs = _abstract(self.param_leaves)
        self._fwd_out = None
        if plan is not None:  # fixed output placement, so the sampler programs can be compiled for it
            self._fwd_out = ([(self.kv_sharding, self.kv_sharding)] * model_config.num_layers, self._rep, self._rep)
        self._jit_prompt_lp = jax.jit(_flat(_prompt_logprobs, graphdef, self.param_treedef,
                                            k=config.max_logprobs or 1))
        self.compile_seconds = 0.0
        # Around the forward and sampler launches, which release the GIL while XLA enqueues the
        # program (command-buffer updates, the launch): the engine core lets its output worker
        # run Python then (OutputWorker.loop_waiting). A no-op by default.
        self.launch_window: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
        self.attention_impl = self.attention.description  # what runs (benchmarks record it)
        logger.info("attention: %s", self.attention_impl)

    def _put(self, host: np.ndarray) -> jax.Array:
        """A step's packed input (or sampling metadata), copied to the device before the
        program's call: handed to a program of many arguments as numpy, the copy happens inside
        the call, which then takes the host longer (lab/gpu_checks/launch_parts.py)."""
        return jax.device_put(host, self._rep)

    # -- buckets ---------------------------------------------------------------------------
    def rows_for(self, t: int) -> int:
        return min(t, self.config.max_num_seqs)

    def _allocate_kv(self) -> list[tuple[jax.Array, jax.Array]]:
        c = self.model_config
        shape = (self.num_blocks, c.num_kv_heads, self.config.block_size, self.attention.kv_head_dim(c.head_dim))
        kv_dtype = self.attention.kv_dtype(self.dtype)
        make = self._build("kv_zeros", shape, lambda *_: jax.jit(lambda: jnp.zeros(shape, kv_dtype),
                                                                   out_shardings=self.kv_sharding).lower().compile)
        return [(make(), make()) for _ in range(c.num_layers)]

    # -- programs: each _lower_* traces and lowers one and returns what compiles it --------------
    def _lower_forward(self, t: int, lora: bool = False, decode_only: bool = False) -> Callable[[], jax.stages.Compiled]:
        """`decode_only`: the program of decode-only steps (self.attention_decode's kernels)."""
        layout = Layout.of(abstract_inputs(t, self.rows_for(t), self.config.max_blocks_per_seq))
        attention = self.attention_decode if decode_only else self.attention
        fn = jax.jit(_flat(_forward, self.graphdef, self.param_treedef, layout=layout, attention=attention,
                           lora_rank=self.config.max_lora_rank if lora else 0),
                     donate_argnums=(1,), out_shardings=self._fwd_out)
        prev = jax.ShapeDtypeStruct((self.config.max_num_seqs,), jnp.int32, sharding=self._rep)
        args = [self._params_abs, _abstract(self.kv_caches), layout.abstract(self._rep), prev]
        if lora:
            args.append(_abstract(self.lora_layers))
        return functools.partial(fn.lower(*args).compile, compiler_options=program_options(self.state, t))

    def _lower_forward_decode(self, t: int) -> Callable[[], jax.stages.Compiled]:
        return self._lower_forward(t, decode_only=True)

    def _lower_lora_write(self) -> Callable[[], jax.stages.Compiled]:
        """One program writes any slot: the slot index is an argument, so loading never recompiles.
        It takes the host's float32 adapter and casts it to the model's dtype on the device."""
        from jaxengine.lora import target_dims

        r = self.config.max_lora_rank
        dims = target_dims(self.model_config)
        one = [{k: (jax.ShapeDtypeStruct((i, r), jnp.float32), jax.ShapeDtypeStruct((r, o), jnp.float32))
                for k, (i, o) in dims.items()} for _ in self.lora_layers]
        slot = jax.ShapeDtypeStruct((), jnp.int32)
        keep = jax.tree.map(lambda a: a.sharding, self.lora_layers) if self.plan is not None else None
        fn = functools.partial(write_slot, num_slots=self.config.max_loras)
        return jax.jit(fn, donate_argnums=(0,), out_shardings=keep).lower(_abstract(self.lora_layers), one,
                                                                          slot).compile

    def _lower_prompt_logprobs(self, t: int) -> Callable[[], jax.stages.Compiled]:
        hidden = jax.ShapeDtypeStruct((t, self.model_config.hidden_size), self.dtype, sharding=self._rep)
        targets = jax.ShapeDtypeStruct((t,), jnp.int32, sharding=self._rep)
        return functools.partial(self._jit_prompt_lp.lower(self._params_abs, hidden, targets).compile,
                                 compiler_options=program_options(self.state, t))

    def _allocate_lora(self) -> list[dict[str, jax.Array]]:
        """Zeroed LoRA slot arrays of every layer (models/lora.py's layout), split over the mesh
        under tensor parallelism: B of column-parallel projections, A of row-parallel ones."""
        c = self.model_config
        shapes = layer_shapes(c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size,
                              self.config.max_loras, self.config.max_lora_rank)
        out_shardings = None
        if self.plan is not None:
            def sharding(name: str) -> NamedSharding:
                spec = [None] * len(shapes[name])
                if TP_AXIS[name] is not None:
                    spec[TP_AXIS[name]] = "model"
                return NamedSharding(self.plan.mesh, P(*spec))
            out_shardings = [{k: sharding(k) for k in shapes} for _ in range(c.num_layers)]
        zeros = jax.jit(lambda: [{k: jnp.zeros(shape, self.dtype) for k, shape in shapes.items()}
                                 for _ in range(c.num_layers)], out_shardings=out_shardings)
        return zeros()

    def write_lora_slot(self, slot: int, adapter: list[dict[str, tuple[np.ndarray, np.ndarray]]]) -> None:
        """Puts an adapter (per layer, target -> rank-padded (A, B)) into device slot `slot`."""
        if self._lora_write is None:
            if self.config.warmup:
                raise RuntimeError("the LoRA slot writer was not compiled at start-up")
            self._lora_write = self._build("lora_write", 0, lambda _: self._lower_lora_write())
        self.lora_layers = self._lora_write(self.lora_layers, adapter, np.int32(slot))

    def _lora_slots(self, seqs) -> list[int] | None:
        """Each row's LoRA device slot (adapters new to the device are written first), or None
        when no row of the step has an adapter."""
        if self.lora_manager is None:  # LoRA off: nothing per row to read
            return None
        ids = [s.spec.lora_int_id for s in seqs]
        if not any(ids):
            return None
        self.lora_manager.pin({i for i in ids if i})
        try:
            slot_of = {}
            for i in dict.fromkeys(i for i in ids if i):
                slot, weights = self.lora_manager.slot_for_id(i)
                if weights is not None:
                    from jaxengine.lora import stack_for_slot
                    self.write_lora_slot(slot, stack_for_slot(weights, self.model_config, self.config.max_lora_rank))
                slot_of[i] = slot
        finally:
            self.lora_manager.unpin_all()
        return [slot_of.get(i, 0) for i in ids]

    def _lower_pool(self, t: int) -> Callable[[], jax.stages.Compiled]:
        hidden = jax.ShapeDtypeStruct((t, self.model_config.hidden_size), self.dtype, sharding=self._rep)
        rows = jax.ShapeDtypeStruct((self.rows_for(t),), jnp.int32, sharding=self._rep)
        qsl = jax.ShapeDtypeStruct((self.rows_for(t) + 1,), jnp.int32, sharding=self._rep)
        return jax.jit(_pool_rows).lower(hidden, rows, qsl).compile

    def _sampler_layout(self, r: int, processors: bool, masked: bool) -> Layout:
        return Layout.of(build_sampling_metadata([], r, self._history_len(processors), processors=processors,
                                                 mask_words=self.mask_words if masked else 1))

    def _lower_sampler(self, r: int, processors: bool, masked: bool = False, truncate: bool | None = None,
                       lean: str | None = None) -> Callable[[], jax.stages.Compiled]:
        layout = self._sampler_layout(r, processors, masked)
        logits = jax.ShapeDtypeStruct((r, self.model_config.vocab_size), jnp.float32, sharding=self._rep)
        fn = jax.jit(functools.partial(_sample_padded, layout=layout, use_processors=processors,
                                       pad_to=self.config.max_num_seqs, use_bitmask=masked, truncate=truncate,
                                       lean=lean))
        prev = jax.ShapeDtypeStruct((self.config.max_num_seqs,), jnp.int32, sharding=self._rep)
        return fn.lower(logits, layout.abstract(self._rep), prev).compile

    def verify_rows(self, t: int) -> int:
        """Rows of token bucket t's verify program: a speculative step has at most
        `disable_by_batch_size` requests (more unfinished requests turn speculation off)."""
        return min(self.rows_for(t), self.spec.disable_by_batch_size)

    def _spec_layout(self, t: int) -> Layout:
        r, k = self.verify_rows(t), self.spec.num_speculative_tokens
        return Layout.of(SpecInputs(np.zeros((r, k + 1), np.int32), np.zeros((r, k), np.int32), np.zeros(r, np.int32)))

    def _lower_verify(self, t: int, truncate: bool) -> Callable[[], jax.stages.Compiled]:
        r = self.verify_rows(t)
        md_layout = Layout.of(build_sampling_metadata([], r, 1, processors=False))
        spec_layout = self._spec_layout(t)
        fn = jax.jit(_flat(_verify_step, self.graphdef, self.param_treedef, spec_layout=spec_layout,
                           md_layout=md_layout, truncate=truncate))
        hidden = jax.ShapeDtypeStruct((t, self.model_config.hidden_size), self.dtype, sharding=self._rep)
        lowered = fn.lower(self._params_abs, hidden, spec_layout.abstract(self._rep), md_layout.abstract(self._rep))
        return functools.partial(lowered.compile, compiler_options=program_options(
            self.state, r * (self.spec.num_speculative_tokens + 1)))

    def _history_len(self, processors: bool) -> int:
        return self.config.max_model_len if processors else 1

    def warmup(self) -> None:
        """Compiles (or loads from the program bundle) every bucket: forward and prompt logprobs
        per token bucket, samplers per row count, several at a time: XLA compiles outside the GIL,
        and the threads lower one program at a time (LOWERING), the forwards first."""
        rows = sorted({self.rows_for(t) for t in self.token_buckets})
        jobs: list[tuple[str, object]] = (
            [("forward", t) for t in reversed(self.token_buckets)]
            + [("forward_decode", t) for t in reversed(self.decode_buckets)]
            + ([("forward_lora", t) for t in reversed(self.token_buckets)] if self.lora_layers is not None else [])
            + [("prompt_logprobs", t) for t in self.token_buckets]
            + [("sampler", (r, *v)) for r in rows for v in SAMPLER_VARIANTS]
            + ([("pool", t) for t in self.token_buckets] if self.pooling else [])
            + ([("verify", (t, tr)) for t in self.token_buckets for tr in (False, True)] if self.spec else []))
        build = {"forward": self._lower_forward, "prompt_logprobs": self._lower_prompt_logprobs,
                 "sampler": self._lower_sampler, "pool": self._lower_pool,
                 "forward_lora": lambda t: self._lower_forward(t, lora=True), "verify": self._lower_verify,
                 "forward_decode": self._lower_forward_decode}
        tables = self._program_tables()
        if self.draft is not None:  # the draft model's catch-up per token bucket and its propose program
            draft_jobs = {(name, key): fn for name, key, fn in self.draft.compile_jobs()}
            jobs += [("draft", nk) for nk in draft_jobs]
            build["draft"] = lambda name, key: draft_jobs[(name, key)]()
        t0 = time.perf_counter()
        workers = max(1, min(len(jobs), (os.cpu_count() or 2)))
        with concurrent.futures.ThreadPoolExecutor(workers) as pool, \
                tqdm(total=len(jobs), desc="Compiling buckets", unit="program") as bar:
            futures = {pool.submit(self._build, kind, key, build[kind]): (kind, key) for kind, key in jobs}
            for fut in concurrent.futures.as_completed(futures):
                kind, key = futures[fut]
                if kind == "draft":
                    self.draft.install(*key, fut.result())
                else:
                    tables[kind][key] = fut.result()
                bar.update(1)
        if self.lora_layers is not None:
            self._lora_write = self._build("lora_write", 0, lambda _: self._lower_lora_write())
        self.compile_seconds = time.perf_counter() - t0
        loaded = self.bundle.loaded if self.bundle is not None else 0
        logger.info("compiled %d programs and loaded %d from the program bundle in %.1f s (token buckets %s, "
                    "row buckets %s)", len(jobs) - loaded, loaded, self.compile_seconds, list(self.token_buckets),
                    rows)

    def _program_tables(self) -> dict[str, dict]:
        """Kind -> the table of its compiled programs (the kind names them in the program bundle)."""
        return {"forward": self._forward_fns, "forward_decode": self._forward_decode_fns,
                "prompt_logprobs": self._prompt_lp_fns, "sampler": self._sample_fns,
                "pool": self._pool_fns, "forward_lora": self._forward_lora_fns, "verify": self._verify_fns}

    def _build(self, kind: str, key, lower_fn) -> jax.stages.Compiled:
        """Program `kind` of `key`: read from the bundle of an earlier start, else lowered
        (`lower_fn(*key)` for a tuple key, else `lower_fn(key)`), compiled and added to the bundle."""
        name = f"{kind}:{key!r}"
        fn = self.bundle.load(name) if self.bundle is not None else None
        if fn is None:
            fn, from_cache = self._compile_program(key, lower_fn)
            if self.bundle is not None:
                self.bundle.save(name, fn, from_cache=from_cache)
        return fn

    def _compile_program(self, key, lower_fn) -> tuple[jax.stages.Compiled, bool]:
        """Lowers a program (one at a time: LOWERING), then compiles it: (executable, whether
        JAX's persistent cache gave it, which the bundle does not keep; see
        ProgramBundle.fresh_compile). Without a bundle, a plain compile."""
        with LOWERING:
            compile_ = lower_fn(*key) if isinstance(key, tuple) else lower_fn(key)
        with self.bundle.fresh_compile() if self.bundle is not None else contextlib.nullcontext() as record:
            fn = compile_()
        return fn, bool(record is not None and record.from_cache)

    def _get(self, table: dict, key, lower_fn, what: str) -> jax.stages.Compiled:
        """A program compiled (or loaded) at start-up; compiling one later is a bug when warm-up
        was on. Without warm-up, each program is built on its first use."""
        fn = table.get(key)
        if fn is None:
            if self.config.warmup:
                raise RuntimeError(f"{what} {key} was not compiled at start-up")
            kind = next(k for k, t in self._program_tables().items() if t is table)
            fn = table[key] = self._build(kind, key, lower_fn)
        return fn

    def _get_forward(self, t: int) -> jax.stages.Compiled:
        return self._get(self._forward_fns, t, self._lower_forward, "token bucket")

    def _get_forward_decode(self, t: int) -> jax.stages.Compiled:
        """The forward of a decode-only step in bucket t (see `attention_decode`)."""
        return self._get(self._forward_decode_fns, t, self._lower_forward_decode, "decode-only token bucket")

    def _get_prompt_lp(self, t: int) -> jax.stages.Compiled:
        return self._get(self._prompt_lp_fns, t, self._lower_prompt_logprobs, "prompt-logprob program for bucket")

    def _get_sampler(self, r: int, processors: bool, masked: bool = False, truncate: bool | None = None,
                     lean: str | None = None) -> jax.stages.Compiled:
        """The sampler program of a variant; the processors variant decides truncation itself.
        `lean` (jaxengine.sampler.lean_mode): no row asks for logprobs; taken without processors
        and bitmask only."""
        if processors:
            key = (r, True, True, None)
        elif lean is not None and not masked:
            key = (r, False, False, lean == "sample" and bool(truncate), lean)
        else:
            key = (r, False, masked, bool(truncate))
        return self._get(self._sample_fns, key, self._lower_sampler,
                         "sampler (rows, processors, bitmask, truncate[, lean])")

    # -- one step --------------------------------------------------------------------------
    def dispatch(self, sched: SchedulerOutput, prev: InFlight | None = None) -> InFlight:
        """Enqueues one step for the scheduler's output without waiting for the device.

        `prev`, the step still in flight, supplies the tokens of decode rows whose input is a
        placeholder. The model's eos ids are banned with a row's stop ids until its min_tokens
        are out; rows that asked for prompt logprobs get them for this step's prompt tokens.
        """
        return self.dispatch_sampler(self.dispatch_forward(sched, prev))

    def dispatch_forward(self, sched: SchedulerOutput, prev: InFlight | None = None) -> PendingStep:
        """Enqueues a step's forward (and prompt logprobs, pooling); its sampler waits for
        `dispatch_sampler`, so the host can compute the bitmask of constrained rows meanwhile."""
        seqs = sched.seqs
        t = pick_bucket(self.token_buckets, sched.num_batched_tokens)
        r = self.rows_for(t)
        lora_slots = self._lora_slots(seqs)
        self.batch.release(sched.finished_ids)
        self.batch.release(sched.preempted_ids)
        rows = None
        one_token_rows = bool(seqs) and sched.num_batched_tokens == len(seqs)
        if one_token_rows:  # one token per row: the decode steady state
            rows = self.batch.rows(seqs, sched.columns)
        # The steady state: the step in flight had these rows in this order, each sampling, so a
        # row's token in flight is the same row of its samples (no id lookups).
        same_rows = prev is not None and rows is not None and prev.row_ids is not None and prev.row_ids == rows.ids
        inputs = self.builder.build(seqs, t, r, prev.rows if prev is not None and not same_rows else None, lora_slots,
                                    (self.batch, rows) if rows is not None else None, same_rows)
        prev_tokens = prev.tokens if prev is not None else self._no_prev
        # Each numpy argument is its own host-to-device copy: one packed buffer per program.
        if lora_slots is None and one_token_rows and self.attention_decode is not None:
            fwd, extra = self._get_forward_decode(t), ()  # one token a row: no prefill kernel launched
        elif lora_slots is None:  # the base model's program: steps without adapters pay nothing for LoRA
            fwd, extra = self._get_forward(t), ()
        else:
            fwd = self._get(self._forward_lora_fns, t, lambda t_: self._lower_forward(t_, lora=True),
                            "LoRA token bucket")
            extra = (self.lora_layers,)
        packed = self._put(self.builder.packed(t, r))
        with self.launch_window():
            self.kv_caches, logits, hidden = fwd(self.param_leaves, self.kv_caches, packed, prev_tokens, *extra)
        prompt_lp = None
        # (a step of persistent-batch rows none of which asked for them has no targets)
        targets = None
        if rows is None or self.batch.wants_prompt_logprobs(rows.slots):
            targets = prompt_logprob_targets(seqs, t)
        if targets is not None:
            prompt_lp = self._get_prompt_lp(t)(self.param_leaves, hidden, self._put(targets))
        pooled = None
        if self.pooling:
            # a copy: the builder reuses its buffers, and the CPU backend may read numpy memory late
            pooled = self._get(self._pool_fns, t, self._lower_pool, "pooling program for bucket")(
                hidden, np.array(inputs.logits_indices), np.array(inputs.attn.query_start_loc))
        return PendingStep(seqs, r, logits, prompt_lp, pooled, hidden, t, prev_tokens, prev, rows,
                           rows.ids if rows is not None and sched.all_sample else None)

    def dispatch_sampler(self, step: PendingStep, bitmask: np.ndarray | None = None) -> InFlight:
        """Enqueues the sampler of a step whose forward is enqueued. `bitmask` [R, mask_words]
        int32: the structured-output bitmask of the step's rows (None: no row is constrained)."""
        seqs, r = step.seqs, step.num_rows
        packed = None
        if step.rows is not None and bitmask is None:  # the decode steady state: packed from the batch's columns
            packed = rows_sampling_packed(self.batch, step.rows, r)
        if packed is not None:
            (packed_md, truncate), processors, masked = packed, False, False
        else:
            fast = rows_sampling_metadata(self.batch, step.rows, r) if step.rows is not None else None
            if fast is not None:
                (md, truncate), processors = fast, False
            else:
                md, processors, truncate = batch_sampling_metadata(seqs, self.eos_token_ids, r,
                                                                   self._history_len(True), prev_rows=step.prev_rows)
            masked = bitmask is not None or processors  # the processors program always reads a bitmask
            if masked:
                md.bitmask = bitmask if bitmask is not None else np.full((r, self.mask_words), -1, np.int32)
            packed_md = pack(md)
        lean = None
        if LEAN_SAMPLER and not masked:
            lean = (self.batch.lean_mode(step.rows.slots) if step.rows is not None
                    else lean_mode([s.spec.params for s in seqs]))
        sampler = self._get_sampler(r, processors, masked, truncate, lean)
        with self.launch_window():
            sampler_out, tokens, nan_rows = sampler(step.logits, self._put(packed_md), step.prev_tokens)
        return InFlight(sampler_out, len(seqs), step.prompt_lp, tokens, seqs, nan_rows, step.pooled,
                        row_ids=step.row_ids)

    def dispatch_spec(self, sched: SchedulerOutput) -> InFlight:
        """Enqueues a speculative step (rows with draft tokens; nothing in flight before it): the
        forward over every row's tokens, then the verify program instead of the sampler."""
        pending = self.dispatch_forward(sched, None)
        seqs, t = pending.seqs, pending.num_tokens
        r, k = self.verify_rows(t), self.spec.num_speculative_tokens
        if len(seqs) > r:
            raise RuntimeError(f"a speculative step of {len(seqs)} rows exceeds the verify program's {r}")
        md, processors, truncate = batch_sampling_metadata(seqs, self.eos_token_ids, r, 1)
        if processors:
            raise RuntimeError("a speculative step holds a row that needs logits processors")
        positions = np.zeros((r, k + 1), np.int32)
        drafts = np.full((r, k), -1, np.int32)
        num = np.zeros(r, np.int32)
        end = 0
        for i, s in enumerate(seqs):
            end += s.num_new_tokens
            d = s.num_drafts
            last = end - 1 - d  # the row's last real token; its drafts follow it
            positions[i] = np.minimum(last + np.arange(k + 1), end - 1)
            if d:
                drafts[i, :d] = s.token_ids[-d:]
                num[i] = d
        spec = SpecInputs(positions, drafts, num)
        out, nan_rows = self._get(self._verify_fns, (t, bool(truncate)), self._lower_verify, "verify program")(
            self.param_leaves, pending.hidden, self._put(pack(spec)), self._put(pack(md)))
        return InFlight(out, len(seqs), pending.prompt_lp, self._no_prev, seqs, nan_rows, pending.pooled,
                        spec=True)

    @staticmethod
    def collect(handle: InFlight) -> RunnerOutput:
        """Waits for a dispatched step: the one device-to-host transfer of the step."""
        out, prompt_lp, nan_rows, pooled = jax.device_get((handle.sampler_out, handle.prompt_lp, handle.nan_rows,
                                                           handle.pooled))
        n = handle.num_seqs
        return RunnerOutput(out.token_ids[:n], out.logprob[:n], out.rank[:n], out.top_ids[:n], out.top_logprobs[:n],
                            prompt_lp, nan_rows[:n], None if pooled is None else tuple(p[:n] for p in pooled),
                            out.num_tokens[:n] if handle.spec else None)

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        """One step, waited for (tests and tools; the engine overlaps `dispatch` and `collect`)."""
        return self.collect(self.dispatch(sched))


@dataclasses.dataclass
class PendingStep:
    """A step whose forward is enqueued and whose sampler is not yet."""

    seqs: list  # the scheduler's rows (ScheduledSeq)
    num_rows: int  # R, the sampler's row bucket
    logits: jax.Array  # [R, V] on the device
    prompt_lp: tuple | None
    pooled: tuple | None
    hidden: jax.Array  # [T, D] the final hidden states (speculative steps verify from them)
    num_tokens: int  # T, the step's token bucket
    prev_tokens: jax.Array  # [max_num_seqs] the tokens of the step before (placeholders read them)
    prev: InFlight | None  # the step before, if one was in flight
    rows: BatchRows | None = None  # a step of one-token rows: their slots in the runner's persistent batch
    row_ids: list[str] | None = None  # `rows.ids` when every row samples, else None

    @property
    def prev_rows(self) -> dict[str, int] | None:
        """Each request's row in the step before, if one was in flight."""
        return self.prev.rows if self.prev is not None else None


@dataclasses.dataclass
class InFlight:
    """A dispatched step whose results are still on the device."""

    sampler_out: object  # SamplerOutput of device arrays
    num_seqs: int
    prompt_lp: tuple | None  # device (logprob, rank, top_ids, top_logprobs), each [T, ...]
    tokens: jax.Array  # [max_num_seqs] int32 sampled tokens, on the device, for the next step's inputs
    seqs: list  # the step's rows (ScheduledSeq)
    nan_rows: jax.Array  # [R] bool, on the device
    pooled: tuple | None = None  # pooling engines: ([R, D] f32 last, first and summed hidden states)
    spec: bool = False  # a speculative step: sampler_out is a rejection_sampler.VerifyOutput
    row_ids: list[str] | None = None  # a step of one-token rows that all sample: each row's request id

    @functools.cached_property
    def rows(self) -> dict[str, int]:
        """Request id -> its row in this step's samples (built when a step after it first asks)."""
        return {s.request_id: i for i, s in enumerate(self.seqs) if s.samples}
