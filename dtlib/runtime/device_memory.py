"""Memory of this rank's device, with honest names: allocator bytes on CUDA,
resident bytes on a CPU (where the "device" is the whole process).

Not part of the world (:mod:`dtlib.runtime.dist` chooses rank, device and backend);
it only asks the world for the default device.

Taught in: Chapter 0 (ERRATA 6: the seed's ``print_gpu_stats``); used by Chapter 1 to
check the memory formulas and by the GPU suite.
"""

from __future__ import annotations

import resource
import sys
from dataclasses import dataclass

import torch

from dtlib.runtime.dist import world

__all__ = ["MemoryStats", "memory_stats"]


@dataclass(frozen=True)
class MemoryStats:
    """Memory of one device, with honest names.

    device: ``"cpu"`` or ``"cuda:i"``.
    current_bytes: in use now (CPU: resident set size; CUDA: allocated by tensors).
    peak_bytes: the most in use since start or the last reset (CPU: peak RSS).
    reserved_bytes: CUDA only, held by the caching allocator now (None on CPU).
    peak_reserved_bytes: CUDA only, the most the allocator held (None on CPU).
    """

    device: str
    current_bytes: int
    peak_bytes: int
    reserved_bytes: int | None = None
    peak_reserved_bytes: int | None = None

    def __str__(self) -> str:
        gib = 2**30
        text = (f"{self.device}: current {self.current_bytes / gib:.3f} GiB, "
                f"peak {self.peak_bytes / gib:.3f} GiB")
        if self.reserved_bytes is not None:
            text += (f", reserved {self.reserved_bytes / gib:.3f} GiB "
                     f"(peak {self.peak_reserved_bytes / gib:.3f} GiB)")
        return text


def _rss_bytes() -> tuple[int, int]:
    try:
        import psutil

        current = psutil.Process().memory_info().rss
    except ImportError:  # pragma: no cover - psutil is a dependency
        current = 0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes.
    peak = peak if sys.platform == "darwin" else peak * 1024
    return current, max(peak, current)


def memory_stats(device: torch.device | str | None = None) -> MemoryStats:
    """Current and peak memory of ``device`` (default: this rank's device).

    On CUDA the numbers come from the caching allocator; on CPU from the process's
    resident set size, since a CPU "device" is the whole process.

    Taught in: Chapter 0; used by Chapter 1 to check the memory formulas.
    """
    device = torch.device(device) if device is not None else world().device
    if device.type == "cuda":
        return MemoryStats(
            device=str(device),
            current_bytes=torch.cuda.memory_allocated(device),
            peak_bytes=torch.cuda.max_memory_allocated(device),
            reserved_bytes=torch.cuda.memory_reserved(device),
            peak_reserved_bytes=torch.cuda.max_memory_reserved(device),
        )
    if device.type != "cpu":
        raise ValueError(f"device={device} is not supported; allowed: cpu, cuda:i")
    current, peak = _rss_bytes()
    return MemoryStats(device="cpu", current_bytes=current, peak_bytes=peak)
