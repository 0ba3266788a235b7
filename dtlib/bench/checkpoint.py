"""Checkpoint stall: what a save costs the training loop, synchronous against
``--async-save``, as a ratio measured in one run.

``python -m dtlib.bench checkpoint [--world-size 2] [--strategy fsdp] [--saves 3]
[--json PATH]`` builds the capstone's job (:func:`dtlib.train.job.build_job`; a GPT
of about 3M parameters by default: 38 MB of fp32 parameters and AdamW moments per
checkpoint) on gloo ranks and, for each mode in turn, around each of ``--saves``
saves: the time of ``--steps`` training steps before it, the time the save call
blocks the loop, and the time of the ``--steps`` steps after it (a background
writer competes with them for the CPU and the disk). The stall of a save is its
call plus what the steps after lost: ``call + (after - before)``, the median over
the saves; ``ratio_to_sync`` divides each mode's by the synchronous one's, and
``call_ratio_to_sync`` the blocking call's alone (steadier where other work shares
the cores, as the steps' times then move by more than a save costs). An
asynchronous save still stalls the loop while it copies the state to CPU memory,
and a save that comes before the previous one is written waits for it.

Taught in: Chapter 10, "Crash and resume".
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from typing import Any

import torch.distributed as dist

from dtlib.models.run import run_steps
from dtlib.runtime import dist as ddist
from dtlib.runtime import launch
from dtlib.train.async_save import BackgroundSaver
from dtlib.train.config import parse_args
from dtlib.train.job import Job, build_job
from dtlib.train.state import save_state

MODES = ("sync", "async")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``python -m dtlib.bench checkpoint``."""
    parser.add_argument("--world-size", type=int, default=2, help="ranks (default 2)")
    parser.add_argument("--strategy", default="fsdp", choices=("ddp", "fsdp"),
                        help="ddp or fsdp (both save through DCP; async: "
                        "dcp.async_save)")
    parser.add_argument("--saves", type=int, default=3, help="saves per mode")
    parser.add_argument("--steps", type=int, default=3,
                        help="training steps before and after each save")
    parser.add_argument("--hidden", type=int, default=256, help="GPT width")
    parser.add_argument("--n-layers", type=int, default=4, help="GPT blocks")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds")


def _train(job: Job, start: int, n: int) -> float:
    """Seconds of ``n`` steps from ``start`` through the one loop."""
    ddist.sync()
    t0 = time.perf_counter()
    run_steps(job.par, None, job.batch_fn, job.run_config(start + n, start=start),
              job.train_state)
    ddist.sync()
    return time.perf_counter() - t0


def stalls(argv: list[str], saves: int, steps: int) -> list[dict[str, Any]]:
    """On every rank: one record per mode (rank 0's clock; every step's collectives
    keep the ranks together)."""
    job = build_job(parse_args(argv), ddist.world())
    step = steps
    _train(job, 0, steps)  # warm-up: the first steps allocate and choose kernels
    records = []
    for mode in MODES:
        saver = BackgroundSaver(job) if mode == "async" else None
        calls, lost = [], []
        for _ in range(saves):
            before = _train(job, step, steps)
            step += steps
            dist.barrier()
            t0 = time.perf_counter()
            saver.save(step) if saver is not None else save_state(job, step)
            calls.append(time.perf_counter() - t0)
            lost.append(_train(job, step, steps) - before)
            step += steps
        if saver is not None:
            saver.close()
        records.append({"mode": mode, "saves": saves,
                        "save_call_s": statistics.median(calls),
                        "steps_slowed_s": statistics.median(lost),
                        "stall_s": statistics.median(c + x for c, x in
                                                     zip(calls, lost))})
    return records


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Measure both modes in one launch; return one record per mode."""
    for name in ("world_size", "saves", "steps", "hidden", "n_layers"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)} "
                             "must be >= 1")
    total = args.steps * (1 + 2 * args.saves * len(MODES))
    ckpt = tempfile.mkdtemp(prefix="bench_ckpt_")
    argv = ["--strategy", args.strategy, "--hidden", str(args.hidden), "--n-layers",
            str(args.n_layers), "--steps", str(total), "--ckpt-dir", ckpt]
    try:
        records = launch.spawn(stalls, args.world_size, argv, args.saves, args.steps,
                               timeout=args.timeout, stream=False)[0]
    finally:
        shutil.rmtree(ckpt, ignore_errors=True)
    sync = next(r for r in records if r["mode"] == "sync")
    for r in records:  # the call alone is the steadier figure on a busy machine
        r["call_ratio_to_sync"] = r["save_call_s"] / sync["save_call_s"]
        r["ratio_to_sync"] = r["stall_s"] / sync["stall_s"]
    return records
