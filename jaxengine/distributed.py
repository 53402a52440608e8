"""One engine across hosts: a `jax.distributed` job whose mesh spans every process.

Every process builds the same engine and runs the same compiled programs in the same order (SPMD:
each process drives its own devices, XLA's collectives join them). What keeps them in lockstep:
- Offline (`LLM.generate`, `jaxengine generate`): every process is given the same prompts, and the
  engine's schedule is a deterministic function of the requests, so they agree by construction.
- Serving: only process 0 answers HTTP. Before each engine iteration it broadcasts the requests it
  added and aborted since the previous one (`StepChannel`); the other processes apply the same
  events and then step too (`run_follower`). Sampling runs on the devices, so every process sees
  the same tokens, and output processing (stop strings included) is the same code on the same data.
Anything a process derives from its own machine (the KV pool sized from free memory) is agreed on
with `agree_min` before it shapes a program.
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import logging
import os
import pickle
import socket
import subprocess
import sys
import time
from typing import TYPE_CHECKING

import jax
import numpy as np

if TYPE_CHECKING:
    from jaxengine.engine import LLMEngine

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class MultiHostConfig:
    """`--num-hosts H --host-rank R --coordinator ADDR:PORT` (JAX's num_processes, process_id and
    coordinator_address). Process 0 hosts the coordinator; every process gives its address."""

    num_hosts: int = 1
    host_rank: int = 0
    coordinator: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.num_hosts, int) or self.num_hosts < 1:
            raise ValueError(f"num_hosts must be a positive integer, got {self.num_hosts!r}")
        if not isinstance(self.host_rank, int) or not 0 <= self.host_rank < self.num_hosts:
            raise ValueError(f"host_rank must be in [0, num_hosts={self.num_hosts}), got {self.host_rank!r}")
        if self.num_hosts > 1:
            host, _, port = (self.coordinator or "").rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"with num_hosts > 1, coordinator must be HOST:PORT (process 0's address), "
                                 f"got {self.coordinator!r}")

    @property
    def enabled(self) -> bool:
        return self.num_hosts > 1


EXECUTOR_BACKENDS = ("uni", "mp")  # --distributed-executor-backend, as vLLM names them


def add_multihost_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("multi-host (one mesh over several processes)")
    g.add_argument("--num-hosts", "--num-processes", dest="num_hosts", type=int, default=1,
                   help="processes in the job (each drives its local devices)")
    g.add_argument("--host-rank", "--process-id", dest="host_rank", type=int, default=0,
                   help="this process's rank; rank 0 hosts the coordinator and (serve) answers HTTP")
    g.add_argument("--coordinator", "--coordinator-address", dest="coordinator", default=None,
                   help="HOST:PORT of rank 0's coordinator, the same on every process; needed with "
                        "--num-hosts > 1")
    g.add_argument("--distributed-executor-backend", choices=EXECUTOR_BACKENDS, default="uni",
                   help="tensor parallelism on one machine: 'uni' drives every GPU from this process; 'mp' "
                        "starts one process per GPU (a local multi-host job; this process is rank 0)")


def multihost_config(args: argparse.Namespace) -> MultiHostConfig:
    return MultiHostConfig(getattr(args, "num_hosts", 1), getattr(args, "host_rank", 0),
                           getattr(args, "coordinator", None))


def start_local_workers(args: argparse.Namespace) -> list[subprocess.Popen]:
    """`--distributed-executor-backend mp`: this process becomes rank 0 of a job of one process per
    GPU on this machine, and ranks 1..N-1 start as the same command line (`python -m
    args.prog_module *args.argv`, which the command-line entry points record) plus the
    multi-host flags. Each process sees one GPU (CUDA_VISIBLE_DEVICES), so each launches a
    single-device program, which costs the host less to launch than one program over every
    device (docs/parallelism.md). Returns the children, [] when there is nothing to start.
    Call before anything touches a device; `args` is updated to rank 0's multi-host settings."""
    if getattr(args, "distributed_executor_backend", "uni") != "mp":
        return []
    n = args.tensor_parallel_size
    if args.num_hosts != 1:
        raise ValueError("--distributed-executor-backend mp starts the processes of one machine itself; "
                         "across hosts, start one process per host with --num-hosts (backend 'uni')")
    if n == 1:
        return []
    if getattr(args, "argv", None) is None or getattr(args, "prog_module", None) is None:
        raise ValueError("--distributed-executor-backend mp repeats the command line in its workers: "
                         "run it from `jaxengine ...` or `python -m jaxengine.server ...`")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = [g for g in visible.split(",") if g] if visible is not None else [str(i) for i in range(n)]
    if len(gpus) < n:
        raise ValueError(f"--distributed-executor-backend mp with tensor_parallel_size={n} needs {n} GPUs, "
                         f"CUDA_VISIBLE_DEVICES lists {len(gpus)}")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        coordinator = f"127.0.0.1:{sock.getsockname()[1]}"
    children = []
    for rank in range(1, n):
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=gpus[rank])
        flags = ["--distributed-executor-backend", "uni", "--num-hosts", str(n), "--host-rank", str(rank),
                 "--coordinator", coordinator]  # after the user's flags, so they win
        children.append(subprocess.Popen([sys.executable, "-m", args.prog_module, *args.argv, *flags], env=env))
    os.environ["CUDA_VISIBLE_DEVICES"] = gpus[0]
    args.num_hosts, args.host_rank, args.coordinator = n, 0, coordinator
    logger.info("started %d worker processes (one per GPU); coordinator %s", n - 1, coordinator)
    atexit.register(_reap, children)
    return children


def _reap(children: list[subprocess.Popen], timeout_s: float = 60.0) -> None:
    """At rank 0's exit: the workers follow its stop; any still running after `timeout_s` are ended.

    A worker's own exit waits for every process at jax.distributed's shutdown barrier, so rank 0
    takes its part there first (jax's exit hook, registered at import, would only run after this
    one and find it done)."""
    jax.distributed.shutdown()
    deadline = time.monotonic() + timeout_s
    for c in children:
        try:
            c.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            c.kill()


def initialize(mh: MultiHostConfig) -> None:
    """Joins the job (blocks until every process has). Call before anything touches a device."""
    if not mh.enabled:
        return
    # CPU processes exchange collectives over gloo (TCP); GPUs use NCCL regardless of this.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    logger.info("joining a %d-process job as rank %d (coordinator %s)", mh.num_hosts, mh.host_rank, mh.coordinator)
    jax.distributed.initialize(coordinator_address=mh.coordinator, num_processes=mh.num_hosts,
                               process_id=mh.host_rank)
    logger.info("job ready: %d devices over %d processes, %d local", jax.device_count(), jax.process_count(),
                jax.local_device_count())


def is_leader() -> bool:
    return jax.process_index() == 0


def agree_min(value: int) -> int:
    """The smallest of every process's `value` (the same answer on all of them)."""
    if jax.process_count() == 1:
        return value
    from jax.experimental import multihost_utils
    return int(np.min(multihost_utils.process_allgather(np.asarray([value], np.int32))))


# ("add", request_id, prompt, params, arrival_time, lora_request) | ("abort", request_id) | ("stop",)
Event = tuple


class StepChannel:
    """Process 0 -> every process: one engine iteration's events, pickled and broadcast through a
    collective. Payloads are padded to powers of two, so only a handful of shapes ever compile.
    The job's processes trust each other (they run one program); this is not a network protocol."""

    MIN_BYTES = 256

    def __init__(self) -> None:
        from jax.experimental import multihost_utils
        self._broadcast = multihost_utils.broadcast_one_to_all
        self.leader = is_leader()

    def exchange(self, events: list[Event] | None = None) -> list[Event]:
        """Leader: sends `events` and returns them. Others: pass nothing, get the leader's."""
        payload = pickle.dumps(list(events or [])) if self.leader else b""
        n = int(self._broadcast(np.asarray([len(payload)], np.int32))[0])
        size = max(self.MIN_BYTES, 1 << (n - 1).bit_length())
        buf = np.zeros(size, np.uint8)
        if self.leader:
            buf[:n] = np.frombuffer(payload, np.uint8)
        data = np.asarray(self._broadcast(buf))
        if self.leader:
            return list(events or [])
        return pickle.loads(data[:n].tobytes())


def apply_events(engine: LLMEngine, events: list[Event]) -> bool:
    """Applies the leader's events to this process's engine; False once told to stop."""
    for ev in events:
        if ev[0] == "add":
            _, request_id, prompt, params, arrival, lora_request = ev
            engine.add_request(request_id, prompt, params, arrival_time=arrival, lora_request=lora_request)
        elif ev[0] == "abort":
            engine.abort_request(ev[1])
        elif ev[0] == "stop":
            return False
        else:
            raise RuntimeError(f"unknown step event {ev[0]!r}")
    return True


def run_follower(engine: LLMEngine, channel: StepChannel) -> int:
    """A non-zero rank's serving loop: the leader's events, then the same step, until it stops."""
    engine.emit_unfinished = True  # as the server's engine: output processing stays identical
    logger.info("rank %d following rank 0's steps", jax.process_index())
    while apply_events(engine, channel.exchange()):
        if engine.has_unfinished_requests():
            engine.step()
    logger.info("rank %d: rank 0 stopped serving; exiting", jax.process_index())
    return 0
