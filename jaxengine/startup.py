"""Where a start's time goes: one record per engine (`LLMEngine.startup`), logged when it is ready.

Phases, in order: `imports` (process start to the engine's construction: interpreter, imports,
argument parsing, anything the caller did first), `device_init` (the backend's first device
query), `weight_load` (checkpoint or dummy weights onto the device, tokenizer), `kv_sizing` (the
memory profile, or the size kept in the program bundle), `runner_init` (KV-cache allocation) and
`warmup` (every bucket compiled or loaded ahead; zero under lazy compilation, where a program is
built on its first use). Trace, lowering and backend-compile seconds are summed over the threads
that compiled in parallel, so they can exceed the phase that holds them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import os
import time

from jaxengine.compile_monitor import CompileStats, snapshot

logger = logging.getLogger(__name__)

PHASES = ("imports", "device_init", "weight_load", "kv_sizing", "runner_init", "warmup")


def process_age_s() -> float:
    """Seconds since this process started (its creation time as the kernel reports it)."""
    try:
        import psutil

        return max(time.time() - psutil.Process(os.getpid()).create_time(), 0.0)
    except Exception:  # noqa: BLE001 - no psutil or no /proc: unknown
        return float("nan")


@dataclasses.dataclass
class StartupTimings:
    """One engine start, in seconds unless named otherwise."""

    imports_s: float = 0.0
    device_init_s: float = 0.0
    weight_load_s: float = 0.0
    kv_sizing_s: float = 0.0
    runner_init_s: float = 0.0
    warmup_s: float = 0.0
    total_s: float = 0.0  # the engine's construction (every phase but imports)
    ahead_of_time: bool = True  # every bucket compiled (or loaded) at start-up; False: lazily, on first use
    load_traces: int = 0  # while the weights were loaded (the model's shape inference, random init programs)
    load_compiles: int = 0
    # From the end of weight loading on (KV sizing, KV allocation, the programs):
    traces: int = 0  # functions traced to a jaxpr
    trace_s: float = 0.0
    lower_s: float = 0.0
    xla_compiles: int = 0  # executables XLA compiled
    cache_hits: int = 0  # executables read from the persistent compilation cache
    compile_s: float = 0.0  # backend compile (and persistent-cache reads)
    programs_loaded: int = 0  # executables read from the program bundle
    programs_saved: int = 0
    programs_refused: int = 0  # bundle files that did not match or were unreadable
    bundle_load_s: float = 0.0
    kv_blocks_from_bundle: bool = False  # the KV-cache size came from an earlier start
    bundle_dir: str | None = None
    cache_dir: str | None = None
    _t0: float = dataclasses.field(default=0.0, repr=False)
    _stats0: CompileStats = dataclasses.field(default_factory=CompileStats, repr=False)
    _stats_loaded: CompileStats | None = dataclasses.field(default=None, repr=False)

    @classmethod
    def begin(cls, cache_dir: str | None) -> StartupTimings:
        return cls(imports_s=process_age_s(), cache_dir=cache_dir, _t0=time.perf_counter(), _stats0=snapshot())

    @contextlib.contextmanager
    def phase(self, name: str):
        """Adds the block's wall time to `<name>_s`."""
        assert name in PHASES, name
        t0 = time.perf_counter()
        try:
            yield
        finally:
            setattr(self, f"{name}_s", getattr(self, f"{name}_s") + time.perf_counter() - t0)

    def weights_loaded(self) -> None:
        """Marks the end of weight loading: traces and compiles after it are the engine's programs'."""
        self._stats_loaded = snapshot()
        d = self._stats_loaded - self._stats0
        self.load_traces, self.load_compiles = d.traces, d.backend_compiles

    def finish(self, bundle=None) -> None:
        """Closes the record when the engine is ready: totals, compile counts, the bundle's counts."""
        self.total_s = time.perf_counter() - self._t0
        self.update_compiles(bundle)

    def update_compiles(self, bundle=None) -> None:
        """Trace and compile counts since the start began (lazy compiles later add to them)."""
        d = snapshot() - (self._stats_loaded or self._stats0)
        self.traces, self.trace_s, self.lower_s = d.traces, d.trace_s, d.lower_s
        self.xla_compiles, self.cache_hits, self.compile_s = d.xla_compiles, d.cache_hits, d.backend_s
        if bundle is not None:
            self.programs_loaded, self.programs_saved, self.programs_refused = bundle.loaded, bundle.saved, bundle.refused
            self.bundle_load_s, self.bundle_dir = bundle.load_s, bundle.dir

    def as_dict(self) -> dict[str, object]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if not f.name.startswith("_")}

    def summary(self) -> str:
        """One log line: the phases, then what was traced, compiled and loaded."""
        phases = ", ".join(f"{p} {getattr(self, p + '_s'):.2f}" for p in PHASES)
        mode = "ahead of time" if self.ahead_of_time else "lazily (on first use)"
        return (f"start-up {self.total_s:.2f} s after {self.imports_s:.2f} s of imports [{phases}]; "
                f"{self.load_traces} traces and {self.load_compiles} compiles loading the weights; then "
                f"{self.traces} traces ({self.trace_s:.2f} s), lowering {self.lower_s:.2f} s, "
                f"{self.xla_compiles} XLA compiles + {self.cache_hits} persistent-cache reads "
                f"({self.compile_s:.2f} s), {self.programs_loaded} programs from the bundle "
                f"({self.bundle_load_s:.2f} s, {self.programs_refused} refused); buckets compile {mode}")


_heap_frozen = False  # freeze_startup_heap ran in this process


def freeze_startup_heap() -> int:
    """Moves every object alive once the first engine of this process is ready (the weights'
    tree, compiled programs, JAX's and the tokenizer's caches) into the garbage collector's
    permanent generation, after collecting what is already garbage: the collections that run
    while requests are served then walk only what serving makes, not the start-up heap, and
    their pauses in the step loop stay short. Once per
    process: a later engine (tests, benchmarks) leaves the heap as it is, so objects of engines
    that are released later stay collectable. Returns the objects frozen (0 after the first)."""
    global _heap_frozen
    if _heap_frozen:
        return 0
    _heap_frozen = True
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def table(rows: list[tuple[str, dict[str, object]]]) -> str:
    """A Markdown table of start-up records (as_dict), one column per labelled run."""
    fields = [f"{p}_s" for p in PHASES] + ["total_s", "load_traces", "load_compiles", "traces", "trace_s", "lower_s", "xla_compiles",
                                             "cache_hits", "compile_s", "programs_loaded", "programs_saved",
                                             "programs_refused"]
    extra = [k for k in ("first_output_s", "process_wall_s") if any(k in r for _, r in rows)]
    out = ["| | " + " | ".join(label for label, _ in rows) + " |", "|---" * (len(rows) + 1) + "|"]
    for k in extra + fields:
        cells = []
        for _, r in rows:
            v = r.get(k)
            cells.append("" if v is None else f"{v:.2f}" if isinstance(v, float) else str(v))
        out.append(f"| {k} | " + " | ".join(cells) + " |")
    return "\n".join(out)
