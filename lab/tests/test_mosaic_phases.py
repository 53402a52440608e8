"""The Mosaic trace summary (lab/kernels/mosaic_phases.py) on a trace written the way
Mosaic GPU's in-kernel profiler writes one: B/E events per warpgroup, trace ids numbering the
warpgroups CTA by CTA."""

from __future__ import annotations

import json

import pytest

from lab.kernels.mosaic_phases import main, phases


def _trace() -> dict:
    ev = []

    def rng(tid, name, b, e):
        ev.extend([{"name": name, "ph": "B", "ts": b, "pid": 1, "tid": tid},
                   {"name": name, "ph": "E", "ts": e, "pid": 1, "tid": tid}])

    # CTA 0: warpgroups 1-3 (compute, compute, memory); CTA 1: trace ids 4-6, ends last.
    rng(1, "q_load", 10.0, 11.0)
    rng(1, "kv_loop", 11.0, 15.0)
    rng(2, "q_load", 10.0, 11.5)
    rng(3, "kv_issue", 10.0, 14.0)
    rng(4, "q_load", 12.0, 13.0)
    ev.append({"name": "kv_loop", "ph": "B", "ts": 13.0, "pid": 2, "tid": 4})
    rng(4, "inner", 13.5, 14.0)  # nested phases pair with their own ends
    ev.append({"name": "kv_loop", "ph": "E", "ts": 20.0, "pid": 2, "tid": 4})
    rng(6, "kv_issue", 12.0, 18.0)
    return {"displayTimeUnit": "ns", "traceEvents": ev}


def test_phases_sum_per_role_and_name_the_last_cta():
    res = phases(_trace(), 3, ["compute", "compute", "memory"])
    assert res["ctas"] == 2
    assert res["kernel_kcyc"] == pytest.approx(10.0)
    q = res["phases"]["compute"]["q_load"]
    assert q["count"] == 3 and q["total_kcyc"] == pytest.approx(3.5)
    assert res["phases"]["compute"]["kv_loop"]["total_kcyc"] == pytest.approx(11.0)
    assert res["phases"]["memory"]["kv_issue"]["mean_kcyc"] == pytest.approx(5.0)
    last = res["last_cta"]
    assert last["cta"] == 1 and last["start_us"] == pytest.approx(2.0)
    assert last["span_kcyc"] == pytest.approx(8.0)
    assert last["phases_kcyc"]["compute/kv_loop"] == pytest.approx(7.0)
    assert last["phases_kcyc"]["memory/kv_issue"] == pytest.approx(6.0)
    # its phases in start order, from its first stamp (12.0)
    assert last["timeline"] == [["compute/q_load", 0.0, 1.0], ["memory/kv_issue", 0.0, 6.0],
                                ["compute/kv_loop", 1.0, 8.0], ["compute/inner", 1.5, 2.0]]


def test_bad_traces_and_roles_are_errors():
    with pytest.raises(ValueError, match="roles for"):
        phases(_trace(), 2, ["compute", "compute", "memory"])
    bad = {"traceEvents": [{"name": "a", "ph": "B", "ts": 0, "tid": 1},
                           {"name": "b", "ph": "E", "ts": 1, "tid": 1}]}
    with pytest.raises(ValueError, match="ends inside"):
        phases(bad, 3, ["compute", "compute", "memory"])


def test_cli_prints_each_trace(tmp_path, capsys, monkeypatch):
    (tmp_path / "1-trace.json").write_text(json.dumps(_trace()))
    monkeypatch.setattr("sys.argv", ["mosaic_phases.py", str(tmp_path), "--timeline"])
    main()
    out = capsys.readouterr().out
    assert "1-trace.json: kernel 10.0 kcyc, 2 CTAs" in out
    assert "last CTA 1" in out and "compute/kv_loop 7.0" in out
    assert "1.50 -     2.00 kcyc  compute/inner" in out
