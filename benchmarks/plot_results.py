"""PNG plots of the JSON files `benchmarks/gpu_suite.py` writes.

    python benchmarks/plot_results.py DIR [--out-dir benchmarks/results] [--prefix suite]

DIR holds any of suite_{engine,serve,peer,startup,sweep}[_smoke].json; each plot needs only its
own files and is skipped (with a line saying so) when they are missing:
- <prefix>_throughput.png: offline output tok/s per workload, jaxengine vs transformers (same run
  set), with vLLM's published 11,364 output tok/s (H100, 256 in / 256 out) as a line;
- <prefix>_decode.png: batch-1 decode ms/token, jaxengine vs the HBM roofline vs transformers;
- <prefix>_serving.png: TTFT and TPOT (median, p99) against the request rate;
- <prefix>_startup.png: process start to first token, cold and warm, per configuration;
- <prefix>_sweep.png: compile seconds and median step latency per token bucket, per schedule.
Needs matplotlib (`pip install 'jaxengine[bench]'`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
VLLM_256x256 = 11364.0


def load(folder: str, part: str) -> dict | None:
    for name in (f"suite_{part}.json", f"suite_{part}_smoke.json"):
        path = os.path.join(folder, name)
        if os.path.exists(path):
            with open(path) as f:
                return json.load(f)
    return None


def _device(d: dict) -> str:
    smi = (d.get("device") or {}).get("nvidia_smi")
    name = smi["name"] if smi else (d.get("device") or {}).get("jax_device_kind", "?")
    return name + (" [smoke]" if d.get("smoke") else "")


def _save(fig, path: str) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    import matplotlib.pyplot as plt
    plt.close(fig)
    return path


def plot_throughput(engine: dict | None, peer: dict | None, path: str) -> str | None:
    import matplotlib.pyplot as plt

    if engine is None:
        return None
    tps = engine["results"]["llama"]["throughput"]
    peer_secs = ((peer or {}).get("results", {}).get("peer", {}) or {}).get("sections", {})
    names = list(tps)
    ours = [tps[n]["output_tokens_per_s"] for n in names]
    theirs = []
    for n in names:
        t = tps[n]
        s = peer_secs.get(f"throughput_{t['input_len']}x{t['output_len']}", {})
        theirs.append(s.get("output_tokens_per_s") if s.get("num_prompts") else None)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    x = range(len(names))
    w = 0.38
    b1 = ax.bar([i - w / 2 for i in x], ours, w, label="jaxengine")
    ax.bar_label(b1, fmt="%.0f", fontsize=8)
    if any(v is not None for v in theirs):
        b2 = ax.bar([i + w / 2 for i in x], [v or 0 for v in theirs], w, label="transformers generate (same device, no detokenization)")
        ax.bar_label(b2, labels=[f"{v:.0f}" if v else "" for v in theirs], fontsize=8)
    if not engine.get("smoke"):
        ax.axhline(VLLM_256x256, color="k", ls="--", lw=1, label="vLLM published, 256/256 (11,364)")
    labels = [f"{n}\n{tps[n]['num_requests']} prompts" for n in names]
    ax.set_xticks(list(x), labels, fontsize=8)
    ax.set(ylabel="output tokens/s", title=f"Offline throughput, {engine['results']['llama']['model']}\n{_device(engine)}")
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_decode(engine: dict | None, peer: dict | None, path: str) -> str | None:
    import matplotlib.pyplot as plt

    if engine is None:
        return None
    db = engine["results"]["llama"]["decode_b1"]
    labels, vals = ["jaxengine", "HBM roofline\n(same run)"], [db["ms_per_token"], db["roofline_ms"]]
    for k, s in (((peer or {}).get("results", {}).get("peer", {}) or {}).get("sections", {})).items():
        if k.startswith("decode_b1") and s.get("ok"):
            labels.append(f"transformers\n{s.get('mode')}")
            vals.append(s["ms_per_token"])
    fig, ax = plt.subplots(figsize=(7, 4))
    bars = ax.bar(labels, vals, color=["C0", "0.6"] + ["C1"] * (len(vals) - 2))
    ax.bar_label(bars, fmt="%.2f", fontsize=8)
    ax.set(ylabel="ms per token (lower is better)",
           title=f"Batch-1 decode: {100 * db['fraction_of_roofline']:.0f}% of the roofline\n{_device(engine)}")
    return _save(fig, path)


def plot_serving(serve: dict | None, path: str) -> str | None:
    import matplotlib.pyplot as plt

    if serve is None or not serve["results"].get("runs"):
        return None
    runs = serve["results"]["runs"]
    labels = [str(r["request_rate"]) for r in runs]
    x = list(range(len(runs)))
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    for key, ax, title in (("ttft_ms", a1, "time to first token"), ("tpot_ms", a2, "time per output token")):
        for stat, style in (("median", "-o"), ("p99", "--s")):
            ax.plot(x, [r["metrics"][key][stat] for r in runs], style, label=stat)
        ax.set_xticks(x, [f"{lab}\n({r['num_prompts']})" for lab, r in zip(labels, runs)])
        ax.set(xlabel="request rate, req/s (prompts)", ylabel="ms", title=title)
        ax.set_yscale("log")
        ax.legend(fontsize=8)
    if not serve.get("smoke"):
        a2.axhline(7.6, color="k", ls=":", lw=1)
        a2.text(0, 7.6, " vLLM published median TPOT 7.6 ms", fontsize=7, va="bottom")
    sv = serve.get("parameters", {}).get("serve", {})
    fig.suptitle(f"Serving, random {sv.get('input_len', '?')} in / {sv.get('output_len', '?')} out: {_device(serve)}",
                 fontsize=10)
    return _save(fig, path)


def plot_startup(startup: dict | None, path: str) -> str | None:
    import matplotlib.pyplot as plt

    if startup is None:
        return None
    labels, vals, colors = [], [], []
    for e in startup["results"]["configs"]:
        for r in e["runs"]:
            if r.get("first_token_s") is None:
                continue
            labels.append(f"{e['label'][:28]}\n{r['kind']}")
            vals.append(r["first_token_s"])
            colors.append("C3" if r["kind"] == "cold" else "C2")
    if not vals:
        return None
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(vals)), 4.5))
    bars = ax.bar(range(len(vals)), vals, color=colors)
    ax.bar_label(bars, fmt="%.1f", fontsize=8)
    ax.set_xticks(range(len(vals)), labels, fontsize=7)
    ax.axhline(20, color="k", ls="--", lw=1, label="target: warm under 20 s")
    ax.set(ylabel="seconds, process start to first token", title=f"Start-up (jaxengine generate)\n{_device(startup)}")
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_sweep(sweep: dict | None, path: str) -> str | None:
    import matplotlib.pyplot as plt

    if sweep is None or not sweep["results"].get("schedules"):
        return None
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    ticks: set[int] = set()
    for s in sweep["results"]["schedules"]:
        bs = [b for b in s["buckets"] if "skipped" not in b]
        xs = [b["bucket"] for b in bs]
        ticks.update(xs)
        a1.plot(xs, [b["compile_s"] for b in bs], "-o", label=s["label"])
        a2.plot(xs, [b["step_ms"]["median"] for b in bs], "-o", label=s["label"])
    for ax, ylabel, title in ((a1, "compile seconds", "compile time per bucket"),
                              (a2, "median step ms", "step latency per bucket")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(ticks), [str(t) for t in sorted(ticks)], fontsize=7)
        ax.set(xlabel="token bucket", ylabel=ylabel, title=title)
        ax.legend(title="T:S:B", fontsize=8)
    rec = (sweep["results"].get("recommended") or {}).get("label", "?")
    fig.suptitle(f"Bucket sweep (recommended {rec}): {_device(sweep)}", fontsize=10)
    return _save(fig, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder", help="folder with the suite's JSON files")
    ap.add_argument("--out-dir", default=os.path.join(HERE, "results"))
    ap.add_argument("--prefix", default="suite")
    args = ap.parse_args(argv)
    data = {p: load(args.folder, p) for p in ("engine", "serve", "peer", "startup", "sweep")}
    if not any(data.values()):
        print(f"no suite_*.json in {args.folder}", file=sys.stderr)
        return 1
    try:
        import matplotlib
        matplotlib.use("Agg")
    except ImportError:
        print("matplotlib is missing: pip install 'jaxengine[bench]'", file=sys.stderr)
        return 2
    os.makedirs(args.out_dir, exist_ok=True)
    out = lambda name: os.path.join(args.out_dir, f"{args.prefix}_{name}.png")  # noqa: E731
    jobs = {"throughput": lambda: plot_throughput(data["engine"], data["peer"], out("throughput")),
            "decode": lambda: plot_decode(data["engine"], data["peer"], out("decode")),
            "serving": lambda: plot_serving(data["serve"], out("serving")),
            "startup": lambda: plot_startup(data["startup"], out("startup")),
            "sweep": lambda: plot_sweep(data["sweep"], out("sweep"))}
    for name, job in jobs.items():
        path = job()
        print(f"wrote {path}" if path else f"skipped {name}: its JSON is missing or empty")
    return 0


if __name__ == "__main__":
    sys.exit(main())
