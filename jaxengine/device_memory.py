"""The GPU backend's memory set-up, chosen before JAX starts its backend, and the memory budget
the KV cache is sized from.

Two settings are made through the environment, because JAX reads them once, when its GPU client
is created:

- The pool (`XLA_PYTHON_CLIENT_MEM_FRACTION`): `gpu_memory_utilization` of the card, as vLLM's
  flag means (`size_device_pool`).
- Stable temporaries for the step's command buffers (`use_stable_temp`): XLA replays each program
  as CUDA graphs, but updates every command whose buffers moved since the last call, and by
  default a program's temp buffer moves on every call, so every command is updated on every
  step. `--xla_gpu_command_buffer_update_mode=SKIP_TEMP` with JAX's VMM allocator
  (`XLA_PYTHON_CLIENT_ALLOCATOR=vmm`) keeps each temp at one virtual address, and XLA then skips
  the commands that touch only temporaries (docs/design.md, "The launch of a step"). The VMM
  allocator reports no memory statistics, so the budget then comes from the card itself
  (`card_memory`, NVIDIA's NVML through `pynvml`).

The user's own settings always stand: any XLA_PYTHON_CLIENT_ALLOCATOR, or an XLA_FLAGS that names
the update mode, turns the default off (`XLA_PYTHON_CLIENT_ALLOCATOR=default` keeps JAX's own).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import os

logger = logging.getLogger(__name__)

JAX_DEFAULT_POOL_FRACTION = 0.75  # XLA_PYTHON_CLIENT_MEM_FRACTION's default on GPUs
POOL_HEADROOM = 0.1  # share of the budget left free for XLA's compile-time scratch
STABLE_TEMP_FLAG = "--xla_gpu_command_buffer_update_mode=SKIP_TEMP"
STABLE_TEMP_MIN_JAXLIB = (0, 11, 2)  # the first release measured with the mode (docs/design.md)
CUDA_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin")


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


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


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def stable_temp_blocker(tensor_parallel_size: int) -> str | None:
    """Why the stable-temp default cannot be used in this process (None: it can)."""
    import jaxlib

    if "XLA_PYTHON_CLIENT_ALLOCATOR" in os.environ:
        return f"XLA_PYTHON_CLIENT_ALLOCATOR={os.environ['XLA_PYTHON_CLIENT_ALLOCATOR']} is set"
    if "command_buffer_update_mode" in os.environ.get("XLA_FLAGS", ""):
        return "XLA_FLAGS sets the command buffer update mode"
    if os.environ.get("JAX_PLATFORMS", "").split(",")[0].strip().lower() in ("cpu", "tpu"):
        return f"JAX_PLATFORMS={os.environ['JAX_PLATFORMS']}"
    if not any(_installed(name) for name in CUDA_PLUGINS):
        return "no CUDA plugin is installed"
    if _version_tuple(jaxlib.__version__) < STABLE_TEMP_MIN_JAXLIB:
        return f"jaxlib {jaxlib.__version__} predates the update mode"
    if tensor_parallel_size != 1:  # NCCL under the VMM allocator is not measured yet
        return "tensor_parallel_size > 1"
    if not _installed("pynvml"):
        return "pynvml (nvidia-ml-py) is not installed, and the KV cache is sized from NVML under this allocator"
    if _backend_started():
        return "the backend has already started"
    return None


def use_stable_temp(tensor_parallel_size: int) -> bool:
    """Selects the VMM allocator and SKIP_TEMP command-buffer updates for this process when
    `stable_temp_blocker` finds nothing against it; returns whether the process runs that way
    (also when the user chose it)."""
    blocker = stable_temp_blocker(tensor_parallel_size)
    if blocker is None:
        os.environ["XLA_PYTHON_CLIENT_ALLOCATOR"] = "vmm"
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {STABLE_TEMP_FLAG}".strip()
        logger.info("GPU: VMM allocator with %s (stable temp buffers in the steps' command buffers)",
                    STABLE_TEMP_FLAG)
        return True
    logger.debug("GPU: stable temp buffers not chosen: %s", blocker)
    return os.environ.get("XLA_PYTHON_CLIENT_ALLOCATOR") == "vmm"


def prepare_gpu_backend(gpu_memory_utilization: float, tensor_parallel_size: int) -> None:
    """The environment JAX's GPU client is made from (nothing happens once the backend started)."""
    size_device_pool(gpu_memory_utilization)
    use_stable_temp(tensor_parallel_size)


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
