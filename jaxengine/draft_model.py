"""The draft model of speculative decoding (`speculative_config={"model": DRAFT, ...}`).

A small model of the target's vocabulary proposes each decoding request's next k tokens; the
target verifies them in one step (jaxengine/rejection_sampler.py). The draft has its own paged KV
cache, addressed by the target's block tables: the same block ids and slots, its own layers,
heads and head size. It runs only while speculation is on, in two programs:

1. catch-up: before a request's proposal, the draft computes the tokens it has not seen yet (the
   whole prompt the first time, a few accepted tokens after a step), in the target's token
   buckets. So a draft costs nothing while speculation is off (a large batch), and a preempted
   request (`Request.draft_computed` back to 0) is recomputed as the target recomputes it.
2. propose: k greedy decode steps of the draft for every proposing row at once, from the
   request's last token at its last position. It writes the draft's KV of that token and of the
   first k - 1 drafts, and returns the k drafts. At the next proposal the drafts the target
   accepted count as computed (`Request.draft_written` is compared with the request's tokens);
   the KV of rejected ones is written again by the catch-up.

Drafts are the draft's argmax tokens, a deterministic proposal: the verify program accepts a
sampled request's draft with probability p(draft) under the target and resamples from the rest,
which keeps the target's distribution exactly.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxengine.attention_backend import AttentionBackend
from jaxengine.config import EngineConfig, pick_bucket, token_buckets
from jaxengine.input_batch import InputBuilder, StepInputs, abstract_inputs
from jaxengine.models.attention import AttentionMetadata
from jaxengine.model_runner import _abstract, _flat
from jaxengine.models.config import ModelConfig
from jaxengine.packing import Layout, pack, unpack
from jaxengine.scheduler import ScheduledSeq

logger = logging.getLogger(__name__)

MIN_PROPOSE_ROWS = 16  # the propose program's rows are at least the smallest token bucket


@dataclasses.dataclass(frozen=True)
class LoadedDraft:
    """A draft model on the device: what start-up hands to the runner."""

    source: str  # as given in speculative_config.model
    model_config: ModelConfig
    graphdef: nnx.GraphDef
    state: nnx.State
    attention: AttentionBackend


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ProposeInputs:
    """One proposal round's rows (R = propose rows, M = max blocks per sequence)."""

    tokens: jax.Array  # [R] int32 each request's last token
    positions: jax.Array  # [R] int32 its position (the request's tokens - 1)
    block_tables: jax.Array  # [R, M] int32
    num_steps: jax.Array  # [R] int32 drafts wanted (at most k; slots are allocated for them)
    num_seqs: jax.Array  # [1] int32 live rows


def _catch_up(graphdef, state, kv_caches, packed: jax.Array, *, layout: Layout, attention: AttentionBackend):
    """The draft's forward over a step's tokens, for their KV only (no logits)."""
    inputs: StepInputs = unpack(packed, layout)
    model = nnx.merge(graphdef, state)
    _, kv_caches = model(inputs.input_ids, inputs.positions, kv_caches, inputs.attn, attention)
    return kv_caches


def _propose(graphdef, state, kv_caches, packed: jax.Array, *, layout: Layout, attention: AttentionBackend,
             k: int, block_size: int):
    """k greedy decode steps of the draft for every row -> (caches, drafts [R, k] int32).

    Step j feeds each row's token at position + j (its last token, then its own drafts) and writes
    its KV there; steps past a row's `num_steps` write to the null block 0 and their drafts are
    not used."""
    inp: ProposeInputs = unpack(packed, layout)
    model = nnx.merge(graphdef, state)
    r, m = inp.block_tables.shape
    live = jnp.arange(r) < inp.num_seqs[0]
    qsl = jnp.minimum(jnp.arange(r + 1, dtype=jnp.int32), inp.num_seqs[0])
    last = jnp.maximum(inp.num_steps - 1, 0)

    def step(j, carry):
        tokens, kv, drafts = carry
        pos = inp.positions + jnp.minimum(j, last)  # past num_steps: stay on the last slot that exists
        block = jnp.take_along_axis(inp.block_tables, jnp.minimum(pos // block_size, m - 1)[:, None], axis=1)[:, 0]
        writes = live & (j < inp.num_steps)
        md = AttentionMetadata(jnp.where(writes, block * block_size + pos % block_size, 0),
                               jnp.where(live, pos + 1, 0), inp.block_tables, qsl, inp.num_seqs)
        hidden, kv = model(tokens, jnp.where(live, pos, 0), kv, md, attention)
        nxt = jnp.argmax(model.compute_logits(hidden), axis=-1).astype(jnp.int32)
        return jnp.where(live, nxt, 0), kv, drafts.at[:, j].set(nxt)

    # Unrolled: a rolled loop on the GPU would read its predicate on the host every iteration.
    _, kv_caches, drafts = jax.lax.fori_loop(0, k, step, (inp.tokens, kv_caches, jnp.zeros((r, k), jnp.int32)),
                                             unroll=True)
    return kv_caches, drafts


class DraftModel:
    """The draft's weights, KV cache and programs; `propose` is its one entry point."""

    def __init__(self, config: EngineConfig, loaded: LoadedDraft, dtype: jnp.dtype):
        spec = config.speculative_config
        self.config = config
        self.model_config = loaded.model_config
        self.source = loaded.source
        self.graphdef = loaded.graphdef
        self.attention = loaded.attention
        self.dtype = dtype
        self.k = spec.num_speculative_tokens
        self.rows = max(MIN_PROPOSE_ROWS, min(config.max_num_seqs, spec.disable_by_batch_size))
        self.token_buckets = token_buckets(config.max_num_batched_tokens)
        self.builder = InputBuilder(config.max_blocks_per_seq, config.block_size)
        leaves, self.treedef = jax.tree.flatten(loaded.state)
        self.param_leaves = tuple(leaves)
        c = self.model_config
        shape = (config.num_kv_blocks, c.num_kv_heads, config.block_size, self.attention.kv_head_dim(c.head_dim))
        make = jax.jit(lambda: jnp.zeros(shape, dtype))
        self.kv_caches = [(make(), make()) for _ in range(c.num_layers)]
        self._propose_layout = Layout.of(ProposeInputs(
            np.zeros(self.rows, np.int32), np.zeros(self.rows, np.int32),
            np.zeros((self.rows, config.max_blocks_per_seq), np.int32), np.zeros(self.rows, np.int32),
            np.zeros(1, np.int32)))
        self._catch_up_fns: dict[int, jax.stages.Compiled] = {}
        self._propose_fn: jax.stages.Compiled | None = None
        self.num_catch_up_tokens = 0  # tokens the catch-up computed, in all
        logger.info("speculative decoding: draft model %s (%s, %d layers), %d drafts a step, attention %s",
                    self.source, c.architecture, c.num_layers, self.k, self.attention.description)

    # -- programs -----------------------------------------------------------------------------
    def lower_catch_up(self, t: int) -> Callable[[], jax.stages.Compiled]:
        layout = Layout.of(abstract_inputs(t, min(t, self.config.max_num_seqs), self.config.max_blocks_per_seq))
        fn = jax.jit(_flat(_catch_up, self.graphdef, self.treedef, layout=layout, attention=self.attention),
                     donate_argnums=(1,))
        return fn.lower(_abstract(self.param_leaves), _abstract(self.kv_caches), layout.abstract()).compile

    def lower_propose(self) -> Callable[[], jax.stages.Compiled]:
        fn = jax.jit(_flat(_propose, self.graphdef, self.treedef, layout=self._propose_layout,
                           attention=self.attention, k=self.k, block_size=self.config.block_size),
                     donate_argnums=(1,))
        return fn.lower(_abstract(self.param_leaves), _abstract(self.kv_caches),
                        self._propose_layout.abstract()).compile

    def compile_jobs(self) -> list[tuple[str, object, object]]:
        """(table name, key, lowering function) of every program, for the runner's warm-up."""
        return ([("draft_catch_up", t, functools.partial(self.lower_catch_up, t)) for t in self.token_buckets]
                + [("draft_propose", None, self.lower_propose)])

    def install(self, name: str, key, compiled: jax.stages.Compiled) -> None:
        if name == "draft_catch_up":
            self._catch_up_fns[key] = compiled
        else:
            self._propose_fn = compiled

    def _get_catch_up(self, t: int) -> jax.stages.Compiled:
        fn = self._catch_up_fns.get(t)
        if fn is None:
            if self.config.warmup:
                raise RuntimeError(f"the draft's token bucket {t} was not compiled at start-up")
            fn = self._catch_up_fns[t] = self.lower_catch_up(t)()
        return fn

    def _get_propose(self) -> jax.stages.Compiled:
        if self._propose_fn is None:
            if self.config.warmup:
                raise RuntimeError("the draft's propose program was not compiled at start-up")
            self._propose_fn = self.lower_propose()()
        return self._propose_fn

    # -- one proposal round -----------------------------------------------------------------
    def propose(self, rows: list[tuple[object, int, list[int]]]) -> list[list[int]]:
        """Drafts for each (request, drafts wanted, its block table) whose next step is a decode
        and whose slots for the drafts are allocated; the drafts, in order."""
        if len(rows) > self.rows:
            raise RuntimeError(f"{len(rows)} proposing requests exceed the propose program's {self.rows} rows")
        pending = []
        for req, _, blocks in rows:
            last = req.num_tokens - 1  # the position of the token the proposal starts from
            done = req.draft_computed
            if req.draft_written:  # the last proposal's drafts: computed where the target accepted them
                actual = req.token_ids_slice(done, min(done + len(req.draft_written), last))
                n = 0
                while n < len(actual) and actual[n] == req.draft_written[n]:
                    n += 1
                done += n
            done = min(done, last)
            req.draft_computed, req.draft_written = done, []
            if done < last:
                pending.append([req, done, last, blocks])
        if pending:
            self._catch_up(pending)
        m = self.config.max_blocks_per_seq
        tokens = np.zeros(self.rows, np.int32)
        positions = np.zeros(self.rows, np.int32)
        tables = np.zeros((self.rows, m), np.int32)
        steps = np.zeros(self.rows, np.int32)
        for i, (req, n, blocks) in enumerate(rows):
            tokens[i], positions[i], steps[i] = req.output_token_ids[-1], req.num_tokens - 1, n
            tables[i, :len(blocks)] = blocks
        inputs = ProposeInputs(tokens, positions, tables, steps, np.asarray([len(rows)], np.int32))
        self.kv_caches, drafts = self._get_propose()(self.param_leaves, self.kv_caches, jax.device_put(pack(inputs)))
        drafts = np.asarray(jax.device_get(drafts))
        out = []
        for i, (req, n, _) in enumerate(rows):
            d = drafts[i, :n].tolist()
            req.draft_computed = req.num_tokens  # the last token's KV is written now
            req.draft_written = d[:-1]  # and the drafts' before the last, at the positions after it
            out.append(d)
        return out

    def _catch_up(self, pending: list[list]) -> None:
        """The draft's KV of each request's tokens [done, last), in steps of the token budget:
        one chunk per request and step, requests in order."""
        budget = self.config.max_num_batched_tokens
        while pending:
            seqs, left = [], budget
            for item in pending:
                if left == 0:
                    break
                req, start, end, blocks = item
                n = min(end - start, left)
                seqs.append(ScheduledSeq(req.request_id, start, n, req.token_ids_slice(start, start + n), blocks,
                                         False, req.spec, None))
                item[1] += n
                left -= n
            total = budget - left
            t = pick_bucket(self.token_buckets, total)
            inputs = self.builder.build(seqs, t, min(t, self.config.max_num_seqs))
            self.kv_caches = self._get_catch_up(t)(self.param_leaves, self.kv_caches, jax.device_put(pack(inputs)))
            self.num_catch_up_tokens += total
            pending = [item for item in pending if item[1] < item[2]]
