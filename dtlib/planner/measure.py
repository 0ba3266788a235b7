"""Measuring the machine for Chapter 13's step-time model: what each input is and
how it is taken on the ranks that will train.

- :func:`measure_machine`: matmul FLOP/s (one rank alone, the best window as the roof,
  then every rank at once), the GPT's own forward-and-backward FLOP/s, the optimizer's
  seconds per parameter, a memory copy's seconds per byte, and Chapter 2's
  alpha-beta fit of each collective (guarded by
  :func:`dtlib.collectives.cost_model.fit_distrust`);
- :func:`machine_from`: the pure model's :class:`~dtlib.planner.machine.Machine`
  from those measurements (``probe.py`` re-takes the inputs that drift beside each
  step).

Taught in: Chapter 13, "Measuring the machine".
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from dtlib.collectives.algorithms import all_gather_into, reduce_scatter_into
from dtlib.collectives.cost_model import fit_alpha_beta, fit_distrust
from dtlib.models.gpt import GPTConfig, build_gpt, token_batch
from dtlib.planner.counts import flops_per_iteration
from dtlib.planner.machine import Machine, monotone
from dtlib.planner.specs import ModelSpec
from dtlib.runtime import dist as ddist

__all__ = ["GEMM", "matmul_flops", "slowest", "median_call_s", "measure_machine",
           "machine_from"]

#: The matmul the FLOP/s is timed on: a block's MLP on 256 tokens of width 256.
GEMM = (256, 256, 1024)


def slowest(seconds: float) -> float:
    """The largest ``seconds`` over the ranks (every rank calls it)."""
    t = torch.tensor([seconds], dtype=torch.float64, device=ddist.world().device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def matmul_flops(m: int, k: int, n: int, windows: int = 5, seconds: float = 0.04,
                 device: torch.device | None = None,
                 dtype: torch.dtype = torch.float32) -> tuple[float, float]:
    """(median, best) FLOP/s of ``windows`` timed windows of ``m x k @ k x n``
    (each at least ``seconds`` and three calls long) on ``device`` (default: this
    rank's). The inputs come from a generator of their own: no random draw of the
    caller's is consumed (a resumed run's dropout stays where it was).

    Taught in: Chapter 13, "Measuring the machine"; the capstone's MFU (Chapter 10).
    """
    dev = ddist.world().device if device is None else device
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(m, k, generator=gen).to(dev, dtype)
    b = torch.randn(k, n, generator=gen).to(dev, dtype)
    torch.mm(a, b)  # warm-up (kernel choice, page faults)
    ddist.sync(dev)
    rates = []
    for _ in range(windows):
        calls, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds or calls < 3:
            torch.mm(a, b)
            calls += 1
        ddist.sync(dev)  # accelerators queue kernels: time the work
        rates.append(2 * m * k * n * calls / (time.perf_counter() - t0))
    return statistics.median(rates), max(rates)


def _model_flops(cfg: GPTConfig, batch: int, repeats: int = 3) -> float:
    """FLOP/s one process reaches on the GPT's own forward and backward (no
    optimizer step): the layers' efficiency beside the matmul roof."""
    dev = ddist.world().device
    model = build_gpt(cfg, seed=0).to(dev)
    idx, targets = token_batch(cfg, batch, seed=0, device=dev)
    times = []
    for _ in range(repeats + 1):  # the first is a warm-up
        ddist.sync()
        t0 = time.perf_counter()
        model(idx, targets)[1].backward()
        ddist.sync()
        times.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
    spec = ModelSpec(n_layers=cfg.n_layers, hidden=cfg.hidden, n_heads=cfg.n_heads,
                     vocab_size=cfg.vocab_size, seq_len=cfg.seq_len)
    return flops_per_iteration(spec, batch, "none") / statistics.median(times[1:])


def _optimizer_s_per_param(numel: int = 2**20, calls: int = 5) -> float:
    dev = ddist.world().device
    p = torch.nn.Parameter(torch.zeros(numel, device=dev))
    p.grad = torch.ones(numel, device=dev)
    opt = torch.optim.AdamW([p], lr=1e-3)
    opt.step()  # creates the moments
    ddist.sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        opt.step()
    ddist.sync()
    return (time.perf_counter() - t0) / calls / numel


def _copy_s_per_byte(numel: int = 2**20, calls: int = 10) -> float:
    """Seconds per byte written by ``dst.copy_(src)`` (read and write included):
    what FSDP2's copies into and out of its collective buffers cost."""
    dev = ddist.world().device
    src, dst = torch.ones(numel, device=dev), torch.empty(numel, device=dev)
    dst.copy_(src)  # warm-up
    ddist.sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        dst.copy_(src)
    ddist.sync()
    return (time.perf_counter() - t0) / calls / (numel * dst.element_size())


def _time_collective(op: str, nbytes: int, repeats: int) -> float:
    n, dev = dist.get_world_size(), ddist.world().device
    x = torch.ones(max(n, nbytes // 4 // n * n), device=dev)
    out = torch.empty(x.numel() // n, device=dev)
    call = {"all_reduce": lambda: dist.all_reduce(x),
            "reduce_scatter": lambda: reduce_scatter_into(out, x),
            "all_gather": lambda: all_gather_into(x, out)}[op]
    call()
    return median_call_s(call, repeats)


def median_call_s(call: Any, repeats: int) -> float:
    """On every rank: ``repeats`` calls of the collective ``call``, each after a
    barrier and timed on the slowest rank; their median, in seconds."""
    times = []
    for _ in range(repeats):
        dist.barrier()
        ddist.sync()
        t0 = time.perf_counter()
        call()
        ddist.sync()
        times.append(slowest(time.perf_counter() - t0))
    return statistics.median(times)


def measure_machine(gemm: tuple[int, int, int] = GEMM,
                    sizes: tuple[int, ...] = (2**12, 2**16, 2**20, 2**22),
                    ops: tuple[str, ...] = ("all_reduce", "reduce_scatter",
                                            "all_gather"),
                    repeats: int = 5, cfg: GPTConfig | None = None,
                    global_batch: int = 8) -> dict[str, Any]:
    """On every rank: the inputs of the step-time model, measured.

    Args:
        gemm: the ``(m, k, n)`` of the matmul timed (default :data:`GEMM`).
        sizes: message bytes of the collectives' fit.
        ops: the collectives fitted.
        repeats: timed calls per (op, size) (median, slowest rank).
        cfg, global_batch: the GPT whose own forward and backward rank 0 times
            alone on a data-parallel rank's rows (``global_batch / world_size``):
            the FLOP/s the layers reach, which the model computes with; None: the
            matmul's median.
    Returns:
        ``flops_alone`` (rank 0 alone, the others waiting: the median of five
        windows), ``flops_roof`` (the best window: the compute roof),
        ``flops_model`` (the GPT's forward and backward, rank 0 alone),
        ``flops_shared`` (the slowest rank while all compute),
        ``optimizer_s_per_param`` (rank 0 alone, AdamW), ``copy_s_per_byte``
        (rank 0 alone, a 4 MiB ``copy_``), ``fits`` ``{op: (alpha_s,
        beta_s_per_byte, why_distrusted or None)}``, ``points`` (the timed (op,
        bytes, seconds)), ``world_size``, ``device`` ("cpu" or "cuda").

    Taught in: Chapter 13, "Measuring the machine".
    """
    rank, n = dist.get_rank(), dist.get_world_size()
    dev = ddist.world().device  # NCCL moves only tensors on the rank's GPU
    alone = torch.zeros(5, dtype=torch.float64, device=dev)
    dist.barrier()
    if rank == 0:
        alone[0], alone[2] = matmul_flops(*gemm)
        alone[1] = _optimizer_s_per_param()
        alone[3] = _model_flops(cfg, max(1, global_batch // n)) if cfg else alone[0]
        alone[4] = _copy_s_per_byte()
    dist.broadcast(alone, 0)
    dist.barrier()
    shared = matmul_flops(*gemm)[0]
    t = torch.tensor([shared], dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    fits, points = {}, []
    for op in ops:
        recs = [{"bytes": s, "time_s": _time_collective(op, s, repeats)}
                for s in sizes]
        points += [(op, r["bytes"], r["time_s"]) for r in recs]
        alpha, beta = fit_alpha_beta([r["bytes"] for r in recs],
                                     [r["time_s"] for r in recs], op, n)
        fits[op] = (alpha, beta, fit_distrust(recs, op, n, alpha, beta))
    return {"flops_alone": float(alone[0]), "flops_roof": float(alone[2]),
            "flops_model": float(alone[3]),
            "flops_shared": float(t.item()),
            "optimizer_s_per_param": float(alone[1]),
            "copy_s_per_byte": float(alone[4]), "fits": fits,
            "device": dev.type,
            "points": points, "world_size": n}


def machine_from(measured: list[dict[str, Any]], cores: int | None,
                 name: str = "this machine") -> Machine:
    """The model's :class:`Machine` from :func:`measure_machine` at each world size.

    The compute rate is the GPT's own (``flops_model``, the median over world sizes)
    where measured, else the matmul's: the model then prices what parallelism adds
    to one process's forward and backward, not the layers' efficiency.

    Each rank's share of that rate while ``world_size`` ranks compute at once is
    measured (``flops_shared / flops_alone``, ``Machine.shared``), not the rule
    ``min(1, cores / N)``: other load and the memory bus the cores share make it
    lower than the rule, and the steps timed beside it carry the same.

    A fit that :func:`fit_distrust` rejects is left out: that (op, world size) is
    priced by its measured points instead (``Machine.curves``: one call's seconds at
    each timed size, made non-decreasing by ``monotone``, straight lines between
    them), which is what the ranks saw when no alpha-beta line describes them (with
    more ranks than cores every hop waits for a rank to be scheduled, whatever the
    message's size).

    Taught in: Chapter 13, "Measuring the machine".
    """
    fits: dict[tuple[str, int], tuple[float, float]] = {}
    curves: dict[tuple[str, int], tuple[tuple[float, float], ...]] = {}
    for m in measured:
        n = m["world_size"]
        good = {op: (a, b) for op, (a, b, why) in m["fits"].items() if why is None}
        for op in m["fits"]:
            points = tuple((float(b), float(t)) for o, b, t in m.get("points", ())
                           if o == op)
            if op in good:
                fits[(op, n)] = good[op]
            elif points:  # no line fits: the measured sizes price it
                curves[(op, n)] = monotone(points)
            elif "all_reduce" in good:
                fits[(op, n)] = good["all_reduce"]
        if "all_reduce" in good:
            fits[("send", n)] = good["all_reduce"]  # one hop costs one alpha-beta
    # each rank's measured share while all compute: the slowest rank's matmul over
    # rank 0's alone, both the median of their windows in the same launch
    shared = {m["world_size"]: m["flops_shared"] / m["flops_alone"] for m in measured}
    alphas = sorted(a for a, _ in fits.values()) or [1e-4]
    betas = sorted(b for _, b in fits.values()) or [1e-9]
    rate = "flops_model" if all("flops_model" in m for m in measured) \
        else "flops_alone"
    return Machine(name, statistics.median(m[rate] for m in measured),
                   alpha_s=alphas[len(alphas) // 2],
                   beta_s_per_byte=betas[len(betas) // 2],
                   optimizer_s_per_param=statistics.median(
                       m["optimizer_s_per_param"] for m in measured),
                   copy_s_per_byte=statistics.median(
                       m.get("copy_s_per_byte", 0.0) for m in measured),
                   cores=cores, fits=fits, shared=shared, curves=curves)
