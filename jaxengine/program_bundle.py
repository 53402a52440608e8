"""Serialized executables of an earlier start, so a later start with the same key neither traces
nor compiles.

A start computes a key from everything that shapes its programs: jax and jaxlib versions, the
backend, device kind and count, XLA_FLAGS and every other JAX_ / XLA_ variable, x64 and matmul
precision, a hash of the engine's own source (jaxengine, its models and kernels) and the values of
its code-path constants (`SWITCH_MODULES`), the derived engine config (buckets follow from it:
max_num_batched_tokens, max_num_seqs, max_model_len, block_size, ...), the model config, the
dtype, the parameter tree (paths, shapes, dtypes, placement), the tensor-parallel mesh and the
attention backend. Under
`<compilation_cache_dir>/bundles/`:

- `sizing-<key>.json` keeps the KV-cache size that start chose, so a later start skips the
  memory profile (and its compile);
- `<key + num_kv_blocks>/` holds one file per program (`jax.experimental.serialize_executable`),
  each carrying the bundle key, its program name and a checksum of its payload.

A program file that is unreadable, corrupt, or carries another key or name is refused with a
warning and the program is compiled again, which overwrites it: a stale bundle never crashes a
start and never runs a program built for another configuration. Loading a file runs no code of
its own beyond what jax's deserializer does, but it is a pickle: like JAX's persistent cache,
the directory must be writable only by the user.
"""

from __future__ import annotations

import dataclasses
import contextlib
import functools
import hashlib
import importlib
import json
import logging
import os
import pickle
import sys
import tempfile
import threading

import jax
import jax.numpy as jnp

logger = logging.getLogger(__name__)

BUNDLE_FORMAT = 1  # bumped when the file layout changes
# Engine fields that shape no program: the cache location, when programs compile, the engine's seed
# (weights are arguments, never constants) and host-side options. num_kv_blocks is keyed apart
# (ProgramBundle.bind): a start keeps the size it chose with the bundle.
_HOST_ONLY_FIELDS = frozenset({"compilation_cache_dir", "warmup", "enforce_eager", "seed", "num_kv_blocks",
                               "tokenizer", "revision", "skip_tokenizer_init", "trust_remote_code",
                               "enable_prefix_caching", "max_cpu_loras"})


@functools.lru_cache(maxsize=1)
def source_hash() -> str:
    """sha256 over the .py files of jaxengine (its own folder), jaxengine.models and
    jaxengine.pallas_kernels: a changed model or kernel file never reuses an old program."""
    import jaxengine
    import jaxengine.models
    import jaxengine.pallas_kernels

    h = hashlib.sha256()
    roots = [(os.path.dirname(jaxengine.__file__), False), (os.path.dirname(jaxengine.models.__file__), True),
             (os.path.dirname(jaxengine.pallas_kernels.__file__), True)]
    for root, recursive in roots:
        names = []
        for folder, dirs, files in os.walk(root):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__") if recursive else []
            names += [os.path.join(folder, f) for f in files if f.endswith(".py")]
        for path in sorted(names):
            h.update(os.path.relpath(path, root).encode())
            with open(path, "rb") as f:
                h.update(hashlib.sha256(f.read()).digest())
    return h.hexdigest()


# Modules whose upper-case constants choose code paths while the model traces (which kernel a
# quantized linear runs, row thresholds, XLA options per program). Their values join the key, so a
# constant set at run time (a laboratory patch) never reuses programs built under another value.
SWITCH_MODULES = ("jaxengine.models.quantization", "jaxengine.xla_options", "jaxengine.model_runner")
# The kernels' modules (grids, tilings, kernel forms): counted when imported, since a kernel module
# this process never imported cannot have shaped its programs (and importing them all would cost
# a CPU start the Triton lowering's import).
KERNEL_SWITCH_PACKAGE = "jaxengine.pallas_kernels."


def switch_values() -> dict[str, str]:
    """The current values of SWITCH_MODULES' upper-case scalar constants, and those of the kernel
    modules imported so far, by qualified name."""
    kernels = sorted(m for m in sys.modules if m.startswith(KERNEL_SWITCH_PACKAGE))
    out = {}
    for name in (*SWITCH_MODULES, *kernels):
        for attr, value in sorted(vars(importlib.import_module(name)).items()):
            if attr.isupper() and isinstance(value, (bool, int, float, str, tuple)):
                out[f"{name}.{attr}"] = repr(value)
    return out


def bundle_key_fields(config, model_config, dtype, attention, plan, state) -> dict[str, object]:
    """Everything the start's programs depend on, as JSON-safe values (see the module docstring)."""
    import jaxlib

    dev = jax.devices()[0]
    engine = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.name not in _HOST_ONLY_FIELDS}
    if config.num_kv_blocks is not None:  # given by the user: no sizing to keep
        engine["num_kv_blocks"] = config.num_kv_blocks
    leaves, treedef = jax.tree.flatten(state)
    params = [(tuple(a.shape), str(a.dtype), str(getattr(a, "sharding", None))) for a in leaves]
    return {
        "format": BUNDLE_FORMAT, "jax": jax.__version__, "jaxlib": jaxlib.__version__,
        "backend": jax.default_backend(), "platform_version": getattr(dev.client, "platform_version", ""),
        "device_kind": dev.device_kind, "device_count": jax.device_count(), "process_count": jax.process_count(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""), "source": source_hash(), "switches": switch_values(),
        # JAX's settings that change what a trace produces (also when set from the environment)
        "jax_env": sorted((k, v) for k, v in os.environ.items() if k.startswith(("JAX_", "XLA_"))),
        "x64": bool(jax.config.jax_enable_x64), "matmul_precision": str(jax.config.jax_default_matmul_precision),
        "engine": {k: repr(v) for k, v in sorted(engine.items())}, "model": repr(model_config),
        "dtype": jnp.dtype(dtype).name, "attention": f"{attention.name}: {attention.description}",
        "kv_scales": repr(attention.kv_scales),  # constants of the programs (an fp8 cache's scales)
        "mesh": None if plan is None else repr(dict(plan.mesh.shape)), "params": str(treedef),
        "param_shapes": hashlib.sha256(repr(params).encode()).hexdigest(),
    }


def _digest(obj: object) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def _write_atomic(path: str, data: bytes) -> None:
    """Another process starting with the same key may write the same file: each write is whole."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


class ProgramBundle:
    """One start's serialized executables: `load` before compiling a program, `save` after."""

    def __init__(self, root: str, key_fields: dict[str, object]):
        self.root = os.path.join(root, "bundles")
        self.base_key = _digest(key_fields)
        self.key: str | None = None  # set by bind(): base key + the KV-cache size
        self.dir: str | None = None
        self.loaded = 0  # programs read back
        self.saved = 0  # programs written
        self.refused = 0  # program files that were unreadable or did not match
        self.skipped = 0  # programs not written: read from JAX's persistent cache (see fresh_compile)
        self.load_s = 0.0  # seconds spent reading and deserializing

    # -- the KV-cache size a start chose ------------------------------------------------------
    def _sizing_path(self) -> str:
        return os.path.join(self.root, f"sizing-{self.base_key[:32]}.json")

    def stored_num_kv_blocks(self) -> int | None:
        """The KV-cache size an earlier start with this key chose, or None."""
        try:
            with open(self._sizing_path()) as f:
                data = json.load(f)
            n = data["num_kv_blocks"]
            if data.get("key") != self.base_key or not isinstance(n, int) or n < 2:
                raise ValueError("wrong key or size")
            return n
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as e:
            logger.warning("program bundle: ignoring the stored KV-cache size %s (%s)", self._sizing_path(), e)
            return None

    def store_num_kv_blocks(self, n: int) -> None:
        try:
            os.makedirs(self.root, exist_ok=True)
            _write_atomic(self._sizing_path(), json.dumps({"key": self.base_key, "num_kv_blocks": n}).encode())
        except OSError as e:
            logger.warning("program bundle: could not store the KV-cache size (%s)", e)

    def bind(self, num_kv_blocks: int) -> None:
        """Fixes the KV-cache size: every program's cache arguments have that many blocks."""
        self.key = _digest([self.base_key, num_kv_blocks])
        self.dir = os.path.join(self.root, self.key[:32])

    # -- programs ------------------------------------------------------------------------------
    def _path(self, name: str) -> str:
        return os.path.join(self.dir, hashlib.sha256(name.encode()).hexdigest()[:32] + ".xla")

    def load(self, name: str) -> jax.stages.Compiled | None:
        """Program `name` of this bundle, or None (absent, or refused with a warning)."""
        assert self.dir is not None, "bind() first"
        import time

        from jax.experimental.serialize_executable import deserialize_and_load

        path = self._path(name)
        t0 = time.perf_counter()
        try:
            with open(path, "rb") as f:
                record = pickle.load(f)
            if not isinstance(record, dict) or record.get("format") != BUNDLE_FORMAT:
                raise ValueError("not a program file of this format")
            if record.get("key") != self.key or record.get("name") != name:
                raise ValueError(f"built for another configuration or program ({record.get('name')!r})")
            payload = record["payload"]
            if hashlib.sha256(payload).hexdigest() != record.get("sha256"):
                raise ValueError("checksum mismatch")
            serialized, in_tree, out_tree = pickle.loads(payload)
            by_id = {d.id: d for d in jax.devices()}
            devices = [by_id[i] for i in record.get("devices", ())] or None
            compiled = deserialize_and_load(serialized, in_tree, out_tree, execution_devices=devices)
        except FileNotFoundError:
            return None
        except Exception as e:  # noqa: BLE001 - any unreadable bundle means: compile again
            self.refused += 1
            logger.warning("program bundle: refusing %s for %s (%s: %s); compiling it again", path, name,
                           type(e).__name__, e)
            return None
        self.loaded += 1
        self.load_s += time.perf_counter() - t0
        return compiled

    @staticmethod
    @contextlib.contextmanager
    def fresh_compile():
        """JAX's persistent compilation cache off for this thread while a program bound for the
        bundle compiles: an executable read from that cache does not serialize whole (on CPU a
        reloaded copy fails with "Function wrapped_compare.2 not found": its sort comparators are
        missing), so the bundle's programs are compiled afresh, and the bundle takes the cache's
        place for them.

        The thread's switch alone only holds until JAX has opened its cache: JAX decides once
        per process whether the cache is used (`compilation_cache.is_cache_used`) and, once
        opened, reads it whatever the thread's setting, so a program compiled after any other
        compile of the process could still come from the cache. While any fresh_compile block
        runs, the opened cache is therefore also put aside (`_suspend_persistent_cache`: no read,
        no write, for every thread of the process meanwhile). The yielded record's `from_cache`
        says whether this thread read the cache all the same; `save` refuses such a program."""
        from jax._src import config as jax_config

        from jaxengine.compile_monitor import thread_cache_hits

        state = getattr(jax_config, "enable_compilation_cache", None)
        record = _CompileRecord()
        hits = thread_cache_hits()
        with _suspend_persistent_cache(), state(False) if state is not None else contextlib.nullcontext():
            yield record
        record.from_cache = thread_cache_hits() > hits

    def save(self, name: str, compiled: jax.stages.Compiled, from_cache: bool = False) -> None:
        """Adds a compiled program; a program that cannot be serialized is only logged (the
        next start compiles it again). `from_cache`: the executable was read from JAX's
        persistent cache (see fresh_compile), so it is not kept: its reloaded copy may lack
        functions; a later start gets it from that cache again."""
        assert self.dir is not None, "bind() first"
        from jax.experimental.serialize_executable import serialize

        if from_cache:
            self.skipped += 1
            logger.debug("program bundle: not keeping %s (read from the persistent compilation cache)", name)
            return
        try:
            payload = pickle.dumps(serialize(compiled))
            record = {"format": BUNDLE_FORMAT, "key": self.key, "name": name, "payload": payload,
                      "sha256": hashlib.sha256(payload).hexdigest(), "devices": _device_ids(compiled)}
            os.makedirs(self.dir, exist_ok=True)
            _write_atomic(self._path(name), pickle.dumps(record))
        except Exception as e:  # noqa: BLE001 - the bundle is an optimisation, never a failure
            logger.warning("program bundle: could not save %s (%s: %s)", name, type(e).__name__, e)
            return
        self.saved += 1


_suspend_lock = threading.Lock()
_suspended = {"depth": 0, "cache": None}


@contextlib.contextmanager
def _suspend_persistent_cache():
    """JAX's opened persistent cache (`jax._src.compilation_cache._cache`) set aside while the
    block runs: with it None, JAX neither reads nor writes the cache (its lookup finds it
    initialized and gets None). Nested and concurrent blocks share one suspension; the last to
    leave puts the cache back. Does nothing where that private attribute is missing."""
    try:
        from jax._src import compilation_cache as cc
    except ImportError:  # pragma: no cover - another JAX layout: the thread's switch alone
        yield
        return
    if not hasattr(cc, "_cache"):  # pragma: no cover
        yield
        return
    with _suspend_lock:
        if _suspended["depth"] == 0:
            _suspended["cache"], cc._cache = cc._cache, None
        _suspended["depth"] += 1
    try:
        yield
    finally:
        with _suspend_lock:
            _suspended["depth"] -= 1
            if _suspended["depth"] == 0:
                if cc._cache is None:
                    cc._cache = _suspended["cache"]
                _suspended["cache"] = None


@dataclasses.dataclass
class _CompileRecord:
    from_cache: bool = False  # set when the fresh_compile block ends


def _device_ids(compiled: jax.stages.Compiled) -> list[int]:
    """The ids of the devices the program runs on, in its device assignment's order (its widest
    argument or result placement): where a reloaded copy is loaded."""
    best: tuple = ()
    for s in jax.tree.leaves((compiled.input_shardings, compiled.output_shardings)):
        assignment = tuple(getattr(s, "_device_assignment", ()) or ())
        if len(assignment) > len(best):
            best = assignment
    return [d.id for d in best]


def open_bundle(config, model_config, dtype, attention, plan, state) -> ProgramBundle | None:
    """The bundle of this start's key under `config.compilation_cache_dir`; None when the
    cache is off (compilation_cache_dir None) or the job spans several processes (each would
    reload programs whose devices belong partly to other processes: not done yet)."""
    if not config.compilation_cache_dir or jax.process_count() > 1:
        return None
    return ProgramBundle(config.compilation_cache_dir,
                         bundle_key_fields(config, model_config, dtype, attention, plan, state))
