"""Where a Mosaic kernel's time goes: reads the Chrome traces Mosaic GPU's in-kernel profiler
writes (one file per call, `MosaicTiling.profile_dir` / `DecodeTiling.profile_dir`, or
`bench_paged_attention.py --mosaic-profile DIR`) and sums each warpgroup role's named phases
(`jax.named_scope` in the kernel body: q_load, first_k_wait, kv_loop, epilogue, kv_issue, ...).

    python lab/kernels/mosaic_phases.py DIR [--warpgroups 3 --roles compute,compute,memory]

Per trace: the kernel's span (first phase start to last phase end, all CTAs), the number of
CTAs, per role and phase the count, total and mean duration, and the phases of the CTA that
ended last (the one the call waited for).

Units: Mosaic GPU's profiler stamps each event with the SM clock (%clock, cycles) and writes
ts = (CTA start on the global timer in ns + cycles since) / 1000. Durations within a CTA are
therefore kilocycles ("kcyc"): at the H100's 1.7-2.0 GHz under load one kcycle is 0.5-0.6 us
(on the H100 here, profiled spans matched the CUPTI kernel times at about 1.71 GHz). The
last CTA's start offset is in microseconds (global timer); the kernel span mixes the two and
is approximate.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os


def phases(trace: dict, warpgroups: int, roles: list[str]) -> dict:
    """Summary of one trace. Trace ids number warpgroups CTA by CTA (id - 1 = cta *
    warpgroups + warpgroup index), as Mosaic GPU's profiler writes them; `roles` names each
    warpgroup index (e.g. compute, compute, memory)."""
    if len(roles) != warpgroups:
        raise ValueError(f"{len(roles)} roles for {warpgroups} warpgroups")
    per: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
    cta_phase: dict[int, dict[str, float]] = collections.defaultdict(
        lambda: collections.defaultdict(float))
    span: dict[int, list[float]] = {}
    open_: dict[int, list[tuple[str, float]]] = collections.defaultdict(list)
    events: dict[int, list[tuple[float, float, str]]] = collections.defaultdict(list)
    for e in trace["traceEvents"]:
        cta, wg = divmod(int(e["tid"]) - 1, warpgroups)
        ts = float(e["ts"])
        lo_hi = span.setdefault(cta, [ts, ts])
        lo_hi[0], lo_hi[1] = min(lo_hi[0], ts), max(lo_hi[1], ts)
        stack = open_[int(e["tid"])]
        if e["ph"] == "B":
            stack.append((e["name"], ts))
            continue
        name, start = stack.pop()
        if name != e["name"]:
            raise ValueError(f"phase {e['name']!r} ends inside {name!r} (trace id {e['tid']})")
        per[(roles[wg], name)].append(ts - start)
        events[cta].append((start, ts, f"{roles[wg]}/{name}"))
        cta_phase[cta][f"{roles[wg]}/{name}"] += ts - start
    if not span:
        return {"ctas": 0}
    first = min(lo for lo, _ in span.values())
    last_cta = max(span, key=lambda c: span[c][1])
    table: dict[str, dict[str, dict[str, float]]] = collections.defaultdict(dict)
    for (role, name), ds in sorted(per.items()):
        table[role][name] = {"count": len(ds), "total_kcyc": sum(ds),
                             "mean_kcyc": sum(ds) / len(ds)}
    return {"kernel_kcyc": max(hi for _, hi in span.values()) - first, "ctas": len(span),
            "phases": dict(table),
            "last_cta": {"cta": last_cta, "start_us": span[last_cta][0] - first,
                         "span_kcyc": span[last_cta][1] - span[last_cta][0],
                         "phases_kcyc": dict(cta_phase[last_cta]),
                         # every phase of that CTA in start order: [start, end] in kcyc from
                         # its first stamp (one warpgroup's clock; the others' within a few
                         # cycles), e.g. when each K/V step landed (k_wait / v_wait ends)
                         "timeline": [[name, round(a - span[last_cta][0], 3),
                                       round(b - span[last_cta][0], 3)]
                                      for a, b, name in sorted(events[last_cta])]}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", help="folder of *-trace.json files")
    ap.add_argument("--warpgroups", type=int, default=3,
                    help="warpgroups per CTA: 3 for the prefill kernel, 2 for the decode kernel")
    ap.add_argument("--roles", default="compute,compute,memory",
                    help="comma-separated role per warpgroup index (decode: compute,memory)")
    ap.add_argument("--timeline", action="store_true",
                    help="also list every phase of the CTA that ended last, in start order")
    args = ap.parse_args()
    roles = args.roles.split(",")
    for path in sorted(glob.glob(os.path.join(args.dir, "*trace.json"))):
        with open(path) as f:
            res = phases(json.load(f), args.warpgroups, roles)
        print(f"{os.path.basename(path)}: kernel {res.get('kernel_kcyc', 0):.1f} kcyc, "
              f"{res['ctas']} CTAs")
        for role, names in res.get("phases", {}).items():
            for name, v in names.items():
                print(f"  {role:8s} {name:14s} n={v['count']:5d} total {v['total_kcyc']:9.1f} kcyc "
                      f"mean {v['mean_kcyc']:7.2f} kcyc")
        if "last_cta" in res:
            lc = res["last_cta"]
            print(f"  last CTA {lc['cta']}: starts {lc['start_us']:.1f} us, spans "
                  f"{lc['span_kcyc']:.1f} kcyc: " + ", ".join(
                      f"{k} {v:.1f}" for k, v in sorted(lc["phases_kcyc"].items())))
            if args.timeline:
                for name, a, b in lc["timeline"]:
                    print(f"    {a:8.2f} - {b:8.2f} kcyc  {name}")


if __name__ == "__main__":
    main()
