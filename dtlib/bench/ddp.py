"""DDP step time: naive, bucketed, overlapped and torch DDP, as ratios to torch DDP.

``python -m dtlib.bench ddp [--world-size 4] [--steps 5] [--json PATH]`` trains a GPT of
about 10M parameters on gloo ranks with each variant in turn, in one launch, and reports
the median step time of each (the slowest rank's: every timed step ends in a barrier)
and its ratio to torch DDP measured in the same run. Target: overlapped <= 1.2x torch.

Taught in: Chapter 3, "Three DDPs and torch's".
"""

from __future__ import annotations

import argparse
from typing import Any

from dtlib.chapters.ch03_data_parallel.runs import compare_variants
from dtlib.data_parallel import VARIANTS
from dtlib.models.sizes import size
from dtlib.runtime import launch

#: ~9.7M parameters: 4 blocks of width 448 (12 h^2 per block) plus embeddings.
BENCH_CFG = size("bench-ddp")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``python -m dtlib.bench ddp``."""
    parser.add_argument("--world-size", type=int, default=4, help="ranks (default 4)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--micro-batch", type=int, default=2, help="sequences per rank")
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0,
                        help="bucket cap for every bucketed variant (MiB)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds")


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Measure every variant; return one record per variant, with ``ratio_to_torch``."""
    for name in ("world_size", "steps", "micro_batch"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)} "
                             "must be >= 1")
    per_rank = launch.spawn(compare_variants, args.world_size, BENCH_CFG,
                            args.micro_batch, args.steps, args.warmup,
                            args.bucket_cap_mb, VARIANTS, timeout=args.timeout,
                            stream=False)
    records = per_rank[0]  # every rank times the same barrier-bounded steps
    torch_time = next(r["step_time_s"] for r in records if r["variant"] == "torch")
    for r in records:
        r["ratio_to_torch"] = r["step_time_s"] / torch_time
    return records
