"""One JSON of a serve-gap H100 call (lab/serve_gap/h100_*.sh), printed: DIR's offline run
(off.json), ceilings (ceilings.json) and GPU process lists (gpu_*.txt) where present, and every
timed rate-inf run (s_<tag><1-3>.json, warm-ups `w*` left out) with the engine timing read around
it (t0_/t1_<tag>.json).

    python3 lab/serve_gap/summary.py /tmp/pr > $OUT/proc/summary.json
"""

import glob
import json
import os
import sys


def main(d: str) -> int:
    out: dict = {"offline": json.load(open(f"{d}/off.json"))["results"]}
    if os.path.exists(f"{d}/ceilings.json"):
        out["ceilings"] = json.load(open(f"{d}/ceilings.json"))
    for f in glob.glob(f"{d}/gpu_*.txt"):
        out["gpu_processes_" + os.path.basename(f)[4:-4]] = [line for line in open(f).read().split("\n") if line]
    for f in sorted(glob.glob(f"{d}/s_*[123].json")):
        tag = os.path.basename(f)[2:-5]
        if tag.startswith("w"):
            continue
        out[tag] = {k: v for k, v in json.load(open(f))["results"].items() if not isinstance(v, list)}
        out[tag]["engine"] = {"t0": json.load(open(f"{d}/t0_{tag}.json")), "t1": json.load(open(f"{d}/t1_{tag}.json"))}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
