"""The GPU backend's memory: the pool JAX reserves, chosen before JAX starts its backend, and the
budget the KV cache is sized from.

- The pool (`XLA_PYTHON_CLIENT_MEM_FRACTION`) is `gpu_memory_utilization` of the card, as vLLM's
  flag means (`size_device_pool`); JAX reads it once, when its GPU client is created.
- The allocator (`choose_launch_allocator`): on one GPU, JAX's VMM allocator with XLA's SKIP_TEMP
  command-buffer updates, so a step's launch does not rewrite its commands' addresses (see
  docs/design.md, "The launch of a step").
- The budget (`free_for_kv_and_step`) comes from JAX's pool statistics. The VMM allocator reports
  none, so there the card itself is asked, through NVIDIA's NVML (`pynvml`, installed with the
  cuda12/cuda13 extras).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os

JAX_DEFAULT_POOL_FRACTION = 0.75  # XLA_PYTHON_CLIENT_MEM_FRACTION's default on GPUs
POOL_HEADROOM = 0.1  # share of the budget left free for XLA's compile-time scratch


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _gpu_plugin() -> bool:
    """Whether JAX may start a CUDA backend: one of its CUDA plugins is installed and JAX_PLATFORMS
    does not rule GPUs out."""
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms and not any(p.strip() in ("cuda", "gpu") for p in platforms.split(",")):
        return False
    return _installed("jax_cuda12_plugin") or _installed("jax_cuda13_plugin")


def _backend_started() -> bool:
    from jax._src import xla_bridge

    return xla_bridge.backends_are_initialized()


def size_device_pool(gpu_memory_utilization: float) -> None:
    """Sizes JAX's GPU memory pool to `gpu_memory_utilization` of the card, as vLLM's flag means,
    while the backend is not yet started and the user has not set XLA_PYTHON_CLIENT_MEM_FRACTION.

    Why: JAX's pool is 75% of the card by default, and a share of that pool (0.9 x 0.75) would
    leave a quarter of an H100 unused, or refuse a model whose weights fit the card. What stays
    outside the pool serves cuBLAS workspaces, kernel modules and NCCL."""
    if "XLA_PYTHON_CLIENT_MEM_FRACTION" in os.environ or _backend_started():
        return
    os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{gpu_memory_utilization:.4f}"


STABLE_TEMP_FLAG = "--xla_gpu_command_buffer_update_mode=SKIP_TEMP"


def choose_launch_allocator(tensor_parallel_size: int) -> bool:
    """Picks JAX's VMM allocator and XLA's SKIP_TEMP command-buffer updates for a one-device GPU
    engine, while the backend is not yet started; returns whether it did.

    Why: by default a program's temp buffer moves on every call, so XLA updates every command of
    the step's command buffers before each launch. With the VMM allocator the temp stays in
    place and SKIP_TEMP skips those updates: the launch of a small model's step is shorter (the
    SmolLM2-135M shape's throughput higher in every same-machine comparison), a weight-only
    quantized model's decode step loses about 3 ms of device time that the default allocator's
    command-buffer updates cost it, and a large dense model's figures do not move
    (docs/design.md, "The launch of a step"). That allocator reports no memory statistics, so
    the KV cache is then sized through NVML (`free_for_kv_and_step`): without `pynvml` nothing
    is changed.

    Left as it is where the user chose (XLA_PYTHON_CLIENT_ALLOCATOR set, any command-buffer update
    mode in XLA_FLAGS), without a CUDA plugin, on several devices (NCCL with the VMM allocator is
    not measured here), or once the backend has started. `XLA_PYTHON_CLIENT_ALLOCATOR=default`
    keeps JAX's own."""
    if ("XLA_PYTHON_CLIENT_ALLOCATOR" in os.environ or "xla_gpu_command_buffer_update_mode" in
            os.environ.get("XLA_FLAGS", "") or tensor_parallel_size != 1 or not _installed("pynvml")
            or not _gpu_plugin() or _backend_started()):
        return False
    os.environ["XLA_PYTHON_CLIENT_ALLOCATOR"] = "vmm"
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {STABLE_TEMP_FLAG}".strip()
    return True


def device_memory_budget(bytes_limit: int, gpu_memory_utilization: float) -> float:
    """Bytes the engine's weights, KV cache and step may hold on one device:
    `gpu_memory_utilization` of the card, within the pool (`bytes_limit`,
    XLA_PYTHON_CLIENT_MEM_FRACTION of the card), less POOL_HEADROOM. The headroom stays free
    because XLA's autotuning allocates its scratch from the same pool while programs compile (on
    an H100 a compile failed for want of 1 GiB when the budget was the whole pool)."""
    pool_fraction = float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", JAX_DEFAULT_POOL_FRACTION))
    return (1 - POOL_HEADROOM) * min(bytes_limit, bytes_limit / pool_fraction * gpu_memory_utilization)


@dataclasses.dataclass(frozen=True)
class CardMemory:
    """One GPU's memory as its driver reports it (every process's use counts in `used`)."""

    total: int
    used: int


def _nvml_index(local_hardware_id: int) -> int | str:
    """NVML numbers every GPU of the machine; CUDA (and so JAX) only the visible ones."""
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if not visible:
        return local_hardware_id
    if local_hardware_id >= len(visible):
        raise ValueError(f"device {local_hardware_id} is not among CUDA_VISIBLE_DEVICES={visible}")
    entry = visible[local_hardware_id]
    return int(entry) if entry.isdigit() else entry  # an index, or a GPU UUID


def card_memory(device) -> CardMemory:
    """Total and used memory of the GPU behind a JAX device, from NVML."""
    import pynvml

    pynvml.nvmlInit()
    try:
        which = _nvml_index(device.local_hardware_id)
        handle = (pynvml.nvmlDeviceGetHandleByIndex(which) if isinstance(which, int)
                  else pynvml.nvmlDeviceGetHandleByUUID(which))
        info = pynvml.nvmlDeviceGetMemoryInfo(handle)
        return CardMemory(total=int(info.total), used=int(info.used))
    finally:
        pynvml.nvmlShutdown()


def free_for_kv_and_step(device, gpu_memory_utilization: float) -> tuple[float, str] | None:
    """Bytes left for the KV cache and one step on `device` after what it already holds (the
    weights above all), and where the figure came from; None on a backend with no budget (CPU).

    JAX's own allocator reports its pool (`memory_stats`); the VMM allocator reports nothing, so
    the card's memory comes from NVML: `gpu_memory_utilization` of the card, less POOL_HEADROOM,
    less everything in use on it (this process's weights and context, and other processes)."""
    stats = device.memory_stats() or {}
    if "bytes_limit" in stats:
        budget = device_memory_budget(stats["bytes_limit"], gpu_memory_utilization)
        return budget - stats.get("bytes_in_use", 0), "JAX's memory pool"
    if device.platform != "gpu" or not _installed("pynvml"):
        return None
    card = card_memory(device)
    return (1 - POOL_HEADROOM) * gpu_memory_utilization * card.total - card.used, "the card (NVML)"
