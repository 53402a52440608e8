"""The vectorised input builder against a plain per-sequence construction, on random mixed batches."""

from __future__ import annotations

import types

import numpy as np
import pytest

from jaxengine.input_batch import InputBuilder
from jaxengine.packing import pack
from jaxengine.scheduler import PLACEHOLDER

BS, M = 16, 12


def reference(seqs, t: int, r: int, prev_rows: dict[str, int]) -> dict[str, np.ndarray]:
    out = {k: np.zeros(n, np.int32) for k, n in (("input_ids", t), ("positions", t), ("slot_mapping", t))}
    out["prev_index"] = np.full(t, -1, np.int32)
    out["kv_lens"] = np.zeros(r, np.int32)
    out["logits_indices"] = np.zeros(r, np.int32)
    out["block_tables"] = np.zeros((r, M), np.int32)
    qsl = np.zeros(r + 1, np.int32)
    cur = 0
    for i, s in enumerate(seqs):
        for j in range(s.num_new_tokens):
            p = s.start + j
            tok = s.token_ids[j]
            if tok == PLACEHOLDER:
                out["prev_index"][cur] = prev_rows[s.request_id]
                tok = 0
            out["input_ids"][cur] = tok
            out["positions"][cur] = p
            out["slot_mapping"][cur] = s.block_ids[p // BS] * BS + p % BS
            cur += 1
        out["block_tables"][i, :len(s.block_ids)] = s.block_ids
        out["kv_lens"][i] = s.start + s.num_new_tokens
        out["logits_indices"][i] = cur - 1
        qsl[i + 1] = cur
    qsl[len(seqs) + 1:] = cur
    out["query_start_loc"] = qsl
    return out


@pytest.mark.parametrize("seed", range(6))
def test_builder_matches_reference(seed):
    rng = np.random.default_rng(seed)
    builder = InputBuilder(M, BS)
    for _ in range(3):  # reused (double-buffered) host buffers must be fully rewritten
        seqs, prev_rows, budget = [], {}, 64
        for i in range(int(rng.integers(1, 9))):
            if budget <= 0:
                break
            length = int(rng.integers(2, M * BS))
            toks = [int(x) for x in rng.integers(1, 1000, length)]
            decode = rng.random() < 0.5
            n = 1 if decode else int(rng.integers(1, min(length, budget) + 1))
            if n > budget:
                break
            start = length - n
            if decode and rng.random() < 0.5:
                toks[-1] = PLACEHOLDER  # sampled by the step in flight
                prev_rows[str(i)] = int(rng.integers(0, 8))
            blocks = [int(x) for x in rng.permutation(np.arange(1, 500))[: -(-length // BS)]]
            seqs.append(types.SimpleNamespace(request_id=str(i), token_ids=toks[start:], start=start,
                                              num_new_tokens=n, block_ids=blocks))
            budget -= n
        inputs = builder.build(seqs, 64, 8, prev_rows)
        want = reference(seqs, 64, 8, prev_rows)
        got = {"input_ids": inputs.input_ids, "positions": inputs.positions, "prev_index": inputs.prev_index,
               "slot_mapping": inputs.attn.slot_mapping, "kv_lens": inputs.attn.kv_lens,
               "block_tables": inputs.attn.block_tables, "query_start_loc": inputs.attn.query_start_loc,
               "logits_indices": inputs.logits_indices}
        for k, v in want.items():
            np.testing.assert_array_equal(got[k], v, err_msg=k)
        assert int(inputs.attn.num_seqs[0]) == len(seqs)
        np.testing.assert_array_equal(builder.packed(64, 8), pack(inputs))  # the runner sends this copy
