"""Command-line flags for every engine argument, derived from `EngineConfig` (one source of truth)."""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing

from jaxengine.config import EngineConfig

_SKIP = {"model"}  # positional / given by each command


def _base_type(tp) -> type:
    if isinstance(tp, str):
        tp = eval(tp, {"int": int, "float": float, "str": str, "bool": bool, "None": None})  # noqa: S307
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        return args[0]
    return tp


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    for f in dataclasses.fields(EngineConfig):
        if f.name in _SKIP:
            continue
        flag = "--" + f.name.replace("_", "-")
        tp = _base_type(f.type)
        default = f.default if f.default is not dataclasses.MISSING else None
        if tp is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=default)
        else:
            group.add_argument(flag, type=tp, default=default, dest=f.name)


def engine_kwargs(args: argparse.Namespace) -> dict[str, object]:
    out = {}
    for f in dataclasses.fields(EngineConfig):
        if f.name in _SKIP or not hasattr(args, f.name):
            continue
        out[f.name] = getattr(args, f.name)
    if out.get("compilation_cache_dir") is None:
        out.pop("compilation_cache_dir", None)
    return out


def normalize_flags(argv: list[str]) -> list[str]:
    """vLLM's command lines spell flags either way (`--max-num-seqs`, `--max_num_seqs`): options
    are rewritten with dashes before parsing. Values, and everything after a bare `--`, stay."""
    out: list[str] = []
    for i, a in enumerate(argv):
        if a == "--":
            return out + argv[i:]
        if a.startswith("--") and "_" in a.partition("=")[0]:
            name, eq, value = a.partition("=")
            a = name.replace("_", "-") + eq + value
        out.append(a)
    return out
