"""`jaxengine bench serve`: an HTTP client against a running OpenAI-compatible server.

Requests stream from `/v1/completions` (prompt as token ids, or text when a tokenizer is given)
or `/v1/chat/completions` (text). They are sent on a Poisson schedule (`--request-rate`, requests
per second; inf sends all at once; `--burstiness` != 1 draws gamma intervals as vLLM does) and
optionally capped at `--max-concurrency` in flight. Output tokens are the server's own count
(`stream_options.include_usage`), else the number of chunks. A completions chunk counts as an
arrival even when its text is empty (a server without a tokenizer streams token-only chunks; vLLM's
client counts them the same way); a chat chunk counts when it carries content. Metric definitions:
`benchmarks/serving_metrics.py`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import time

import numpy as np

from jaxengine.benchmarks.common import (SampleRequest, args_dict, environment, load_sharegpt, random_requests,
                                         write_json)
from jaxengine.benchmarks.serving_metrics import RequestResult, compute_metrics, format_report, parse_goodput

logger = logging.getLogger(__name__)

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


def arrival_offsets(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send times (seconds from the start) of n requests: gamma intervals with mean 1/rate (Poisson
    for burstiness 1); all zero for an infinite rate."""
    if rate <= 0:
        raise ValueError(f"--request-rate must be positive (or inf), got {rate}")
    if burstiness <= 0:
        raise ValueError(f"--burstiness must be positive, got {burstiness}")
    if np.isinf(rate):
        return [0.0] * n
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(burstiness, 1.0 / (rate * burstiness), size=n)
    gaps[0] = 0.0
    return np.cumsum(gaps).tolist()


def _payload(req: SampleRequest, endpoint: str, model: str, ignore_eos: bool) -> dict[str, object]:
    common = {"model": model, "max_tokens": req.output_len, "temperature": 0.0, "stream": True,
              "stream_options": {"include_usage": True}, "ignore_eos": ignore_eos}
    if endpoint == "chat":
        if req.prompt is None:
            raise ValueError("the chat endpoint needs text prompts: pass --tokenizer (random) or a ShareGPT --dataset")
        return {**common, "messages": [{"role": "user", "content": req.prompt}]}
    return {**common, "prompt": req.prompt if req.prompt is not None else req.prompt_token_ids}


async def send_request(session, url: str, body: dict, prompt_len: int, headers: dict[str, str]) -> RequestResult:
    """One streamed request (an aiohttp session); chunk arrival times relative to the send."""
    res = RequestResult(prompt_len=prompt_len)
    chunks = 0
    st = time.perf_counter()
    try:
        async with session.post(url, json=body, headers=headers) as resp:
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.text(errors='replace'))[:200]}"
                return res
            async for raw in resp.content:  # one line of the SSE stream at a time
                if not raw.startswith(b"data:"):
                    continue
                data = raw[5:].strip()
                if data == b"[DONE]":
                    break
                msg = json.loads(data)
                if "error" in msg:
                    res.error = str(msg["error"])
                    return res
                for ch in msg.get("choices") or []:
                    if "text" in ch:  # completions: each chunk carries new tokens, its text may be empty
                        text, arrived = ch.get("text") or "", True  # (no tokenizer, special tokens; vLLM counts it)
                    else:
                        text = (ch.get("delta") or {}).get("content")
                        arrived = bool(text)
                    if arrived:
                        res.chunk_times.append(time.perf_counter() - st)
                        res.generated_text += text
                        chunks += 1
                usage = msg.get("usage")
                if usage and usage.get("completion_tokens") is not None:
                    res.output_tokens = int(usage["completion_tokens"])
        res.output_tokens = res.output_tokens or chunks
        res.success = bool(res.chunk_times)
        if not res.success:
            res.error = "no text came back"
    except Exception as e:  # noqa: BLE001 - a failed request is a result, not a crash
        res.error = f"{type(e).__name__}: {e}"
    return res


async def run_serve(base_url: str, endpoint: str, model: str, requests: list[SampleRequest], rate: float,
                    burstiness: float, max_concurrency: int | None, ignore_eos: bool = True,
                    api_key: str | None = None, seed: int = 0, timeout_s: float = 600.0
                    ) -> tuple[list[RequestResult], float]:
    """Sends every request on schedule; returns the results (input order) and the run's seconds.

    The client is aiohttp, as vLLM's: at rate inf with hundreds of streams the client reads a
    chunk per stream per engine step, and a client that costs more per chunk than the server
    becomes what the run measures (benchmarks/results/serve_vs_offline_cpu.md)."""
    import aiohttp

    url = base_url.rstrip("/") + ENDPOINTS[endpoint]
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    offsets = arrival_offsets(len(requests), rate, burstiness, seed)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    connector = aiohttp.TCPConnector(limit=max_concurrency or 0)  # 0: no cap on open connections
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=timeout_s),
                                     read_bufsize=1 << 20) as session:  # a chunk with logprobs is one long line
        start = time.perf_counter()

        async def one(req: SampleRequest, at: float) -> RequestResult:
            delay = start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            body = _payload(req, endpoint, model, ignore_eos)
            if sem is None:
                return await send_request(session, url, body, req.prompt_len, headers)
            async with sem:
                return await send_request(session, url, body, req.prompt_len, headers)

        results = await asyncio.gather(*(one(r, at) for r, at in zip(requests, offsets)))
        duration = time.perf_counter() - start
    return list(results), duration


def _first_model(base_url: str, api_key: str | None) -> str:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=30)
        r.raise_for_status()
        return r.json()["data"][0]["id"]
    except httpx.HTTPError as e:
        raise ValueError(f"cannot list the models of the server at {base_url} ({e}); is it running? "
                         f"(or pass --served-model-name)") from None


def cmd_serve(args: argparse.Namespace) -> int:
    slo = parse_goodput(args.goodput)
    if args.max_concurrency is not None and args.max_concurrency <= 0:
        raise ValueError(f"--max-concurrency must be positive, got {args.max_concurrency}")
    api_key = args.api_key or os.environ.get("JAXENGINE_API_KEY")
    tok = None
    if args.tokenizer:
        from jaxengine.models.checkpoint import load_hf_tokenizer
        tok = load_hf_tokenizer(args.tokenizer)
    if args.dataset:
        reqs = load_sharegpt(args.dataset, args.num_prompts, tok, args.output_len, None, args.dataset_seed)
    else:
        vocab = len(tok) if tok is not None else args.vocab_size
        reqs = random_requests(args.num_prompts, args.input_len, args.output_len or 128, args.range_ratio,
                               vocab, args.dataset_seed)
        if tok is not None:  # text prompts, re-tokenised lengths as the server will see them
            texts = [tok.decode(r.prompt_token_ids) for r in reqs]
            reqs = [SampleRequest(list(tok.encode(t, add_special_tokens=False)), r.output_len, t)
                    for t, r in zip(texts, reqs)]
    model = args.served_model_name or _first_model(args.base_url, api_key)
    results, duration = asyncio.run(run_serve(args.base_url, args.endpoint, model, reqs, args.request_rate,
                                              args.burstiness, args.max_concurrency, not args.no_ignore_eos,
                                              api_key, args.dataset_seed))
    metrics = compute_metrics(results, duration, slo)
    failed = [r.error for r in results if not r.success]
    payload = {"benchmark": "serve", "environment": _client_env(), "args": args_dict(args), "model": model,
               "results": metrics, "errors": failed[:20],
               "requests": [{"prompt_len": r.prompt_len, "output_tokens": r.output_tokens, "success": r.success,
                             "ttft_s": r.ttft if r.success else None, "e2el_s": r.latency if r.success else None,
                             "itl_s": r.itl} for r in results]}
    stamp = time.strftime("%Y%m%d-%H%M%S")
    name = f"bench_serve_{model.replace('/', '_')}_{stamp}.json"
    out = args.output_json or name
    path = write_json(out, payload)
    print(f"Traffic request rate: {args.request_rate}\nMaximum request concurrency: {args.max_concurrency}")
    print(format_report(metrics))
    if failed:
        print(f"{len(failed)} requests failed; first error: {failed[0]}")
    print(f"results: {path}")
    return 0 if not failed else 1


def _client_env() -> dict[str, object]:
    """The client's environment; the server's device is the server's (see its logs / /metrics)."""
    env = environment()
    env["note"] = "device fields describe the client process; the server may run elsewhere"
    return env


def add_parser(sub) -> None:
    from jaxengine.benchmarks.throughput import add_dataset_args

    p = sub.add_parser("serve", help="HTTP client benchmark against a running server (TTFT, TPOT, ITL, goodput)")
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server's address")
    p.add_argument("--endpoint", choices=sorted(ENDPOINTS), default="completions",
                   help="completions: /v1/completions; chat: /v1/chat/completions")
    p.add_argument("--served-model-name", default=None,
                   help="the `model` field of requests (default: the server's first model)")
    p.add_argument("--model", default=None, help="recorded only: the server decides what runs (default: none)")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer for text prompts / ShareGPT, HF folder or id (default: none: random token ids)")
    p.add_argument("--vocab-size", type=int, default=1000,
                   help="random token-id prompts without a tokenizer: ids in [10, vocab-size)")
    add_dataset_args(p)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (inf: all at once)")
    p.add_argument("--burstiness", type=float, default=1.0, help="1: Poisson; <1 burstier, >1 more regular")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="most requests in flight at once (default: no limit)")
    p.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                   help="SLOs for goodput, e.g. ttft:500 tpot:50 (keys ttft, tpot, e2el; default: no goodput)")
    p.add_argument("--no-ignore-eos", action="store_true", help="let requests stop at eos (default: ignore it)")
    p.add_argument("--api-key", default=None, help="the server's API key (default: $JAXENGINE_API_KEY, or none)")
    p.add_argument("--output-json", default=None,
                   help="where to write the results (default: ./bench_serve_<model>_<time>.json)")
    p.set_defaults(func=cmd_serve)
