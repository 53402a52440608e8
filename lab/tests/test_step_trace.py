"""lab/gpu_checks/step_trace.py's analysis on hand-made events: device kernels are tied to the
program launch that enqueued them by correlation id, summed by category per bucket, and the
device's idle time is booked to what the loop thread was doing."""

from __future__ import annotations

from lab.gpu_checks.step_trace import analyze, categorize

US = 1000  # ns


def _host(name, start, end, line="loop"):
    return {"name": name, "line": line, "start": start * US, "end": end * US}


def _dev(name, start, end, corr, line="Stream #14(Compute)"):
    return {"name": name, "line": line, "start": start * US, "end": end * US, "module": None, "corr": corr}


def test_categories_by_kernel_name() -> None:
    assert categorize("nvjet_sm90_tst_128x256_64x4_2x1_v_bz_coopA_NNN") == "matmul"
    assert categorize("gemm_fusion_dot_general_131") == "matmul"
    assert categorize("void cublasLt::splitKreduce_kernel<32, 16>") == "matmul"
    assert categorize("rpa_decode") == "attention"
    assert categorize("rpa_prefill_mosaic_mosaic_gpu_kernel") == "attention"
    assert categorize("MemcpyH2D", "Stream #15(MemcpyH2D)") == "copy"
    assert categorize("loop_multiply_fusion_31") == "other"


def test_breakdown_and_idle_attribution() -> None:
    # Two steps: each launches a forward (bucket 256) then a sampler. The device runs the
    # forward's kernels after its launch and idles while the loop schedules the next step.
    host = [
        _host("je:step", 0, 100), _host("je:schedule", 0, 10), _host("je:fwd t=256", 10, 40),
        _host("je:sampler r=256", 40, 45), _host("je:collect", 45, 100),
        _host("je:step", 100, 200), _host("je:schedule", 100, 110), _host("je:fwd t=256", 110, 140),
        _host("je:sampler r=256", 140, 145), _host("je:collect", 145, 200),
        _host("je:worker_process", 50, 90, line="output worker"),
    ]
    corr_host = {1: ("loop", 38 * US), 2: ("loop", 44 * US), 3: ("loop", 138 * US), 4: ("loop", 144 * US)}
    device = [
        _dev("MemcpyH2D", 20, 21, 1, line="Stream #15(MemcpyH2D)"),
        _dev("nvjet_sm90_gemm", 40, 60, 1), _dev("rpa_decode", 60, 75, 1), _dev("loop_add_fusion", 75, 80, 1),
        _dev("input_reduce_fusion_1", 80, 84, 2),
        _dev("nvjet_sm90_gemm", 140, 160, 3), _dev("rpa_decode", 160, 175, 3), _dev("loop_add_fusion", 175, 180, 3),
        _dev("input_reduce_fusion_1", 180, 184, 4),
    ]
    ev = {"host": sorted(host, key=lambda e: e["start"]), "device": sorted(device, key=lambda e: e["start"]),
          "corr_host": corr_host, "diag": {}, "other_host": {("loop", "command_buffer_1"): [2, 0.05]}}
    res = analyze(ev)
    assert res["attribution"].startswith("correlation")
    fwd = res["programs"]["je:fwd t=256"]
    assert fwd["count"] == 2
    assert abs(fwd["matmul_ms"] - 0.020) < 1e-9 and abs(fwd["attention_ms"] - 0.015) < 1e-9
    assert abs(fwd["other_ms"] - 0.005) < 1e-9 and abs(fwd["copy_ms"] - 0.0005) < 1e-9
    assert abs(fwd["launch_ms"] - 0.030) < 1e-9
    samp = res["programs"]["je:sampler r=256"]
    assert samp["count"] == 2 and abs(samp["busy_ms"] - 0.004) < 1e-9
    assert res["steps"] == 2 and abs(res["window_ms"] - 0.200) < 1e-9
    # busy: 20-21, 40-84, 140-184 -> 89 us of 200
    assert abs(res["device_busy_ms"] - 0.089) < 1e-9
    idle = res["idle_ms_by_loop_phase"]
    # idle 0-20 and 21-40 (schedule 0-10, then the launch 10-40), 84-140 (collect to 100, then
    # schedule and the next launch), 184-200 (collect): the worker's own line is not the loop's
    assert abs(idle["je:schedule"] - 0.020) < 1e-6
    assert abs(idle["je:fwd"] - 0.059) < 1e-6
    assert abs(idle["je:collect"] - 0.032) < 1e-6
    assert "je:worker_process" not in idle
    assert res["loop_host_events_ms"] == {"command_buffer_1": 0.05}
