"""Two CPU processes on 127.0.0.1 act as one engine. Started by hand with the multi-host flags,
offline, they produce the outputs of one process over the same two devices. Started as a server
with `--distributed-executor-backend mp` (rank 0 starts rank 1 itself), rank 0 answers HTTP while
rank 1 follows its steps, with the same outputs, until a SIGTERM to rank 0 stops both."""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

from jaxengine.distributed import MultiHostConfig, start_local_workers
from tests.parallel.multihost_common import ENGINE_KW, MAX_TOKENS, PROMPTS
from tests.tiny_checkpoints import make_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(os.path.dirname(__file__), "multihost_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(devices: int) -> dict:
    return dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
                PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))


def _wait_all(procs: list[subprocess.Popen], timeout: float) -> list[tuple[int, str, str]]:
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=timeout)
        out.append((p.returncode, stdout, stderr))
    return out


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, smollm2_tokenizer_dir) -> str:
    import transformers
    tok = transformers.AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)
    return make_checkpoint("llama", str(tmp_path_factory.mktemp("mh") / "llama"), tokenizer=tok,
                           num_attention_heads=8, num_key_value_heads=4)


@pytest.fixture(scope="module")
def reference(checkpoint) -> dict:
    """One process driving two (simulated) devices at TP=2."""
    proc = subprocess.run([sys.executable, WORKER, checkpoint, "1", "0", "-"], env=_env(2), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_two_processes_offline_equal_one(checkpoint, reference):
    coord = f"127.0.0.1:{_free_port()}"
    procs = [subprocess.Popen([sys.executable, WORKER, checkpoint, "2", str(r), coord], env=_env(1),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    try:
        results = _wait_all(procs, timeout=600)
    finally:
        for p in procs:
            p.kill()
    for rc, _, err in results:
        assert rc == 0, err[-3000:]
    got = json.loads(results[0][1].strip().splitlines()[-1])
    assert (got["devices"], got["processes"]) == (2, 2)
    assert '"tokens"' not in results[1][1]  # only rank 0 reports
    assert got["tokens"] == reference["tokens"]


def _rank1_pids(port: int) -> list[int]:
    """Processes whose command line is a rank-1 worker serving on `port` (Linux /proc)."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        if str(port) in argv and any(a == "--host-rank" and b == "1" for a, b in zip(argv, argv[1:])):
            pids.append(int(pid))
    return pids


def test_server_with_a_process_per_device_equals_one_process(checkpoint, reference, tmp_path):
    """`--distributed-executor-backend mp`: the server starts rank 1 itself (the multi-host flags on
    127.0.0.1); rank 0 answers HTTP, rank 1 follows its steps, and a SIGTERM to rank 0 stops both."""
    port = _free_port()
    flags = ["--tensor-parallel-size", "2", "--max-model-len", str(ENGINE_KW["max_model_len"]),
             "--max-num-seqs", str(ENGINE_KW["max_num_seqs"]),
             "--max-num-batched-tokens", str(ENGINE_KW["max_num_batched_tokens"]),
             "--num-kv-blocks", str(ENGINE_KW["num_kv_blocks"]), "--port", str(port),
             "--uvicorn-log-level", "warning", "--distributed-executor-backend", "mp"]
    log = open(tmp_path / "server.log", "w+")  # both ranks write here (a pipe could fill up unread)
    proc = subprocess.Popen([sys.executable, "-m", "jaxengine.server", checkpoint, *flags], env=_env(1),
                            stdout=log, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 600
        while True:
            assert proc.poll() is None, "rank 0 exited during start-up"
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.5)
        assert len(_rank1_pids(port)) == 1, "rank 0 did not start exactly one worker"
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")

        def complete(prompt: list[int]) -> str:
            r = client.completions.create(model=checkpoint, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                          extra_body={"ignore_eos": True})
            return r.choices[0].text

        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:  # concurrent: batched steps
            texts = list(pool.map(complete, PROMPTS))
        assert texts == reference["texts"]
        stream = client.completions.create(model=checkpoint, prompt=PROMPTS[0], max_tokens=MAX_TOKENS,
                                           temperature=0, stream=True, extra_body={"ignore_eos": True})
        assert "".join(c.choices[0].text for c in stream) == reference["texts"][0]
        time.sleep(2.5)  # idle: rank 1 keeps following the heartbeat iterations
        assert len(_rank1_pids(port)) == 1
        proc.send_signal(signal.SIGTERM)  # rank 0 drains, tells rank 1 to stop, waits for it
        assert proc.wait(timeout=45) == 0, log.seek(0) or log.read()[-3000:]  # no wait on the worker's exit
        assert _rank1_pids(port) == []
    finally:
        proc.kill()
        for pid in _rank1_pids(port):
            os.kill(pid, signal.SIGKILL)
        log.close()


def test_bad_multihost_flags_are_clear_errors():
    with pytest.raises(ValueError, match="host_rank must be in"):
        MultiHostConfig(2, 2, "127.0.0.1:1234")
    with pytest.raises(ValueError, match="coordinator must be HOST:PORT"):
        MultiHostConfig(2, 0, None)
    with pytest.raises(ValueError, match="num_hosts must be a positive integer"):
        MultiHostConfig(0, 0, None)
    proc = subprocess.run([sys.executable, "-m", "jaxengine.cli", "generate", "hi", "--num-hosts", "2",
                           "--coordinator", "nohostport"], env=_env(1), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "coordinator must be HOST:PORT" in proc.stderr


def test_bad_process_per_device_settings_are_clear_errors(monkeypatch):
    def args(**kw):
        base = dict(distributed_executor_backend="mp", tensor_parallel_size=2, num_hosts=1, host_rank=0,
                    coordinator=None, argv=["generate", "hi"], prog_module="jaxengine.cli")
        return argparse.Namespace(**dict(base, **kw))
    with pytest.raises(ValueError, match="across hosts"):
        start_local_workers(args(num_hosts=2))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    with pytest.raises(ValueError, match="needs 4 GPUs, CUDA_VISIBLE_DEVICES lists 2"):
        start_local_workers(args(tensor_parallel_size=4))
    with pytest.raises(ValueError, match="repeats the command line"):
        start_local_workers(args(argv=None))
    # nothing to start: one device, or the single-process backend
    assert start_local_workers(args(tensor_parallel_size=1)) == []
    assert start_local_workers(args(distributed_executor_backend="uni")) == []
