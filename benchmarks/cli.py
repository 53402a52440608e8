"""`jaxengine bench {throughput,latency,serve,sweep,startup}`: the benchmark commands.

Each command writes one JSON file (`--output-json`, default ./bench_<kind>_<model>_<time>.json)
holding the device, the versions, the full configuration and the results, and prints
a short summary. Use `--load-format dummy` with a preset name (`--model llama-3-8b`) to measure a
real model shape without its weights.
"""

from __future__ import annotations

import argparse


def add_bench_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Adds `bench` and its subcommands to the `jaxengine` command's subparsers."""
    from jaxengine.benchmarks import latency, serve, startup, sweep, throughput

    bench = sub.add_parser("bench", help="benchmarks: throughput, latency, serve (HTTP client), sweep (buckets), "
                                          "startup (cold and warm starts)")
    bsub = bench.add_subparsers(dest="bench_command", required=True,
                                help="the benchmark; `jaxengine bench NAME --help` lists its flags")
    throughput.add_parser(bsub)
    latency.add_parser(bsub)
    serve.add_parser(bsub)
    sweep.add_parser(bsub)
    startup.add_parser(bsub)
    return bench
