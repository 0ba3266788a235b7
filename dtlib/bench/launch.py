"""Launch cost: what starting ranks costs, the book's main time sink.

``python -m dtlib.bench launch [--nproc 4] [--repeats 3]`` times a hello-world (join the
group, one all-reduce, leave) started three ways: ``torchrun`` (every rank imports
torch: the real launcher, multi-node capable), ``spawn`` cold (the first call in a
process starts a fork server that imports torch once), and ``spawn`` warm (ranks fork
from that server). Ratios are against torchrun measured in the same run.

Taught in: Chapter 0 (why chapters group their multi-rank demos into few launches).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import textwrap
import time
from typing import Any

import torch
import torch.distributed as dist

from dtlib.runtime import launch
from dtlib.runtime.dist import world

HELLO = textwrap.dedent("""
    import torch, torch.distributed as dist
    from dtlib.runtime import dist as ddist
    world = ddist.init()
    t = torch.ones(1, device=world.device)
    dist.all_reduce(t)
""")


def hello() -> float:
    """What each spawned rank runs: one all-reduce; returns the sum (= world size)."""
    t = torch.ones(1, device=world().device)
    dist.all_reduce(t)
    return t.item()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nproc", type=int, default=4, help="ranks per launch")
    parser.add_argument("--repeats", type=int, default=3, help="launches per way")


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    if args.nproc < 1 or args.repeats < 1:
        raise ValueError(f"--nproc={args.nproc} and --repeats={args.repeats} "
                         "must be >= 1")
    fd, script = tempfile.mkstemp(suffix=".py", prefix="hello_")
    with os.fdopen(fd, "w") as f:
        f.write(HELLO)
    times: dict[str, list[float]] = {"torchrun": [], "spawn (cold)": [],
                                     "spawn (warm)": []}
    try:
        for _ in range(args.repeats):
            times["torchrun"].append(
                launch.torchrun(script, nproc=args.nproc, stream=False).wall_s)
        start = time.perf_counter()
        launch.spawn(hello, args.nproc, stream=False)  # starts the fork server
        times["spawn (cold)"].append(time.perf_counter() - start)
        for _ in range(args.repeats):
            start = time.perf_counter()
            values = launch.spawn(hello, args.nproc, stream=False)
            times["spawn (warm)"].append(time.perf_counter() - start)
        assert values == [float(args.nproc)] * args.nproc
    finally:
        os.unlink(script)
    base = statistics.median(times["torchrun"])
    return [{"launcher": name, "nproc": args.nproc, "runs": len(ts),
             "wall_s": statistics.median(ts),
             "ratio_to_torchrun": statistics.median(ts) / base}
            for name, ts in times.items()]
