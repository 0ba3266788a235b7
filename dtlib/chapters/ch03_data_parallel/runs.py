"""Running the DDP variants side by side: against one process, and against each other.

The rank functions here are what the chapter's cells, the tests and the benchmark launch
with :func:`dtlib.runtime.launch.spawn` (they must be importable, so they live in dtlib, not in
the notebook):

- :func:`reference_training`: one process, the whole global batch (the truth);
- :func:`train_replica`: one rank of a data-parallel run of the same training;
- :func:`measure_step`: median step time, all-reduce calls and bytes of one variant;
- :func:`record_timeline`: when each gradient was ready and each bucket travelled.

Variants: the teaching modes of :class:`dtlib.data_parallel.DataParallel` and
``"torch"`` (``torch.nn.parallel.DistributedDataParallel``).

Taught in: Chapter 3, "Equal to one process" and "Three DDPs and torch's".
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from dtlib.runtime import dist as ddist
from dtlib.data_parallel.ddp import MODES, DataParallel
from dtlib.models.gpt import GPTConfig, build_gpt, token_batch
from dtlib.models.reference import reference_gpt_run as reference_training
from dtlib.models.reference import grads_of, params_of, train_reference

VARIANTS = (*MODES, "torch")
#: A GPT small enough that 4 ranks train it for 5 steps in well under a second.
from dtlib.models.sizes import size

TINY = size("tiny")


def wrap(module: nn.Module, variant: str, bucket_cap_mb: float = 25.0,
         timeline: bool = False) -> nn.Module:
    """Wrap ``module`` (already on this rank's device) in the DDP ``variant``.

    Args:
        module: the replica.
        variant: one of :data:`VARIANTS`.
        bucket_cap_mb: bucket size cap for every bucketed variant, torch's included.
        timeline: record events (teaching variants only).
    Returns:
        The wrapped model; ``.module`` is the replica.
    """
    if variant == "torch":
        device = next(module.parameters()).device
        ids = [device.index] if device.type == "cuda" else None
        return DistributedDataParallel(module, device_ids=ids,
                                       bucket_cap_mb=bucket_cap_mb)
    if variant not in MODES:
        raise ValueError(f"variant={variant!r} is not allowed; allowed: {VARIANTS}")
    return DataParallel(module, mode=variant, bucket_cap_mb=bucket_cap_mb,
                        timeline=timeline)


def _loss(model: nn.Module, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return model(idx, targets)[1]



def train_replica(cfg: GPTConfig, variant: str, micro_batch: int, steps: int,
                  lr: float = 1e-3, seed: int = 0, bucket_cap_mb: float = 25.0
                  ) -> dict[str, Any]:
    """One rank of data-parallel training; rank r takes rows ``r*b .. (r+1)*b - 1``.

    The global batch of step k is ``token_batch(cfg, world_size * micro_batch, k)``, the
    batch :func:`reference_training` uses, so the results must match it.

    Returns:
        Like :func:`reference_training` (the loss is this rank's micro-batch loss).
    """
    world = ddist.world()
    model = wrap(build_gpt(cfg, seed).to(world.device), variant, bucket_cap_mb)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    rows = slice(world.rank * micro_batch, (world.rank + 1) * micro_batch)
    out: dict[str, Any] = {"losses": []}
    for step in range(steps):
        idx, targets = token_batch(cfg, world.world_size * micro_batch, seed=step,
                                   device=world.device)
        loss = _loss(model, idx[rows], targets[rows])
        loss.backward()  # gradients are averaged across ranks when this returns
        if step == 0:
            out["grads"] = grads_of(model.module)
        opt.step()
        opt.zero_grad(set_to_none=True)
        out["losses"].append(loss.item())
    out["params"] = params_of(model.module)
    return out


def measure_step(cfg: GPTConfig, variant: str, micro_batch: int, steps: int = 10,
                 warmup: int = 2, bucket_cap_mb: float = 25.0) -> dict[str, Any]:
    """Time ``steps`` training steps of ``variant`` on this rank; count one step's comms.

    The counted step runs first and is not timed (the accounting wrapper costs a little).
    Each timed step ends with a barrier so the slowest rank sets the time.

    Returns:
        ``variant``, ``world_size``, ``n_params``, ``step_time_s`` (median),
        ``allreduce_calls`` and ``allreduce_bytes`` (one step, this rank).
    """
    from dtlib.collectives.accounting import count_comms, ddp_comm_hook_accounting

    world = ddist.world()
    model = wrap(build_gpt(cfg).to(world.device), variant, bucket_cap_mb)
    if variant == "torch":
        ddp_comm_hook_accounting(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    idx, targets = token_batch(cfg, micro_batch, seed=world.rank, device=world.device)

    def step() -> None:
        _loss(model, idx, targets).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    # torch DDP rebuilds its buckets after the first step: count a later one.
    for _ in range(max(1, warmup)):
        step()
    with count_comms(functional=False) as log:
        step()
    times = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        step()
        if world.device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()
        times.append(time.perf_counter() - start)
    n_params = sum(p.numel() for p in model.module.parameters())
    return {"variant": variant, "world_size": world.world_size, "n_params": n_params,
            "step_time_s": statistics.median(times),
            "allreduce_calls": log.calls("all_reduce"),
            "allreduce_bytes": log.total_bytes("all_reduce")}


def compare_variants(cfg: GPTConfig, micro_batch: int, steps: int = 10,
                     warmup: int = 2, bucket_cap_mb: float = 25.0,
                     variants: tuple[str, ...] = VARIANTS) -> list[dict[str, Any]]:
    """:func:`measure_step` for each variant in turn, in one launch (rank function)."""
    return [measure_step(cfg, v, micro_batch, steps, warmup, bucket_cap_mb)
            for v in variants]


def record_timeline(cfg: GPTConfig, micro_batch: int, bucket_cap_mb: float,
                    steps: int = 3) -> dict[str, Any]:
    """Run the overlapped DDP with its timeline on; return the last step's events.

    Returns:
        ``{"events": [(name, index, seconds since the step's forward started)],
        "buckets": [parameter count per bucket], "rank": r}``.
    """
    world = ddist.world()
    model = wrap(build_gpt(cfg).to(world.device), "overlapped", bucket_cap_mb,
                 timeline=True)
    idx, targets = token_batch(cfg, micro_batch, seed=world.rank, device=world.device)
    for _ in range(steps):
        model.events.clear()
        dist.barrier()
        _loss(model, idx, targets).backward()
        model.zero_grad(set_to_none=True)
    t0 = model.events[0][2]
    return {"events": [(n, i, t - t0) for n, i, t in sorted(model.events,
                                                             key=lambda e: e[2])],
            "buckets": [len(b.params) for b in model.buckets], "rank": world.rank}


def accumulation_comms(cfg: GPTConfig, micro_batch: int, accum_steps: int,
                       use_no_sync: bool, mode: str = "bucketed") -> dict[str, int]:
    """All-reduce calls and bytes of one gradient-accumulation step on this rank.

    With ``use_no_sync`` every micro-batch but the last runs inside ``no_sync()``: one
    synchronisation per step instead of one per micro-batch (ERRATA 31).

    Taught in: Chapter 3, "no_sync and gradient accumulation".
    """
    from contextlib import nullcontext

    from dtlib.collectives.accounting import count_comms

    world = ddist.world()
    model = wrap(build_gpt(cfg).to(world.device), mode)
    with count_comms(functional=False) as log:
        for k in range(accum_steps):
            idx, targets = token_batch(cfg, micro_batch, seed=100 * world.rank + k,
                                       device=world.device)
            quiet = use_no_sync and k < accum_steps - 1
            with model.no_sync() if quiet else nullcontext():
                (_loss(model, idx, targets) / accum_steps).backward()
    return {"calls": log.calls("all_reduce"), "bytes": log.total_bytes("all_reduce")}
