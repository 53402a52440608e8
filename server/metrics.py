"""Prometheus metrics of one server, with vLLM's metric names under the `jaxengine:` prefix.

Each app gets its own `CollectorRegistry` (never the global one), so several servers can live in
one process (tests do). Two kinds of metrics:
- engine state, read at scrape time from the engine loop's last stats snapshot: running and
  waiting requests, KV-cache usage, and the engine's own cumulative prefix-cache and preemption
  counts (exposed as counters, so they never go backwards between scrapes);
- per-request metrics, recorded on the engine thread as outputs arrive (`OutputObserver`):
  prompt / generation token counters, finished sequences by finish reason, and histograms of
  time to first token, time per output token, end-to-end latency and request sizes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from jaxengine.outputs import RequestOutput

PREFIX = "jaxengine:"
LABELS = ["model_name"]
FINISH_REASONS = ("stop", "length", "abort")

# vLLM's buckets.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0, 7680.0)


def token_buckets(max_model_len: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_model_len (vLLM's 1-2-5 series)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_model_len:
                return tuple(out)
            out.append(float(m * scale))
        scale *= 10


class _EngineStateCollector(Collector):
    """Gauges and counters read from the engine loop's stats snapshot at scrape time."""

    def __init__(self, stats: Callable[[], dict[str, float]], model_name: str):
        self._stats, self._model = stats, model_name

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        gauges = (("num_requests_running", "Number of requests in the running batch.", "num_running"),
                  ("num_requests_waiting", "Number of requests waiting to be scheduled.", "num_waiting"),
                  ("kv_cache_usage_perc", "KV-cache usage: the fraction of usable blocks held by requests "
                   "(1 = 100 percent).", "kv_cache_usage"))
        for name, doc, key in gauges:
            g = GaugeMetricFamily(PREFIX + name, doc, labels=LABELS)
            g.add_metric([self._model], float(s.get(key, 0.0)))
            yield g
        counters = (("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", "prefix_cache_queries"),
                    ("prefix_cache_hits", "Prompt tokens served from the prefix cache.", "prefix_cache_hits"),
                    ("num_preemptions", "Requests preempted (recomputed later) for lack of KV blocks.",
                     "num_preemptions"))
        for name, doc, key in counters:
            c = CounterMetricFamily(PREFIX + name, doc, labels=LABELS)
            c.add_metric([self._model], float(s.get(key, 0.0)))
            yield c

    def describe(self) -> Iterator[Metric]:
        return iter(())  # names are fixed; skip the registry's duplicate check by collecting


class ServerMetrics:
    """The server's metrics registry; an `OutputObserver` for the engine loop."""

    def __init__(self, model_name: str, max_model_len: int, stats: Callable[[], dict[str, float]]):
        self.registry = CollectorRegistry(auto_describe=False)
        r, labels = self.registry, LABELS

        def counter(name: str, doc: str, extra: list[str] | None = None) -> Counter:
            return Counter(PREFIX + name, doc, labels + (extra or []), registry=r)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=r)

        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests that started generating.") \
            .labels(model_name)
        self.generation_tokens = counter("generation_tokens", "Generated tokens.").labels(model_name)
        success = counter("request_success", "Finished sequences by finish reason.", ["finished_reason"])
        self.request_success = {reason: success.labels(model_name, reason) for reason in FINISH_REASONS}
        self._success = success
        self._model = model_name
        self.ttft = histogram("time_to_first_token_seconds", "Time from arrival to the first token.",
                              TTFT_BUCKETS).labels(model_name)
        self.tpot = histogram("time_per_output_token_seconds", "Mean time per output token after the "
                              "first, per request.", TPOT_BUCKETS).labels(model_name)
        self.e2e = histogram("e2e_request_latency_seconds", "Time from arrival to the last output.",
                             E2E_BUCKETS).labels(model_name)
        sizes = token_buckets(max_model_len)
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Prompt tokens per finished request.",
                                               sizes).labels(model_name)
        self.request_generation_tokens = histogram("request_generation_tokens", "Generated tokens per "
                                                   "finished request (all n sequences).", sizes).labels(model_name)
        r.register(_EngineStateCollector(stats, model_name))

    # -- OutputObserver (engine thread) ---------------------------------------------------------
    def on_output(self, output: RequestOutput, new_tokens: int, first: bool) -> None:
        if first:
            self.prompt_tokens.inc(len(output.prompt_token_ids))
        if new_tokens > 0:
            self.generation_tokens.inc(new_tokens)

    def on_finished(self, output: RequestOutput) -> None:
        for c in output.outputs:
            reason = c.finish_reason or "abort"
            counter = self.request_success.get(reason)
            if counter is None:
                counter = self.request_success[reason] = self._success.labels(self._model, reason)
            counter.inc()
        m = output.metrics
        if m is None:  # aborted before its first output: no timings to report
            return
        longest = max((len(c.token_ids) for c in output.outputs), default=0)
        end = m.finished_time or m.last_token_time
        if m.first_token_time is not None:
            self.ttft.observe(m.first_token_time - m.arrival_time)
            if longest > 1 and m.last_token_time is not None:
                self.tpot.observe((m.last_token_time - m.first_token_time) / (longest - 1))
        if end is not None:
            self.e2e.observe(end - m.arrival_time)
        self.request_prompt_tokens.observe(len(output.prompt_token_ids))
        self.request_generation_tokens.observe(sum(len(c.token_ids) for c in output.outputs))

    # -- exposition ----------------------------------------------------------------------------------
    def render(self) -> bytes:
        return generate_latest(self.registry)

    content_type = CONTENT_TYPE_LATEST
