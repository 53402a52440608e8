"""Serving metrics from per-request timestamps, defined as vLLM's `benchmark_serving` defines them.

Per request (times in seconds from the moment the request was sent):
- TTFT: arrival of the first streamed chunk that carries text.
- ITL: the gaps between successive such chunks (one entry per gap; a chunk may hold several tokens).
- E2EL: arrival of the last chunk (the request's latency).
- TPOT: (E2EL - TTFT) / (output tokens - 1), for requests with more than one output token.
Aggregates: request throughput = completed / duration, output tokens/s = output tokens / duration,
goodput = requests meeting every given SLO / duration, where a request meets the TPOT SLO with a
TPOT of 0 when it produced at most one token (as vLLM counts it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from jaxengine.benchmarks.common import percentiles

SLO_KEYS = ("ttft", "tpot", "e2el")


@dataclasses.dataclass
class RequestResult:
    """One request as the client saw it. `chunk_times` are seconds since the request was sent."""

    prompt_len: int
    success: bool = False
    output_tokens: int = 0
    chunk_times: list[float] = dataclasses.field(default_factory=list)
    generated_text: str = ""
    error: str = ""

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] if self.chunk_times else float("nan")

    @property
    def latency(self) -> float:
        return self.chunk_times[-1] if self.chunk_times else float("nan")

    @property
    def itl(self) -> list[float]:
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def tpot(self) -> float | None:
        """None when the request produced at most one token (no decode phase to average)."""
        if self.output_tokens <= 1:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def parse_goodput(items: Sequence[str] | None) -> dict[str, float]:
    """`["ttft:500", "tpot:50"]` -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    out: dict[str, float] = {}
    for item in items or ():
        key, sep, value = item.partition(":")
        if not sep or key not in SLO_KEYS:
            raise ValueError(f"--goodput takes KEY:MS with KEY one of {', '.join(SLO_KEYS)}, got {item!r}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {value!r} is not a number of milliseconds") from None
        if ms < 0:
            raise ValueError(f"--goodput {item!r}: the SLO must be non-negative")
        out[key] = ms
    return out


def compute_metrics(results: Sequence[RequestResult], duration_s: float,
                    goodput_slo_ms: dict[str, float] | None = None,
                    percentile_list: Sequence[float] = (50, 90, 99)) -> dict[str, object]:
    """Aggregate metrics (latencies in ms) over the successful requests of one run."""
    if duration_s <= 0:
        raise ValueError(f"duration must be positive, got {duration_s}")
    ok = [r for r in results if r.success]
    ttfts = [r.ttft for r in ok]
    e2els = [r.latency for r in ok]
    tpots = [r.tpot for r in ok if r.tpot is not None]
    itls = [g for r in ok for g in r.itl]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    good = None
    if goodput_slo_ms:
        good = 0
        for r in ok:
            measured = {"ttft": r.ttft, "tpot": r.tpot if r.tpot is not None else 0.0, "e2el": r.latency}
            if all(measured[k] <= slo / 1e3 for k, slo in goodput_slo_ms.items()):
                good += 1

    def ms(values: list[float]) -> dict[str, float]:
        return {k: v * 1e3 for k, v in percentiles(values, percentile_list).items()}

    return {
        "duration_s": duration_s, "num_requests": len(results), "completed": len(ok),
        "failed": len(results) - len(ok), "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration_s,
        "request_goodput": good / duration_s if good is not None else None, "good_requests": good,
        "goodput_slo_ms": dict(goodput_slo_ms or {}),
        "output_throughput": total_out / duration_s, "total_token_throughput": (total_in + total_out) / duration_s,
        "ttft_ms": ms(ttfts), "tpot_ms": ms(tpots), "itl_ms": ms(itls), "e2el_ms": ms(e2els),
    }


def format_report(m: dict[str, object], title: str = "Serving Benchmark Result") -> str:
    """The summary table `benchmark_serving` prints."""
    lines = [f"{' ' + title + ' ':=^50}",
             f"{'Successful requests:':<40}{m['completed']:<10}",
             f"{'Benchmark duration (s):':<40}{m['duration_s']:<10.2f}",
             f"{'Total input tokens:':<40}{m['total_input_tokens']:<10}",
             f"{'Total generated tokens:':<40}{m['total_output_tokens']:<10}",
             f"{'Request throughput (req/s):':<40}{m['request_throughput']:<10.2f}"]
    if m.get("request_goodput") is not None:
        lines.append(f"{'Request goodput (req/s):':<40}{m['request_goodput']:<10.2f}")
    lines += [f"{'Output token throughput (tok/s):':<40}{m['output_throughput']:<10.2f}",
              f"{'Total Token throughput (tok/s):':<40}{m['total_token_throughput']:<10.2f}"]
    for key, name in (("ttft_ms", "Time to First Token"), ("tpot_ms", "Time per Output Token (excl. 1st token)"),
                      ("itl_ms", "Inter-token Latency"), ("e2el_ms", "End-to-end Latency")):
        short = key.split("_")[0].upper()
        s = m[key]
        lines.append(f"{name:-^50}")
        lines += [f"{f'Mean {short} (ms):':<40}{s['mean']:<10.2f}",
                  f"{f'Median {short} (ms):':<40}{s['median']:<10.2f}",
                  f"{f'P99 {short} (ms):':<40}{s['p99']:<10.2f}"]
    lines.append("=" * 50)
    return "\n".join(lines)
