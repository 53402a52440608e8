"""Soak test: many concurrent streaming clients against a live server, with nothing lost.

Starts `python -m jaxengine.server` on 127.0.0.1 (a tiny random Llama with the SmolLM2 tokenizer
unless `--model` is given), serves every distinct request once alone (greedy, eos ignored) as the
reference, then runs N concurrent clients for a bounded time: each loops over streamed
completions of mixed prompt lengths and max_tokens, and a share of them hang up mid-stream.
Checked: every stream that ran to its end is well formed, complete (`[DONE]`, finish_reason
"length", usage = max_tokens) and equal to the same request served alone; zero 5xx; at the end
no request is running or waiting and no KV block is held; the server's RSS (with its engine
process's) stays flat after the
warm-up; SIGTERM then exits 0. Writes the figures as JSON + Markdown.

    python benchmarks/soak.py [--clients 200] [--duration 150] [--model PATH]

Only ever connects to 127.0.0.1; every loop is bounded in count and time.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import platform
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import httpx

HOST = "127.0.0.1"
WORDS = ("the quick brown fox jumps over a lazy dog while seven clever owls watch from an old oak tree "
         "near the quiet river under a pale autumn moon").split()
# The server's engine: small enough for 2 CPU cores, with a KV pool that cannot hold every
# running request at its longest (so preemption happens under load).
ENGINE_ARGS = ["--max-model-len", "256", "--max-num-seqs", "32", "--max-num-batched-tokens", "256",
               "--num-kv-blocks", "64", "--block-size", "16"]


@dataclasses.dataclass(frozen=True)
class SoakConfig:
    clients: int = 200
    duration_s: float = 150.0
    warmup_s: float = 20.0  # RSS is compared from the end of this window on
    disconnect_share: float = 0.15  # requests whose client hangs up mid-stream
    num_specs: int = 32  # distinct (prompt, max_tokens) pairs
    max_prompt_words: int = 100
    max_new_tokens: int = 48
    request_timeout_s: float = 300.0
    seed: int = 0
    rss_growth_limit_mb: float = 64.0


@dataclasses.dataclass(frozen=True)
class Spec:
    prompt: str
    max_tokens: int


def make_specs(cfg: SoakConfig) -> list[Spec]:
    rng = random.Random(cfg.seed)
    return [Spec(" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, cfg.max_prompt_words))),
                 rng.randint(1, cfg.max_new_tokens)) for _ in range(cfg.num_specs)]


def body(spec: Spec, stream: bool) -> dict:
    out = {"prompt": spec.prompt, "max_tokens": spec.max_tokens, "temperature": 0.0, "ignore_eos": True}
    if stream:
        out.update(stream=True, stream_options={"include_usage": True})
    return out


# -- the server process --------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def start_server(model: str, port: int, extra: list[str] | None = None, log_path: str | None = None,
                 engine_args: list[str] | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "jaxengine.server", model, "--host", HOST, "--port", str(port),
           "--uvicorn-log-level", "warning", *(ENGINE_ARGS if engine_args is None else engine_args), *(extra or [])]
    log = open(log_path or os.devnull, "w")  # noqa: SIM115 - owned by the process
    env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"), HF_HUB_OFFLINE="1")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} while starting")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError("the server did not become healthy in time")


def rss_mb(pid: int) -> float:
    """The RSS of `pid` and its child processes (the server's engine process among them)."""
    total = 0.0
    for p in [pid, *_children(pid)]:
        try:
            with open(f"/proc/{p}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) / 1024
                        break
        except OSError:  # exited meanwhile
            pass
    return total


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(entry))
            except (OSError, IndexError, ValueError):
                pass
    return out


def metrics(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "num_preemptions_total"):
            if line.startswith(f"jaxengine:{name}{{"):
                out[name] = float(line.rsplit(" ", 1)[1])
    return out


# -- the clients -----------------------------------------------------------------------------------
@dataclasses.dataclass
class Tally:
    started: int = 0
    completed: int = 0  # streams read to [DONE] and checked
    disconnected: int = 0  # hung up on purpose
    mismatched: int = 0  # complete but different from the solo output (or malformed)
    status: dict[int, int] = dataclasses.field(default_factory=dict)
    transport_errors: int = 0
    tokens: int = 0  # completion tokens of completed streams
    examples: list[str] = dataclasses.field(default_factory=list)

    def note(self, what: str) -> None:
        if len(self.examples) < 10:
            self.examples.append(what[:300])


async def one_stream(c: httpx.AsyncClient, spec: Spec, ref: str, hang_up_after: int | None, t: Tally) -> None:
    t.started += 1
    async with c.stream("POST", "/v1/completions", json=body(spec, True)) as r:
        t.status[r.status_code] = t.status.get(r.status_code, 0) + 1
        if r.status_code != 200:
            t.note(f"{r.status_code}: {(await r.aread())[:200]!r}")
            return
        text, finish, usage, events, done = "", None, None, 0, False
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            payload = line[len("data: "):]
            if payload == "[DONE]":
                done = True
                break
            chunk = json.loads(payload)
            if "error" in chunk:
                t.note(f"error event: {payload}")
                break
            for choice in chunk["choices"]:
                text += choice["text"]
                finish = choice["finish_reason"] or finish
            usage = chunk.get("usage") or usage
            events += 1
            if hang_up_after is not None and events >= hang_up_after:
                t.disconnected += 1
                return  # leaving the block closes the connection mid-stream
    ok = done and finish == "length" and text == ref and usage is not None and usage["completion_tokens"] == spec.max_tokens
    if ok:
        t.completed += 1
        t.tokens += spec.max_tokens
    else:
        t.mismatched += 1
        t.note(f"mismatch: done={done} finish={finish} usage={usage} got={text!r} want={ref!r}")


async def client_loop(idx: int, url: str, specs: list[Spec], refs: list[str], cfg: SoakConfig, deadline: float,
                      t: Tally) -> None:
    rng = random.Random(cfg.seed * 100_003 + idx)
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    async with httpx.AsyncClient(base_url=url, timeout=cfg.request_timeout_s, limits=limits) as c:
        for _ in range(100_000):  # bounded; the deadline ends it long before
            if time.monotonic() >= deadline:
                return
            k = rng.randrange(len(specs))
            hang = rng.randint(1, 4) if rng.random() < cfg.disconnect_share else None
            try:
                await one_stream(c, specs[k], refs[k], hang, t)
            except httpx.HTTPError as e:
                t.transport_errors += 1
                t.note(f"transport: {type(e).__name__}: {e}")


def sample_rss(pid: int, stop: threading.Event, samples: list[tuple[float, float]], t0: float) -> None:
    while not stop.wait(1.0):
        try:
            samples.append((time.monotonic() - t0, rss_mb(pid)))
        except OSError:
            return


# -- the run ---------------------------------------------------------------------------------------
def run_soak(url: str, pid: int, cfg: SoakConfig) -> dict:
    """Drives a running server (`pid` for its RSS) and returns the figures and the verdict."""
    specs = make_specs(cfg)
    refs = []
    with httpx.Client(base_url=url, timeout=cfg.request_timeout_s) as c:  # each request alone
        for s in specs:
            r = c.post("/v1/completions", json=body(s, False))
            r.raise_for_status()
            refs.append(r.json()["choices"][0]["text"])
    rss_start = rss_mb(pid)
    t, samples, stop = Tally(), [], threading.Event()
    t0 = time.monotonic()
    sampler = threading.Thread(target=sample_rss, args=(pid, stop, samples, t0), daemon=True)
    sampler.start()

    async def load() -> None:
        deadline = time.monotonic() + cfg.duration_s
        await asyncio.gather(*(client_loop(i, url, specs, refs, cfg, deadline, t) for i in range(cfg.clients)))

    asyncio.run(load())
    load_s = time.monotonic() - t0
    idle, final = False, {}
    for _ in range(120):  # bounded: up to 60 s for aborted requests to drain
        final = metrics(url)
        if final.get("num_requests_running", 1) == 0 and final.get("num_requests_waiting", 1) == 0 and \
                final.get("kv_cache_usage_perc", 1) == 0:
            idle = True
            break
        time.sleep(0.5)
    time.sleep(2.0)
    stop.set()
    sampler.join(5)
    rss_end = rss_mb(pid)
    after_warmup = [mb for s, mb in samples if s >= cfg.warmup_s]
    rss_after_warmup = after_warmup[0] if after_warmup else rss_start
    peak = max([mb for _, mb in samples] + [rss_start, rss_end])
    growth = rss_end - rss_after_warmup
    five_xx = sum(n for code, n in t.status.items() if code >= 500)
    checks = {
        "zero_5xx": five_xx == 0,
        "no_transport_errors": t.transport_errors == 0,
        "every_finished_stream_equals_solo": t.mismatched == 0 and t.completed > 0,
        "all_accounted_for": t.started == t.completed + t.disconnected + t.mismatched + sum(
            n for code, n in t.status.items() if code != 200),
        "idle_at_end": idle,
        "rss_flat_after_warmup": growth <= cfg.rss_growth_limit_mb,
    }
    return {
        "config": dataclasses.asdict(cfg),
        "requests_started": t.started, "streams_completed": t.completed, "streams_disconnected": t.disconnected,
        "streams_mismatched": t.mismatched, "status_counts": {str(k): v for k, v in sorted(t.status.items())},
        "http_5xx": five_xx, "transport_errors": t.transport_errors, "completion_tokens": t.tokens,
        "load_seconds": round(load_s, 1), "completed_per_s": round(t.completed / load_s, 2),
        "tokens_per_s": round(t.tokens / load_s, 1),
        "rss_mb": {"before_load": round(rss_start, 1), "after_warmup": round(rss_after_warmup, 1),
                   "peak": round(peak, 1), "end": round(rss_end, 1), "growth_after_warmup": round(growth, 1)},
        "final_metrics": final, "checks": checks, "passed": all(checks.values()), "examples": t.examples,
    }


def stop_server(proc: subprocess.Popen, timeout: float = 60.0) -> int | None:
    """SIGTERM, then the exit status (None if it had to be killed)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
        return None


def write_results(result: dict, path_json: str, path_md: str) -> None:
    with open(path_json, "w") as f:
        json.dump(result, f, indent=2)
    cfg, rss = result["config"], result["rss_mb"]
    lines = [
        f"# Soak: {cfg['clients']} streaming clients for {cfg['duration_s']:.0f} s (CPU, tiny model)", "",
        "| figure | value |", "|---|---|",
        f"| requests started | {result['requests_started']} |",
        f"| streams completed and equal to solo output | {result['streams_completed']} |",
        f"| streams the client hung up on ({cfg['disconnect_share']:.0%} share) | {result['streams_disconnected']} |",
        f"| streams mismatched or malformed | {result['streams_mismatched']} |",
        f"| HTTP statuses | {result['status_counts']} |",
        f"| 5xx / transport errors | {result['http_5xx']} / {result['transport_errors']} |",
        f"| completion tokens (completed streams) | {result['completion_tokens']} |",
        f"| completed streams/s, tokens/s | {result['completed_per_s']}, {result['tokens_per_s']} |",
        f"| server RSS MB: before, after warm-up ({cfg['warmup_s']:.0f} s), peak, end | "
        f"{rss['before_load']}, {rss['after_warmup']}, {rss['peak']}, {rss['end']} |",
        f"| RSS growth after warm-up (limit {cfg['rss_growth_limit_mb']:.0f} MB) | {rss['growth_after_warmup']} MB |",
        f"| idle at end (running, waiting, KV usage) | {result['final_metrics']} |",
        f"| preemptions | {result['final_metrics'].get('num_preemptions_total')} |",
        f"| SIGTERM exit status | {result.get('exit_status')} |", "",
        "Checks: " + ", ".join(f"{k}: {'ok' if v else 'FAILED'}" for k, v in result["checks"].items()) + ".", "",
        f"Verdict: **{'passed' if result['passed'] else 'FAILED'}**. {result.get('machine', '')}", ""]
    with open(path_md, "w") as f:
        f.write("\n".join(lines))


def tiny_model(path: str) -> str:
    """A tiny random Llama with the SmolLM2 tokenizer (as the server tests use)."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from jaxengine.default_model import default_model_path
    from jaxengine.models.checkpoint import open_checkpoint
    from tests.tiny_checkpoints import make_checkpoint

    tok = open_checkpoint(default_model_path()).load_tokenizer()
    return make_checkpoint("llama", path, tokenizer=tok)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--clients", type=int, default=200)
    p.add_argument("--duration", type=float, default=150.0, help="seconds of load")
    p.add_argument("--warmup", type=float, default=20.0)
    p.add_argument("--disconnect-share", type=float, default=0.15)
    p.add_argument("--model", default=None, help="default: a tiny random Llama built in a temporary folder")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "soak_cpu"))
    p.add_argument("--server-log", default=None)
    args = p.parse_args(argv)
    if args.clients < 1 or not 0 < args.duration <= 3600 or not 0 <= args.disconnect_share <= 1:
        p.error("clients >= 1, 0 < duration <= 3600 and disconnect share in [0, 1]")
    cfg = SoakConfig(clients=args.clients, duration_s=args.duration, warmup_s=args.warmup,
                     disconnect_share=args.disconnect_share)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or tiny_model(os.path.join(tmp, "tiny-llama"))
        port = free_port()
        url = f"http://{HOST}:{port}"
        proc = start_server(model, port, log_path=args.server_log)
        try:
            wait_healthy(url, proc)
            result = run_soak(url, proc.pid, cfg)
        finally:
            status = stop_server(proc)
    result["exit_status"] = status
    result["checks"]["clean_exit_on_sigterm"] = status == 0
    result["passed"] = all(result["checks"].values())
    result["machine"] = (f"{os.cpu_count()} CPU cores shared, Python {platform.python_version()}, "
                         f"model: {'tiny random Llama (2 layers, hidden 64)' if not args.model else args.model}; "
                         f"engine {' '.join(ENGINE_ARGS)}.")
    write_results(result, args.out + ".json", args.out + ".md")
    print(open(args.out + ".md").read())
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
