"""Test-session defaults and shared fixtures.

No test may reach the model hub (CI machines are offline). Tests run on the CPU; compiled
programs are shared across engine instances through a session-wide compilation cache.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def smollm2_tokenizer_dir(tmp_path_factory):
    """The SmolLM2 tokenizer (built once from the GGUF), saved as a plain HF tokenizer folder."""
    from jaxengine.default_model import default_model_path
    from jaxengine.models.checkpoint import open_checkpoint

    path = str(tmp_path_factory.mktemp("smollm2_tokenizer"))
    open_checkpoint(default_model_path()).load_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def xla_cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("xla_cache"))


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory, smollm2_tokenizer_dir):
    """family -> folder with a tiny random checkpoint of that family and the SmolLM2 tokenizer."""
    import transformers

    from tests.tiny_checkpoints import make_checkpoint

    made: dict[str, str] = {}
    tok = transformers.AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)

    def get(family: str) -> str:
        if family not in made:
            made[family] = make_checkpoint(family, str(tmp_path_factory.mktemp(family)), tokenizer=tok)
        return made[family]

    return get


@pytest.fixture(scope="session")
def smollm2_reference():
    """transformers' SmolLM2-135M-Instruct from the embedded GGUF (float32, eval mode), loaded once
    for the real-model tests that compare against it (read only: forward and generate)."""
    import torch
    import transformers

    from jaxengine.default_model import DEFAULT_MODEL_FILE, default_model_path
    from tests.hf_gguf import cached_gguf_name_map

    path = default_model_path()
    with cached_gguf_name_map():  # the same model, loaded faster
        return transformers.AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path), gguf_file=DEFAULT_MODEL_FILE, dtype=torch.float32).eval()


@pytest.fixture(scope="session", autouse=True)
def _reuse_identical_engine_programs():
    """Engines of one test process share the programs whose lowering is identical.

    Each engine compiles its programs (forward, samplers, prompt logprobs, ...) through
    `ModelRunner._compile_program`; its program bundle is keyed by the whole engine and model config,
    so a program that does not depend on what differs between two engines (a sampler depends on the
    vocabulary and row counts only, not on the model family; a speculative engine's forward is
    the plain engine's) is compiled again by every engine. Here, inside `_compile_program` only, a
    lowering whose StableHLO text, shardings, layouts, avals, argument info and pytrees all equal an earlier
    one's gets that earlier executable instead of a fresh XLA compile: the trace and lowering still
    run (so a monkeypatched function still takes effect), every program that differs in any way
    still compiles, and the bundle still saves and loads every program as before. Skipped for
    programs with host callbacks or effects, and for executables read from JAX's persistent cache
    (the bundle does not keep those; see `ProgramBundle.fresh_compile`). Worker subprocesses (TP,
    multi-host, `bench startup`) do not load this file and compile as usual."""
    import collections
    import hashlib
    import threading

    import jax

    from jaxengine import model_runner
    from jaxengine.compile_monitor import thread_cache_hits

    local = threading.local()
    lock = threading.Lock()
    memo: collections.OrderedDict = collections.OrderedDict()
    orig_compile = jax.stages.Lowered.compile
    orig_compile_program = model_runner.ModelRunner._compile_program

    def key_of(lowered):
        args = getattr(getattr(lowered, "_lowering", None), "compile_args", None)
        if not isinstance(args, dict) or args.get("host_callbacks") or args.get("ordered_effects") \
                or args.get("unordered_effects") or args.get("keepalive"):
            return None
        parts = [repr(args.get(k)) for k in ("in_shardings", "out_shardings", "in_layouts", "out_layouts",
                                              "global_in_avals", "global_out_avals", "all_args_info", "kept_var_idx",
                                              "tuple_args", "num_devices", "committed", "mut", "context_mesh")]
        parts += [str(args.get("backend")), str(lowered.in_tree), str(lowered.out_tree), lowered.as_text()]
        return hashlib.sha256("\x00".join(parts).encode()).hexdigest()

    def compile_(self, compiler_options=None, **kw):
        if not getattr(local, "active", False) or compiler_options or kw:  # options set: compiled as asked
            return orig_compile(self, compiler_options, **kw)
        key = key_of(self)
        if key is not None:
            with lock:
                hit = memo.get(key)
                if hit is not None:
                    memo.move_to_end(key)
                    return hit
        hits = thread_cache_hits()
        compiled = orig_compile(self)
        if key is not None and thread_cache_hits() == hits:
            with lock:
                memo[key] = compiled
                while len(memo) > 256:  # a bound on the executables held
                    memo.popitem(last=False)
        return compiled

    def compile_program(self, key, lower_fn):
        local.active = True  # the program's lowering and its compile run in this call, on this thread
        try:
            return orig_compile_program(self, key, lower_fn)
        finally:
            local.active = False

    jax.stages.Lowered.compile = compile_
    model_runner.ModelRunner._compile_program = compile_program
    try:
        yield
    finally:
        jax.stages.Lowered.compile = orig_compile
        model_runner.ModelRunner._compile_program = orig_compile_program
