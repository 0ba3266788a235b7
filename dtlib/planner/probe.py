"""The inputs that drift, probed beside each step of Chapter 13's timed strategies.

:func:`probe_rate` times, on the ranks that train, what a machine whose speed moves
changes between the start of a launch and a strategy's steps: the GPT's own forward
and backward (rank 0 alone, then every rank at once), AdamW's step, a copy and one
message of each collective. ``drift.machine_at`` prices a timed step with the probes
just before and after it.

Taught in: Chapter 13, "Predicted against measured".
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from dtlib.collectives.algorithms import all_gather_into, reduce_scatter_into
from dtlib.models.gpt import GPTConfig, build_gpt, token_batch
from dtlib.planner.counts import flops_per_iteration
from dtlib.planner.measure import median_call_s, slowest
from dtlib.planner.specs import ModelSpec
from dtlib.runtime import dist as ddist

__all__ = ["COMM_PROBE_BYTES", "COMM_PROBE_CALLS", "Probe", "probe_rate"]

#: The message each probe times every collective on (between a unit and a bucket).
COMM_PROBE_BYTES = 2**20
#: Calls of each collective per probe, the median kept: with more ranks than cores
#: one call's time swings several-fold with when its peers are scheduled.
COMM_PROBE_CALLS = 3


class Probe:
    """What :func:`probe_rate` times again and again, built once per launch: the GPT
    a data-parallel rank trains (its ``global_batch / world_size`` rows) with its
    AdamW, a 4 MiB buffer to copy, and a 1 MiB message for each collective."""

    def __init__(self, cfg: GPTConfig, global_batch: int) -> None:
        dev, rows = ddist.world().device, max(1, global_batch // dist.get_world_size())
        self.model = build_gpt(cfg, seed=0).to(dev)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-6)
        self.batch = token_batch(cfg, rows, seed=0, device=dev)
        self.params = sum(p.numel() for p in self.model.parameters())
        self.src, self.dst = (torch.ones(2**20, device=dev) for _ in range(2))
        n = dist.get_world_size()  # 1 MiB collectives, as Chapter 2's fits time them
        self.x = torch.ones(COMM_PROBE_BYTES // 4 // n * n, device=dev)
        self.out = torch.empty(self.x.numel() // n, device=dev)
        self.comms = {"all_reduce": lambda: dist.all_reduce(self.x),
                      "reduce_scatter": lambda: reduce_scatter_into(self.out, self.x),
                      "all_gather": lambda: all_gather_into(self.x, self.out)}
        for call in self.comms.values():
            call()
        spec = ModelSpec(n_layers=cfg.n_layers, hidden=cfg.hidden,
                         n_heads=cfg.n_heads, vocab_size=cfg.vocab_size,
                         seq_len=cfg.seq_len)
        self.flops = flops_per_iteration(spec, rows, "none")
        self.seconds()  # warm-up, and the optimizer's moments
        self.optimizer_seconds()

    def _timed(self, fn: Any) -> float:
        ddist.sync()
        t0 = time.perf_counter()
        fn()
        ddist.sync()
        return time.perf_counter() - t0

    def seconds(self) -> float:
        """One forward and backward of this rank, in seconds (gradients kept)."""
        self.model.zero_grad(set_to_none=True)
        return self._timed(lambda: self.model(*self.batch)[1].backward())

    def optimizer_seconds(self) -> float:
        """One AdamW step over the GPT's parameters, in seconds."""
        return self._timed(self.opt.step)

    def copy_seconds(self) -> float:
        """One 4 MiB ``copy_``, in seconds."""
        return self._timed(lambda: self.dst.copy_(self.src))


def probe_rate(probe: Probe) -> dict[str, float]:
    """On every rank: the inputs that drift, measured now, as the model uses them.

    Rank 0 alone, while the others wait, times one forward and backward (the
    model's ``flops_per_s``), an AdamW step and a copy; then every rank times one
    forward and backward at once and the slowest counts (each rank's rate while all
    compute: ``Machine.shared``); then each collective on ``comm_bytes``, the
    median of :data:`COMM_PROBE_CALLS` calls (each the slowest rank's).

    Returns:
        ``{"flops": the pass's FLOPs, "alone_s", "all_s": the slowest rank's
        seconds with every rank busy, "optimizer_s_per_param", "copy_s_per_byte",
        "comm_bytes", "all_reduce_s", "reduce_scatter_s", "all_gather_s"}``.

    Taught in: Chapter 13, "Predicted against measured".
    """
    alone = torch.zeros(3, dtype=torch.float64, device=ddist.world().device)
    dist.barrier()
    if dist.get_rank() == 0:
        alone[0] = probe.seconds()
        alone[1] = probe.optimizer_seconds() / probe.params
        alone[2] = probe.copy_seconds() / (probe.dst.numel() * probe.dst.element_size())
    dist.broadcast(alone, 0)
    dist.barrier()
    got = {"flops": float(probe.flops), "alone_s": float(alone[0]),
           "all_s": slowest(probe.seconds()),
           "optimizer_s_per_param": float(alone[1]),
           "copy_s_per_byte": float(alone[2]),
           "comm_bytes": probe.x.numel() * probe.x.element_size()}
    for op, call in probe.comms.items():  # as measure_machine times its sizes
        got[op + "_s"] = median_call_s(call, COMM_PROBE_CALLS)
    return got
