"""Two CPU processes on 127.0.0.1, started with the multi-host flags, act as one engine: offline
they produce the outputs of one process over the same two devices, and as a server rank 0 answers
HTTP while rank 1 follows its steps, with the same outputs, until a SIGTERM stops both."""

from __future__ import annotations

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

from jaxengine.distributed import MultiHostConfig
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


def test_two_process_server_equals_one_process(checkpoint, reference):
    coord, port = f"127.0.0.1:{_free_port()}", _free_port()
    flags = ["--tensor-parallel-size", "2", "--max-model-len", str(ENGINE_KW["max_model_len"]),
             "--max-num-seqs", str(ENGINE_KW["max_num_seqs"]),
             "--max-num-batched-tokens", str(ENGINE_KW["max_num_batched_tokens"]),
             "--num-kv-blocks", str(ENGINE_KW["num_kv_blocks"]), "--port", str(port),
             "--uvicorn-log-level", "warning", "--num-hosts", "2", "--coordinator", coord]
    procs = [subprocess.Popen([sys.executable, "-m", "jaxengine.server", checkpoint, *flags, "--host-rank", str(r)],
                              env=_env(1), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in (0, 1)]
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 600
        while True:
            assert all(p.poll() is None for p in procs), "a rank exited during start-up"
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.5)
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
        assert procs[1].poll() is None
        procs[0].send_signal(signal.SIGTERM)  # rank 0 drains, tells rank 1 to stop; both exit cleanly
        results = _wait_all(procs, timeout=120)
        assert [rc for rc, _, _ in results] == [0, 0], [err[-2000:] for _, _, err in results]
    finally:
        for p in procs:
            p.kill()


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
