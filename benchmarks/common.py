"""Shared pieces of the `jaxengine bench` commands: the environment record, datasets, JSON output.

Every result file carries the device, the library versions and the full configuration, so a
number can always be traced back to what produced it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import platform
import time
from collections.abc import Sequence

import numpy as np

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class SampleRequest:
    """One benchmark request: a prompt (token ids, and text when the dataset has it) and how many
    tokens to generate."""

    prompt_token_ids: list[int]
    output_len: int
    prompt: str | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


def environment() -> dict[str, object]:
    """Device and versions of this process (JAX is imported here, not at module load)."""
    import jax

    import jaxengine

    dev = jax.devices()[0]
    info: dict[str, object] = {
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "backend": jax.default_backend(), "device_kind": dev.device_kind, "num_devices": len(jax.devices()),
        "host": platform.node(), "cpu_count": os.cpu_count(), "python": platform.python_version(),
        "jax": jax.__version__, "jaxengine": getattr(jaxengine, "__version__", "unknown"),
        # the GPU allocator and XLA flags the figures ran under (the engine picks the VMM allocator
        # and SKIP_TEMP command buffers on one GPU: jaxengine/device_memory.choose_launch_allocator)
        "allocator": os.environ.get("XLA_PYTHON_CLIENT_ALLOCATOR", "default"),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }
    try:
        import jaxlib
        info["jaxlib"] = jaxlib.__version__
    except ImportError:  # pragma: no cover
        pass
    return info


def args_dict(args: argparse.Namespace) -> dict[str, object]:
    """The parsed flags as JSON-safe values (the callable `func` dropped)."""
    out = {}
    for k, v in vars(args).items():
        if k == "func" or callable(v):
            continue
        out[k] = v if isinstance(v, (int, float, str, bool, type(None), list, dict)) else repr(v)
    return out


def write_json(path: str, payload: dict) -> str:
    """Writes `payload` (non-finite floats as null) to `path`, creating folders; returns the path."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(_finite(payload), f, indent=2, default=str)
    logger.info("wrote %s", path)
    return path


def _finite(x: object) -> object:
    if isinstance(x, float) and not np.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def random_requests(num_prompts: int, input_len: int, output_len: int, range_ratio: float,
                    vocab_size: int, seed: int = 0) -> list[SampleRequest]:
    """Random token prompts as vLLM's random dataset draws them: lengths uniform in
    [len * (1 - range_ratio), len * (1 + range_ratio)], token ids uniform over the vocabulary."""
    if num_prompts <= 0 or input_len <= 0 or output_len <= 0:
        raise ValueError(f"num_prompts, input_len and output_len must be positive, got "
                         f"{num_prompts}, {input_len}, {output_len}")
    if not 0 <= range_ratio < 1:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    rng = np.random.default_rng(seed)

    def lengths(n: int) -> np.ndarray:
        lo, hi = max(1, int(n * (1 - range_ratio))), max(1, int(n * (1 + range_ratio)))
        return rng.integers(lo, hi + 1, size=num_prompts)

    ins, outs = lengths(input_len), lengths(output_len)
    # Ids from 10 up: small ids are often special tokens (bos/eos/pad) in real vocabularies.
    low = min(10, vocab_size - 1)
    return [SampleRequest(rng.integers(low, vocab_size, size=int(i)).tolist(), int(o)) for i, o in zip(ins, outs)]


def load_sharegpt(path: str, num_prompts: int, tokenizer, output_len: int | None = None,
                  max_len: int | None = None, seed: int = 0) -> list[SampleRequest]:
    """ShareGPT-format conversations (a JSON list, or JSONL with one conversation a line): the first
    turn is the prompt, the second turn's token count is the output length (unless `output_len`).
    Like vLLM, conversations with fewer than two turns, prompts or outputs under 4 tokens, or a
    total over `max_len` are skipped; the rest are shuffled with `seed`."""
    if tokenizer is None:
        raise ValueError("a ShareGPT dataset needs a tokenizer: use a model with one, or pass --tokenizer")
    with open(path) as f:
        text = f.read()
    try:
        data = json.loads(text)
        if isinstance(data, dict):
            data = [data]
    except json.JSONDecodeError:
        data = [json.loads(line) for line in text.splitlines() if line.strip()]
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(data))
    out: list[SampleRequest] = []
    for i in order:
        conv = data[i].get("conversations") or data[i].get("conversation") or []
        if len(conv) < 2:
            continue
        prompt = conv[0].get("value", conv[0].get("content", ""))
        completion = conv[1].get("value", conv[1].get("content", ""))
        ids = list(tokenizer.encode(prompt))
        n_out = output_len or len(tokenizer.encode(completion))
        if len(ids) < 4 or n_out < 4 or (max_len is not None and len(ids) + n_out > max_len):
            continue
        out.append(SampleRequest(ids, int(n_out), prompt))
        if len(out) == num_prompts:
            break
    if not out:
        raise ValueError(f"no usable conversation in {path} (need 2+ turns, 4+ tokens each, within max_model_len)")
    if len(out) < num_prompts:
        logger.warning("%s has only %d usable conversations (asked for %d)", path, len(out), num_prompts)
    return out


def percentiles(values: Sequence[float], ps: Sequence[float] = (50, 90, 99)) -> dict[str, float]:
    """mean, median, std and the given percentiles (NaN for an empty list)."""
    if len(values) == 0:
        out = {"mean": float("nan"), "median": float("nan"), "std": float("nan")}
        out.update({f"p{p:g}": float("nan") for p in ps})
        return out
    a = np.asarray(values, dtype=np.float64)
    out = {"mean": float(a.mean()), "median": float(np.median(a)), "std": float(a.std())}
    out.update({f"p{p:g}": float(np.percentile(a, p)) for p in ps})
    return out


def default_out(args: argparse.Namespace, kind: str) -> str:
    """Output file: --output-json, else benchmarks/results-like name in the working directory."""
    if getattr(args, "output_json", None):
        return args.output_json
    model = os.path.basename(str(getattr(args, "model", None) or "default")).replace("/", "_")
    return os.path.join(".", f"bench_{kind}_{model}_{time.strftime('%Y%m%d-%H%M%S')}.json")


def make_llm(args: argparse.Namespace, **overrides):
    """An `LLM` from the engine flags (`--load-format dummy` with a preset for real shapes).
    Every bucket is compiled at start-up unless --no-warmup is given, on CPU too: a compile inside
    the timed part would be measured as serving time."""
    from jaxengine.arg_utils import engine_kwargs
    from jaxengine.llm import LLM

    kw = engine_kwargs(args)
    if kw.get("warmup") is None and not kw.get("enforce_eager"):
        kw["warmup"] = True
    kw.update(overrides)
    return LLM(model=args.model, **kw)


def weight_bytes(llm) -> int:
    import jax
    return int(sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(llm.llm_engine.runner.state)))


def decode_weight_bytes(llm) -> int:
    """Weight bytes one decode step reads: every weight, except an input embedding table that is
    not also the output projection (it is gathered, a row per token, not read whole)."""
    import numpy as np
    eng = llm.llm_engine
    mc = eng.model_config
    total = weight_bytes(llm)
    if not mc.tie_word_embeddings:
        total -= mc.vocab_size * mc.hidden_size * np.dtype(eng.runner.dtype).itemsize
    return total
