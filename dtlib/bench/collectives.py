"""Collectives: algbw and busbw of torch's collectives and the from-scratch rings.

``python -m dtlib.bench collectives [--nproc 4] [--sizes 1K 64K 16M]`` runs, for each op
and size, torch's collective and :mod:`dtlib.collectives`' ring side by side on the same
ranks, in the same run, and reports per record: op, variant ("torch" or "ring"), bytes,
world_size, time_s (slowest rank, median over calls), algbw_GBps = bytes / time,
busbw_GBps = algbw x the nccl-tests factor; plus the ring/torch busbw ratio and a
fitted alpha/beta per (op, variant) (records with ``op`` ending in "_fit").

Taught in: Chapter 2, "The cost model against measurement".
"""

from __future__ import annotations

import argparse
import math
import time
from typing import Any

import torch
import torch.distributed as dist

from dtlib import collectives as col
from dtlib.collectives import cost_model as comm_cost
from dtlib.collectives.cost_model import fit_distrust
from dtlib.runtime import launch
from dtlib.runtime.dist import sync, world

OPS = ("all_reduce", "reduce_scatter", "all_gather")
DEFAULT_SIZES = ("1K", "16K", "256K", "1M", "4M", "16M", "64M")
_UNITS = {"K": 2**10, "M": 2**20, "G": 2**30}


def parse_size(text: str) -> int:
    """'16M' -> 16 MiB in bytes; '4096' -> 4096."""
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    mult = _UNITS.get(text[-1:], 1)
    try:
        value = int(float(text[:-1] if text[-1:] in _UNITS else text) * mult)
    except ValueError:
        raise ValueError(f"size={text!r} is not a size like 4096, 64K or 16M") from None
    if value < 4:
        raise ValueError(f"size={text!r} must be at least 4 bytes (one float32)")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``python -m dtlib.bench collectives``."""
    parser.add_argument("--nproc", type=int, default=4, help="ranks (default 4)")
    parser.add_argument("--sizes", nargs="+", default=list(DEFAULT_SIZES),
                        help="message sizes in bytes, K/M suffixes (default 1K..64M)")
    parser.add_argument("--ops", nargs="+", default=list(OPS), choices=OPS)
    parser.add_argument("--budget", type=float, default=0.3,
                        help="seconds of timed iterations per (op, variant, size)")
    parser.add_argument("--timeout", type=float, default=300.0)


def _torch_call(op: str, x: torch.Tensor, n: int) -> Any:
    if op == "all_reduce":
        return lambda: dist.all_reduce(x)
    if op == "reduce_scatter":
        out = torch.empty(x.numel() // n, dtype=x.dtype, device=x.device)
        return lambda: col.reduce_scatter_into(out, x)
    shard = x[: x.numel() // n].clone()  # message = the gathered tensor, x's size
    return lambda: col.all_gather_into(x, shard)


def _ring_call(op: str, x: torch.Tensor, n: int) -> Any:
    if op == "all_reduce":
        return lambda: col.ring_all_reduce(x)
    if op == "reduce_scatter":
        return lambda: col.ring_reduce_scatter(x)
    shard = x[: x.numel() // n].clone()
    return lambda: col.ring_all_gather(shard)


def time_collectives(sizes: list[int], ops: list[str], budget: float) -> list[dict]:
    """On every rank: time each (op, size, variant); return rank 0's records.

    torch's call and the ring's alternate, each after a barrier, so a load change on a
    shared machine hits both alike; a call's time is the slowest rank's, and the
    record keeps the median over calls. Every rank runs the same number of calls (rank
    0 decides and broadcasts it).
    """
    n, rank = dist.get_world_size(), dist.get_rank()
    dev = world().device  # NCCL needs every buffer, even a timer's, on the GPU
    records = []
    for op in ops:
        for nbytes in sizes:
            numel = max(n, nbytes // 4 // n * n)  # float32, divisible by n
            calls = {variant: make(op, torch.ones(numel, device=dev), n)
                     for variant, make in (("torch", _torch_call),
                                           ("ring", _ring_call))}
            t0 = time.perf_counter()
            for call in calls.values():
                call()  # warm-up: connections, allocations
            sync()
            one = torch.tensor([time.perf_counter() - t0], device=dev)
            dist.all_reduce(one, op=dist.ReduceOp.MAX)
            iters = torch.tensor([max(3, min(100, int(budget / one.item())))],
                                 device=dev)
            dist.broadcast(iters, 0)
            times = {variant: torch.zeros(int(iters.item()), device=dev)
                     for variant in calls}
            for i in range(int(iters.item())):
                for variant, call in calls.items():
                    dist.barrier()
                    sync()  # CUDA: time the work, not the queueing of it
                    t0 = time.perf_counter()
                    call()
                    sync()
                    times[variant][i] = time.perf_counter() - t0
            for variant in calls:
                dist.all_reduce(times[variant], op=dist.ReduceOp.MAX)
                t = times[variant].median().item()
                msg = numel * 4
                algbw = msg / t / 1e9
                records.append({
                    "op": op, "variant": variant, "bytes": msg, "world_size": n,
                    "time_s": t, "algbw_GBps": algbw,
                    "busbw_GBps": algbw * comm_cost.bus_bandwidth_factor(op, n)})
    return records if rank == 0 else []


def fits(records: list[dict]) -> list[dict]:
    """A fitted alpha (us) and 1/beta (GB/s) per (op, variant), and the crossover."""
    out = []
    keys = dict.fromkeys((r["op"], r["variant"], r["world_size"]) for r in records)
    for op, variant, n in keys:
        rs = [r for r in records if (r["op"], r["variant"]) == (op, variant)]
        if n < 2 or len(rs) < 2:
            continue
        alpha, beta = comm_cost.fit_alpha_beta([r["bytes"] for r in rs],
                                               [r["time_s"] for r in rs], op, n)
        cross = comm_cost.latency_bandwidth_crossover(op, n, alpha, beta)
        why = fit_distrust(rs, op, n, alpha, beta)
        out.append({"op": f"{op}_fit", "variant": variant, "world_size": n,
                    "alpha_us": alpha * 1e6,
                    # None, never inf: a term the fit could not see has no value.
                    "link_GBps": (1 / beta / 1e9) if beta > 0 else None,
                    "crossover_bytes": cross if math.isfinite(cross) else None,
                    "trusted": why is None, "why": why})
    return out


def ratios(records: list[dict]) -> list[dict]:
    """ring busbw / torch busbw per (op, bytes), measured in the same run."""
    torch_bw = {(r["op"], r["bytes"]): r["busbw_GBps"] for r in records
                if r["variant"] == "torch"}
    return [{"op": r["op"], "variant": "ring/torch", "bytes": r["bytes"],
             "world_size": r["world_size"],
             "busbw_ratio": r["busbw_GBps"] / torch_bw[(r["op"], r["bytes"])]}
            for r in records
            if r["variant"] == "ring" and (r["op"], r["bytes"]) in torch_bw]


def run(args: argparse.Namespace) -> list[dict]:
    """Benchmark entry point (``python -m dtlib.bench collectives``)."""
    sizes = [parse_size(s) for s in args.sizes]
    if args.nproc < 2:
        raise ValueError(f"--nproc={args.nproc} must be >= 2: one rank sends nothing")
    records = launch.spawn(time_collectives, args.nproc, sizes, list(args.ops),
                           args.budget, timeout=args.timeout, stream=False)[0]
    return records + ratios(records) + fits(records)
