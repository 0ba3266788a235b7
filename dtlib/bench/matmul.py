"""Matmul throughput per dtype (TFLOP/s), as ratios to fp32 measured in the same run.

``python -m dtlib.bench matmul [--sizes 256 512] [--dtypes fp32 bf16 fp16]`` times
square ``n x n @ n x n`` products on ``world().device``: warm-up calls first (library
initialisation and autotuning stay out of the timing), then ``--iters`` timed calls per
repeat, synchronised on accelerators, the median repeat kept. FLOP/s = 2 n^3 / t. On
CUDA, ``tf32`` is fp32 with TF32 tensor cores allowed, and every record says whether
TF32 was allowed for the fp32 row.

Taught in: Chapter 7, "Is 16-bit faster here?".
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from dtlib.precision.formats import fp32_matmul_precision
from dtlib.runtime.dist import world

DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16,
          "fp16": torch.float16}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``python -m dtlib.bench matmul``."""
    parser.add_argument("--sizes", type=int, nargs="+", default=None,
                        help="square sizes n (default: 128 256 CPU, 1024 4096 GPU)")
    parser.add_argument("--dtypes", nargs="+", default=None, choices=tuple(DTYPES),
                        help="dtypes (default: fp32 bf16 fp16, plus tf32 on CUDA)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls first")
    parser.add_argument("--iters", type=int, default=10, help="calls per timed repeat")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats (median)")


def _sync(device: torch.device) -> None:
    # Kernels launch asynchronously on accelerators: wait before reading the clock.
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_matmul(n: int, dtype: torch.dtype, device: torch.device, warmup: int = 3,
                iters: int = 10, repeats: int = 5) -> float:
    """Median seconds of one ``n x n @ n x n`` product in ``dtype`` on ``device``.

    Taught in: Chapter 7, "Is 16-bit faster here?".
    """
    for name, v in (("n", n), ("iters", iters), ("repeats", repeats)):
        if v < 1:
            raise ValueError(f"{name}={v!r} must be >= 1")
    if warmup < 0:
        raise ValueError(f"warmup={warmup!r} must be >= 0")
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=gen).to(device=device, dtype=dtype)
    b = torch.randn(n, n, generator=gen).to(device=device, dtype=dtype)
    for _ in range(warmup):
        torch.mm(a, b)
    _sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            torch.mm(a, b)
        _sync(device)
        times.append((time.perf_counter() - t0) / iters)
    return statistics.median(times)


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """One record per (size, dtype): time_s, tflops, ratio_to_fp32 (speed-up).

    Taught in: Chapter 7, "Is 16-bit faster here?".
    """
    device = world().device
    on_cuda = device.type == "cuda"
    sizes = getattr(args, "sizes", None) or ([1024, 4096] if on_cuda else [128, 256])
    dtypes = getattr(args, "dtypes", None) or (
        ["fp32", "tf32", "bf16", "fp16"] if on_cuda else ["fp32", "bf16", "fp16"])
    unknown = [d for d in dtypes if d not in DTYPES]
    if unknown:
        raise ValueError(f"--dtypes {unknown} unknown; allowed: {tuple(DTYPES)}")
    if not on_cuda and "tf32" in dtypes:
        dtypes = [d for d in dtypes if d != "tf32"]  # an NVIDIA tensor-core mode
    order = ["fp32"] + [d for d in dtypes if d != "fp32"]  # the baseline, same run
    warmup, iters = getattr(args, "warmup", 3), getattr(args, "iters", 10)
    repeats = getattr(args, "repeats", 5)
    records = []
    for n in sizes:
        base = None
        for name in order:
            saved = fp32_matmul_precision()
            if on_cuda:
                fp32_matmul_precision("tf32" if name == "tf32" else "ieee")
            try:
                t = time_matmul(n, DTYPES[name], device, warmup, iters, repeats)
                tf32 = fp32_matmul_precision() == "tf32" if on_cuda else None
            finally:
                fp32_matmul_precision(saved)
            tflops = 2 * n ** 3 / t / 1e12
            base = tflops if name == "fp32" else base
            if name in dtypes:
                records.append({"dtype": name, "size": n, "time_s": t, "tflops": tflops,
                                "ratio_to_fp32": tflops / base, "device": str(device),
                                "tf32_allowed": "n/a" if tf32 is None else tf32,
                                "fp32_precision": torch.get_float32_matmul_precision()})
    return records
