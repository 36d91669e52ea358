"""Device, seed, memory and hardware-peak utilities."""

import gc
import os
import random

import numpy as np
import torch

from torchtitan.tools.logging import logger

# Dense bf16 datasheet peaks (FLOP/s) used for MFU; a GPU not listed gets no MFU rather than a made-up one.
_PEAK_BF16_FLOPS = {
    "H200": 989e12,
    "H100 NVL": 835e12,
    "H100 PCIe": 756e12,
    "H100": 989e12,  # SXM
    "A100": 312e12,
    "L40S": 362e12,
    "A10G": 70e12,
}


def device_peak_flops(device: torch.device) -> float | None:
    """Datasheet dense bf16 FLOP/s of this GPU, or None on CPU / unknown GPUs."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, peak in _PEAK_BF16_FLOPS.items():
        if key in name:
            return peak
    logger.warning(f"no datasheet peak for GPU {name!r}: MFU will not be reported")
    return None


def get_device() -> torch.device:
    """The device of this process: cuda:LOCAL_RANK (never the global rank) or cpu."""
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def set_determinism(seed: int, deterministic: bool) -> None:
    """Seeds python, numpy and torch identically on every rank; optionally deterministic kernels."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


class GarbageCollection:
    """Disables automatic GC and collects every `freq` steps, so pauses land at known steps (TorchTitan)."""

    def __init__(self, freq: int):
        self.freq = freq
        gc.disable()
        gc.collect(1)

    def run(self, step: int) -> None:
        if self.freq > 0 and step % self.freq == 0:
            gc.collect(1)


def peak_memory_gib(device: torch.device) -> dict[str, float]:
    """Peak active and reserved CUDA memory since the last reset, in GiB; empty on CPU."""
    if device.type != "cuda":
        return {}
    stats = torch.cuda.memory_stats(device)
    gib = 1024**3
    return {
        "memory_peak_active_gib": stats.get("active_bytes.all.peak", 0) / gib,
        "memory_peak_reserved_gib": stats.get("reserved_bytes.all.peak", 0) / gib,
    }


def settle_sdpa_priority(device: torch.device) -> None:
    """Lets PyTorch make its one-time choice of attention-kernel priority now, before ours is set.

    On its first CUDA attention call, PyTorch (cuDNN >= 9.9 on sm90/sm100) replaces the global SDPA priority with
    cuDNN first, over whatever an enclosing `sdpa_kernel(..., set_priority=True)` had set. The first training step
    would then run another kernel than configured, and activation checkpointing, which recomputes attention in
    backward under the configured priority again, would get other saved tensors than forward kept and raise
    (seen on an H100 with `model.sdpa_backends = ["flash", "cudnn"]`). One call here spends that choice.
    """
    if device.type == "cuda":
        q = torch.randn(1, 1, 8, 64, device=device, dtype=torch.bfloat16)
        torch.nn.functional.scaled_dot_product_attention(q, q, q)


def rank0_error(error: str) -> str:
    """Rank 0's error message (or ""), on every rank: a check only rank 0 makes (a file lock, loading the sample
    decoder) then stops every rank alike instead of leaving the others waiting in a collective."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    return error
