"""A short soak (benchmarks/soak.py in small): 40 streaming clients for 15 s against a live server
process on 127.0.0.1, a share hanging up mid-stream. Every finished stream equals its solo
output, no 5xx, nothing left running or holding KV blocks, RSS flat, SIGTERM exits 0."""

from __future__ import annotations

from benchmarks.soak import SoakConfig, free_port, run_soak, start_server, stop_server, wait_healthy

ENGINE = ["--max-model-len", "128", "--max-num-seqs", "16", "--max-num-batched-tokens", "64",
          "--num-kv-blocks", "40", "--block-size", "16"]


def test_short_soak(tiny_llama, xla_cache_dir, tmp_path):
    cfg = SoakConfig(clients=40, duration_s=6.0, warmup_s=3.0, disconnect_share=0.2, num_specs=12,
                     max_prompt_words=40, max_new_tokens=32, request_timeout_s=120.0)
    port = free_port()
    proc = start_server(tiny_llama, port, ["--compilation-cache-dir", xla_cache_dir],
                        log_path=str(tmp_path / "server.log"), engine_args=ENGINE)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc, timeout=240)
        result = run_soak(f"http://127.0.0.1:{port}", proc.pid, cfg)
    finally:
        status = stop_server(proc)
    log = (tmp_path / "server.log").read_text()[-3000:]
    assert result["passed"], (result, log)
    assert result["streams_completed"] > 40 and result["streams_disconnected"] > 0, result
    assert status == 0, log
