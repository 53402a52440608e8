"""Prometheus metrics of one server, with vLLM's metric names under the `jaxengine:` prefix.

Each app gets its own `CollectorRegistry` (never the global one), so several servers can live in
one process (tests do). Three kinds of metrics:
- engine state, read at scrape time from the engine loop's last stats snapshot: running and
  waiting requests, KV-cache usage, and the engine's own cumulative prefix-cache and preemption
  counts (exposed as counters, so they never go backwards between scrapes);
- per step, recorded on the engine thread after each `engine.step()` (`on_step`): the tokens the
  step scheduled (vLLM's iteration tokens);
- per request, recorded on the engine thread as outputs arrive (`on_output`, `on_finished`):
  prompt / generation token counters, finished sequences by finish reason, inter-token latency,
  and, once a request finishes, histograms of its phases (queue, prefill, decode, inference), time
  to first token, time per output token, end-to-end latency and sizes.

Every recording is O(1), so the loop never waits. What arrives once per request per step (the
token counters and the inter-token latency) is added to per-step totals and lists, and recorded
once per step at `on_step` (the latencies binned in one numpy pass, `StepHistogram`): one
prometheus_client observation takes two locks, and at 256 streams that was 256 a step on the
engine thread. A scrape shows them as of the last step.

With `vllm_names=True` every family is also exposed under vLLM's own name (`vllm:` prefix, same
`model_name` label, same values: `WithVllmNames` renames at scrape time), so dashboards built for
vLLM work unchanged. `VLLM_NAMES` is the mapping; where the two projects name a metric differently
(or vLLM renamed one and older dashboards use the old name) it lists every vLLM name.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence

import numpy as np
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from jaxengine.outputs import RequestOutput

PREFIX = "jaxengine:"
VLLM_PREFIX = "vllm:"
LABELS = ["model_name"]
FINISH_REASONS = ("stop", "length", "abort")

# vLLM's buckets.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0, 7680.0)  # also the request phases' (queue, prefill, ...)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)

# jaxengine family name (without the prefix; counters without `_total`) -> vLLM's names for the
# same data. Several names: vLLM's current one first, then older ones its dashboards still use.
# jaxengine's time_per_output_token_seconds is the mean per request, which vLLM calls
# request_time_per_output_token_seconds; vLLM's time_per_output_token_seconds (older versions)
# holds the per-step intervals that both now call inter_token_latency_seconds.
VLLM_NAMES: dict[str, tuple[str, ...]] = {
    "num_requests_running": ("num_requests_running",),
    "num_requests_waiting": ("num_requests_waiting",),
    "kv_cache_usage_perc": ("kv_cache_usage_perc", "gpu_cache_usage_perc"),
    "prefix_cache_queries": ("prefix_cache_queries", "gpu_prefix_cache_queries"),
    "prefix_cache_hits": ("prefix_cache_hits", "gpu_prefix_cache_hits"),
    "num_preemptions": ("num_preemptions",),
    "spec_decode_num_drafts": ("spec_decode_num_drafts",),
    "spec_decode_num_draft_tokens": ("spec_decode_num_draft_tokens",),
    "spec_decode_num_accepted_tokens": ("spec_decode_num_accepted_tokens",),
    "spec_decode_num_accepted_tokens_per_pos": ("spec_decode_num_accepted_tokens_per_pos",),
    "prompt_tokens": ("prompt_tokens",),
    "generation_tokens": ("generation_tokens",),
    "request_success": ("request_success",),
    "iteration_tokens_total": ("iteration_tokens_total",),
    "time_to_first_token_seconds": ("time_to_first_token_seconds",),
    "inter_token_latency_seconds": ("inter_token_latency_seconds", "time_per_output_token_seconds"),
    "time_per_output_token_seconds": ("request_time_per_output_token_seconds",),
    "e2e_request_latency_seconds": ("e2e_request_latency_seconds",),
    "request_queue_time_seconds": ("request_queue_time_seconds",),
    "request_prefill_time_seconds": ("request_prefill_time_seconds",),
    "request_decode_time_seconds": ("request_decode_time_seconds",),
    "request_inference_time_seconds": ("request_inference_time_seconds",),
    "request_prompt_tokens": ("request_prompt_tokens",),
    "request_generation_tokens": ("request_generation_tokens",),
}


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
        if "spec_num_drafts" in s:  # speculative decoding is on (vLLM's counters)
            counters += (("spec_decode_num_drafts", "Steps' rows that carried draft tokens.", "spec_num_drafts"),
                         ("spec_decode_num_draft_tokens", "Draft tokens proposed and verified.",
                          "spec_num_draft_tokens"),
                         ("spec_decode_num_accepted_tokens", "Draft tokens accepted.", "spec_num_accepted_tokens"))
        for name, doc, key in counters:
            c = CounterMetricFamily(PREFIX + name, doc, labels=LABELS)
            c.add_metric([self._model], float(s.get(key, 0.0)))
            yield c
        if "spec_accepted_per_pos" in s:
            c = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                    "Draft tokens accepted, by their position among a row's drafts.",
                                    labels=LABELS + ["position"])
            for pos, n in enumerate(s["spec_accepted_per_pos"]):
                c.add_metric([self._model, str(pos)], float(n))
            yield c

    def describe(self) -> Iterator[Metric]:
        return iter(())  # names are fixed; skip the registry's duplicate check by collecting


class StepHistogram(Collector):
    """A histogram (one `model_name` label) fed a step's observations at once: `observe_many`
    bins them in one numpy pass under one lock. Exposed as prometheus_client's own histograms are
    (cumulative `le` buckets, `_count`, `_sum`)."""

    def __init__(self, name: str, documentation: str, model_name: str, buckets: Sequence[float],
                 registry: CollectorRegistry):
        self._name, self._doc, self._model = name, documentation, model_name
        self._bounds = np.asarray(buckets, np.float64)
        self._les = [floatToGoString(b) for b in buckets] + ["+Inf"]
        self._counts = np.zeros(len(buckets) + 1, np.int64)
        self._sum = 0.0
        self._lock = threading.Lock()  # observations on the engine thread, scrapes on the event loop
        registry.register(self)

    def observe_many(self, values: Sequence[float]) -> None:
        v = np.asarray(values, np.float64)
        # the first bound >= the value: Prometheus buckets hold values <= their `le`
        binned = np.bincount(np.searchsorted(self._bounds, v, side="left"), minlength=len(self._counts))
        with self._lock:
            self._counts += binned
            self._sum += float(v.sum())

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            cumulative, total = np.cumsum(self._counts), self._sum
        family = HistogramMetricFamily(self._name, self._doc, labels=LABELS)
        family.add_metric([self._model], [(le, float(c)) for le, c in zip(self._les, cumulative)], total)
        yield family

    def describe(self) -> Iterator[Metric]:
        return iter(())


class WithVllmNames(Collector):
    """A registry's families as they are, each followed by copies under its `VLLM_NAMES`.

    One pass over the registry, so both names of a metric show the same value in a scrape.
    """

    def __init__(self, source: CollectorRegistry):
        self._source = source

    def collect(self) -> Iterator[Metric]:
        for family in self._source.collect():
            yield family
            for name in VLLM_NAMES.get(family.name.removeprefix(PREFIX), ()):
                yield _renamed(family, VLLM_PREFIX + name)

    def describe(self) -> Iterator[Metric]:
        return iter(())


def _renamed(family: Metric, name: str) -> Metric:
    """`family` under another name; sample names keep their suffixes (`_total`, `_bucket`, ...)."""
    out = Metric(name, family.documentation, family.type, family.unit)
    cut = len(family.name)
    out.samples = [s._replace(name=name + s.name[cut:]) for s in family.samples]
    return out


class ServerMetrics:
    """The server's metrics registry; an `OutputObserver` for the engine loop, a `PoolingObserver`
    for the pooling worker (a pooling server's step and token-latency families stay empty)."""

    def __init__(self, model_name: str, max_model_len: int, stats: Callable[[], dict[str, float]],
                 vllm_names: bool = False):
        self.registry = CollectorRegistry(auto_describe=False)  # the `jaxengine:` families
        self.exposed: Collector = WithVllmNames(self.registry) if vllm_names \
            else self.registry  # what /metrics renders
        r, labels = self.registry, LABELS

        def counter(name: str, doc: str, extra: list[str] | None = None) -> Counter:
            return Counter(PREFIX + name, doc, labels + (extra or []), registry=r)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=r).labels(model_name)

        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests that started generating.") \
            .labels(model_name)
        self.generation_tokens = counter("generation_tokens", "Generated tokens.").labels(model_name)
        success = counter("request_success", "Finished sequences by finish reason.", ["finished_reason"])
        self.request_success = {reason: success.labels(model_name, reason) for reason in FINISH_REASONS}
        self._success = success
        self._model = model_name
        self.iteration_tokens = histogram("iteration_tokens_total", "Tokens (prefill + decode) scheduled per "
                                          "engine step.", ITERATION_TOKEN_BUCKETS)
        self.ttft = histogram("time_to_first_token_seconds", "Time from arrival to the first token.", TTFT_BUCKETS)
        self.itl = StepHistogram(PREFIX + "inter_token_latency_seconds", "Time between a request's successive "
                                 "outputs with new tokens (one observation per request per step).",
                                 model_name, TPOT_BUCKETS, r)
        self.tpot = histogram("time_per_output_token_seconds", "Mean time per output token after the "
                              "first, per request.", TPOT_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Time from arrival to the last output.", E2E_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Time from arrival to first being scheduled "
                                    "(waiting).", E2E_BUCKETS)
        self.prefill_time = histogram("request_prefill_time_seconds", "Time from first being scheduled to the "
                                      "first token (prefill).", E2E_BUCKETS)
        self.decode_time = histogram("request_decode_time_seconds", "Time from the first token to the last "
                                     "(decode).", E2E_BUCKETS)
        self.inference_time = histogram("request_inference_time_seconds", "Time from first being scheduled to "
                                        "the last token (prefill + decode).", E2E_BUCKETS)
        sizes = token_buckets(max_model_len)
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Prompt tokens per finished request.",
                                               sizes)
        self.request_generation_tokens = histogram("request_generation_tokens", "Generated tokens per "
                                                   "finished request (all n sequences).", sizes)
        # Engine thread only: request id -> the time of its last output with new tokens; this
        # step's prompt and generated tokens and inter-token latencies, recorded at on_step.
        self._last_token_time: dict[str, float] = {}
        self._step_prompt_tokens = 0
        self._step_generated = 0
        self._step_itl: list[float] = []
        r.register(_EngineStateCollector(stats, model_name))

    # -- OutputObserver (engine thread) ---------------------------------------------------------
    def on_step(self, stats: dict[str, float]) -> None:
        tokens = stats.get("step_tokens", 0)
        if tokens > 0:  # a step that only collected the previous one's tokens scheduled nothing
            self.iteration_tokens.observe(tokens)
        if self._step_prompt_tokens:
            self.prompt_tokens.inc(self._step_prompt_tokens)
            self._step_prompt_tokens = 0
        if self._step_generated:
            self.generation_tokens.inc(self._step_generated)
            self._step_generated = 0
        if self._step_itl:
            self.itl.observe_many(self._step_itl)
            self._step_itl = []

    def on_output(self, output: RequestOutput, new_tokens: int, first: bool) -> None:
        if first:
            self._step_prompt_tokens += len(output.prompt_token_ids)
        if new_tokens > 0:
            self._step_generated += new_tokens
            m = output.metrics
            if m is not None and m.last_token_time is not None:
                previous = self._last_token_time.get(output.request_id)
                if previous is not None:
                    self._step_itl.append(m.last_token_time - previous)
                self._last_token_time[output.request_id] = m.last_token_time

    def on_finished(self, output: RequestOutput) -> None:
        for c in output.outputs:
            reason = c.finish_reason or "abort"
            counter = self.request_success.get(reason)
            if counter is None:
                counter = self.request_success[reason] = self._success.labels(self._model, reason)
            counter.inc()
        self._last_token_time.pop(output.request_id, None)
        m = output.metrics
        if m is None:  # aborted before its first output: no timings to report
            return
        longest = max((len(c.token_ids) for c in output.outputs), default=0)
        end = m.finished_time or m.last_token_time
        scheduled, first, last = m.first_scheduled_time, m.first_token_time, m.last_token_time
        if first is not None:
            self.ttft.observe(first - m.arrival_time)
            if longest > 1 and last is not None:
                self.tpot.observe((last - first) / (longest - 1))
        if end is not None:
            self.e2e.observe(end - m.arrival_time)
        # The phases, as vLLM splits them: queue + prefill + decode = arrival to last token.
        if scheduled is not None:
            self.queue_time.observe(scheduled - m.arrival_time)
            if first is not None and last is not None:
                self.prefill_time.observe(first - scheduled)
                self.decode_time.observe(last - first)
                self.inference_time.observe(last - scheduled)
        self.request_prompt_tokens.observe(len(output.prompt_token_ids))
        self.request_generation_tokens.observe(sum(len(c.token_ids) for c in output.outputs))

    # -- PoolingObserver (the pooling worker thread) ---------------------------------------------------
    def on_pooled(self, num_prompts: int, prompt_tokens: int, seconds: float) -> None:
        """A pooling request finished: its prompts count as finished sequences ("stop", as in
        vLLM), their tokens as prompt tokens, its run time as its end-to-end latency."""
        self.prompt_tokens.inc(prompt_tokens)
        self.request_success["stop"].inc(num_prompts)
        self.e2e.observe(seconds)

    # -- exposition ----------------------------------------------------------------------------------
    def render(self) -> bytes:
        return generate_latest(self.exposed)

    content_type = CONTENT_TYPE_LATEST
