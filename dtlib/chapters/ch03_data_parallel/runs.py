"""Running the DDP variants side by side: against one process, and against each other.

The rank functions here are what the chapter's cells, the tests and the benchmark launch
with :func:`dtlib.runtime.launch.spawn` (they must be importable, so they live in
dtlib, not in the notebook):

- :func:`reference_gpt_run`: one process, the whole global batch (the truth);
- :func:`train_replica`: one rank of a data-parallel run of the same training;
- :func:`measure_step`: median step time, all-reduce calls and bytes of one variant;
- :func:`record_timeline`: when each gradient was ready and each bucket travelled.

Variants: the teaching variants of :class:`dtlib.data_parallel.DataParallel` and
``"torch"`` (``torch.nn.parallel.DistributedDataParallel``), each a
:func:`dtlib.data_parallel.parallelism` of the one loop,
:func:`dtlib.models.run.run_steps`.

Taught in: Chapter 3, "Equal to one process" and "Three DDPs and torch's".
"""

from __future__ import annotations

import statistics
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from dtlib.collectives.accounting import CountComms, count_comms
from dtlib.data_parallel import VARIANTS, parallelism
from dtlib.models.gpt import GPTConfig, build_gpt, token_batch
from dtlib.models.reference import gpt_batches, grads_of, reference_gpt_run
from dtlib.models.run import (OnStepEnd, RunConfig, RunResult, TrainState, gpt_loss,
                              run_steps)
from dtlib.models.sizes import size
from dtlib.runtime import dist as ddist

__all__ = ["VARIANTS", "TINY", "reference_gpt_run", "grads_of", "wrap",
           "train_replica", "train_variants", "measure_step", "compare_variants",
           "record_timeline", "accumulation_comms"]

#: A GPT small enough that 4 ranks train it for 5 steps in well under a second.
TINY = size("tiny")


def wrap(module: nn.Module, variant: str, bucket_cap_mb: float = 25.0,
         timeline: bool = False) -> nn.Module:
    """Wrap ``module`` in the DDP ``variant`` (on this rank's device).

    Args:
        module: the replica.
        variant: one of :data:`VARIANTS`.
        bucket_cap_mb: bucket size cap for every bucketed variant, torch's included.
        timeline: record events (teaching variants only).
    Returns:
        The wrapped model; ``.module`` is the replica.

    Taught in: Chapter 3, "Three DDPs and torch's".
    """
    return parallelism(variant, bucket_cap_mb=bucket_cap_mb,
                       timeline=timeline).apply(module)


def train_replica(cfg: GPTConfig, variant: str, micro_batch: int, steps: int,
                  lr: float = 1e-3, seed: int = 0, bucket_cap_mb: float = 25.0,
                  optimizer_class: type = torch.optim.AdamW,
                  **optimizer_kwargs: Any) -> RunResult:
    """One rank of data-parallel training; rank r takes rows ``r*b .. (r+1)*b - 1``.

    The global batch of step k is ``token_batch(cfg, world_size * micro_batch, k)``, the
    batch :func:`reference_gpt_run` uses, so the results must match it: the one
    loop, with the DDP's Parallelism instead of the identity.

    Args:
        cfg: the GPT.
        variant: one of :data:`VARIANTS`.
        micro_batch: rows per rank (``b``).
        steps: optimizer steps.
        lr, optimizer_class, optimizer_kwargs: the optimizer (AdamW by default; the
            proofs of a trajectory use SGD with momentum).
        seed: ``build_gpt``'s seed (every rank the same).
        bucket_cap_mb: bucket size cap (MiB).
    Returns:
        A :class:`~dtlib.models.run.RunResult` like :func:`reference_gpt_run`'s
        (losses of the global batch, step-0 gradients, final parameters).

    Taught in: Chapter 3, "Equal to one process".
    """
    par = parallelism(variant, bucket_cap_mb=bucket_cap_mb)
    return run_steps(par, build_gpt(cfg, seed),
                     gpt_batches(cfg, par.dp_size * micro_batch),
                     RunConfig(steps, optimizer_class=optimizer_class,
                               optimizer_kwargs={"lr": lr, **optimizer_kwargs}))


def train_variants(cfg: GPTConfig, micro_batch: int, steps: int,
                   variants: tuple[str, ...] = VARIANTS, **kwargs: Any
                   ) -> dict[str, RunResult]:
    """:func:`train_replica` for each variant in turn, in one launch (rank function).

    Returns:
        ``{variant: RunResult}``.

    Taught in: Chapter 3, "Equal to one process".
    """
    out = {}
    for variant in variants:
        dist.barrier()
        out[variant] = train_replica(cfg, variant, micro_batch, steps, **kwargs)
    return out


def measure_step(cfg: GPTConfig, variant: str, micro_batch: int, steps: int = 10,
                 warmup: int = 2, bucket_cap_mb: float = 25.0) -> dict[str, Any]:
    """Time ``steps`` steps of ``variant`` on this rank; count one step's comms.

    One run of the one loop: ``warmup`` untimed steps (torch DDP rebuilds its buckets
    after the first), one counted step (not timed: the accounting wrapper costs a
    little), then the timed steps. Each step ends in the all-reduce of the logged
    loss and is followed by a barrier, so the slowest rank sets the time.

    Returns:
        ``variant``, ``world_size``, ``n_params``, ``step_time_s`` (median),
        ``allreduce_calls`` and ``allreduce_bytes`` (one step, this rank).

    Taught in: Chapter 3, "Counting the messages".
    """
    world = ddist.world()
    warmup = max(1, warmup)
    par = parallelism(variant, bucket_cap_mb=bucket_cap_mb)
    model = par.apply(build_gpt(cfg))
    batch = token_batch(cfg, micro_batch, seed=world.rank, device=world.device)
    config = RunConfig(warmup + 1 + steps, optimizer_kwargs={"lr": 1e-4},
                       local_batches=True, record_grads=False, record_params=False)
    callbacks = [CountComms(warmup + 1),  # the first step after the warm-up
                 OnStepEnd(lambda end: dist.barrier())]
    run = run_steps(par, None, lambda step: batch, config, TrainState(model),
                    callbacks)
    log = run.comms
    n_params = sum(p.numel() for p in model.module.parameters())
    return {"variant": variant, "world_size": world.world_size, "n_params": n_params,
            "step_time_s": statistics.median(run.step_times[warmup + 1:]),
            "allreduce_calls": log.calls("all_reduce"),
            "allreduce_bytes": log.total_bytes("all_reduce")}


def compare_variants(cfg: GPTConfig, micro_batch: int, steps: int = 10,
                     warmup: int = 2, bucket_cap_mb: float = 25.0,
                     variants: tuple[str, ...] = VARIANTS) -> list[dict[str, Any]]:
    """On every rank: :func:`measure_step` for each variant in turn, in one launch."""
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
        gpt_loss(model, idx, targets).backward()
        model.zero_grad(set_to_none=True)
    t0 = model.events[0][2]
    return {"events": [(n, i, t - t0) for n, i, t in sorted(model.events,
                                                             key=lambda e: e[2])],
            "buckets": [len(b.params) for b in model.buckets], "rank": world.rank}


def accumulation_comms(cfg: GPTConfig, micro_batch: int, accum_steps: int,
                       use_no_sync: bool, variant: str = "bucketed") -> dict[str, int]:
    """All-reduce calls and bytes of one gradient-accumulation step on this rank.

    With ``use_no_sync`` every micro-batch but the last runs inside ``no_sync()``: one
    synchronisation per step instead of one per micro-batch (ERRATA 31).

    Taught in: Chapter 3, "no_sync and gradient accumulation".
    """
    from contextlib import nullcontext

    world = ddist.world()
    model = wrap(build_gpt(cfg).to(world.device), variant)
    with count_comms() as log:
        for k in range(accum_steps):
            idx, targets = token_batch(cfg, micro_batch, seed=100 * world.rank + k,
                                       device=world.device)
            quiet = use_no_sync and k < accum_steps - 1
            with model.no_sync() if quiet else nullcontext():
                (gpt_loss(model, idx, targets) / accum_steps).backward()
    return {"calls": log.calls("all_reduce"), "bytes": log.total_bytes("all_reduce")}
