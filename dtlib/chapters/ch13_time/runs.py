"""What Chapter 13's page runs on ranks: the machine's inputs, each strategy's step,
and a profiled step.

- :func:`measure_machine`: matmul FLOP/s (one rank alone, then every rank at once),
  the optimizer's seconds per parameter, and Chapter 2's alpha-beta fit of each
  collective (guarded by :func:`dtlib.collectives.cost_model.fit_distrust`);
- :func:`time_strategies`: the median step of each strategy, each a technique's
  ``parallelism(...)`` in the one loop ``run_steps``;
- :func:`profile_step`: ``torch.profiler`` around one step; its events, and the Chrome
  trace written for Perfetto (``trace.py`` reads them).

:func:`machine_from` and :func:`compare` turn what the ranks measured into the pure
model's :class:`~dtlib.planner.step_time.Machine` and the measured / predicted table.

Taught in: Chapter 13, "Where the time goes".
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from dtlib.collectives.algorithms import all_gather_into, reduce_scatter_into
from dtlib.collectives.cost_model import fit_alpha_beta, fit_distrust
from dtlib.models.gpt import GPTConfig, build_gpt
from dtlib.models.reference import gpt_batches
from dtlib.models.run import Parallelism, run_steps
from dtlib.planner.specs import ModelSpec
from dtlib.planner.step_time import Machine, Workload, predict
from dtlib.runtime import dist as ddist

__all__ = ["TIME_GPT", "BUCKET_CAP_MB", "BAND", "FACTORIES", "measure_machine",
           "time_strategies", "profile_step", "machine_from", "workload_of", "compare",
           "chapter_run"]

#: The GPT every strategy trains here: 4 blocks (2 and 4 stages), 8 heads (tp 2, 4),
#: ~3M parameters, so that communication and compute are both visible.
TIME_GPT = GPTConfig(vocab_size=256, seq_len=64, n_layers=4, hidden=256, n_heads=8,
                     tie_weights=False)
#: The matmul the FLOP/s is timed on: a block's MLP on 256 tokens of width 256.
GEMM = (256, 256, 1024)
#: DDP's bucket cap here: several buckets, so the overlap rule has work to do.
BUCKET_CAP_MB = 4.0
N_MICRO = 4
#: The band of measured / predicted the model promises on an idle machine.
BAND = (0.75, 1.33)


def _ddp(variant: str) -> Callable[[], Parallelism]:
    def make() -> Parallelism:
        from dtlib.data_parallel import parallelism
        return parallelism(variant, bucket_cap_mb=BUCKET_CAP_MB)
    return make


def _zero(stage: int, variant: str = "ours") -> Callable[[], Parallelism]:
    def make() -> Parallelism:
        from dtlib.zero import parallelism
        return parallelism(stage, variant=variant)
    return make


def _tp() -> Parallelism:
    from dtlib.tensor_parallel import parallelism
    return parallelism("ours")


def _pipe(schedule: str) -> Callable[[], Parallelism]:
    def make() -> Parallelism:
        from dtlib.pipeline_parallel import parallelism
        return parallelism(schedule, N_MICRO)
    return make


#: Strategy name (as in ``planner.step_time.STRATEGIES``) -> its Parallelism factory.
FACTORIES: dict[str, Callable[[], Parallelism]] = {
    "ddp/naive": _ddp("naive"), "ddp/bucketed": _ddp("bucketed"),
    "ddp/overlapped": _ddp("overlapped"), "zero-1": _zero(1), "zero-2": _zero(2),
    "zero-3": _zero(3), "fsdp2": _zero(3, "fsdp2"), "tp": _tp,
    "gpipe": _pipe("gpipe"), "1f1b": _pipe("1f1b")}


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64, device=ddist.world().device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _matmul_flops(m: int, k: int, n: int, windows: int = 5,
                  seconds: float = 0.04) -> tuple[float, float]:
    """(median, best) FLOP/s of ``windows`` timed windows of ``m x k @ k x n``."""
    dev = ddist.world().device
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(m, k, generator=gen).to(dev)
    b = torch.randn(k, n, generator=gen).to(dev)
    torch.mm(a, b)  # warm-up
    ddist.sync()
    rates = []
    for _ in range(windows):
        calls, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds or calls < 3:
            torch.mm(a, b)
            calls += 1
        ddist.sync()  # accelerators queue kernels: time the work
        rates.append(2 * m * k * n * calls / (time.perf_counter() - t0))
    return statistics.median(rates), max(rates)


def _model_flops(cfg: GPTConfig, batch: int, repeats: int = 3) -> float:
    """FLOP/s one process reaches on the GPT's own forward and backward (no
    optimizer step): the layers' efficiency beside the matmul roof."""
    from dtlib.models.gpt import token_batch
    from dtlib.planner.counts import flops_per_iteration

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


def _time_collective(op: str, nbytes: int, repeats: int) -> float:
    n, dev = dist.get_world_size(), ddist.world().device
    x = torch.ones(max(n, nbytes // 4 // n * n), device=dev)
    out = torch.empty(x.numel() // n, device=dev)
    call = {"all_reduce": lambda: dist.all_reduce(x),
            "reduce_scatter": lambda: reduce_scatter_into(out, x),
            "all_gather": lambda: all_gather_into(x, out)}[op]
    call()
    times = []
    for _ in range(repeats):
        dist.barrier()
        ddist.sync()
        t0 = time.perf_counter()
        call()
        ddist.sync()
        times.append(_slowest(time.perf_counter() - t0))
    return statistics.median(times)


def measure_machine(gemm: tuple[int, int, int] = GEMM,
                    sizes: tuple[int, ...] = (2**12, 2**16, 2**20, 2**22),
                    ops: tuple[str, ...] = ("all_reduce", "reduce_scatter",
                                            "all_gather"),
                    repeats: int = 5, cfg: GPTConfig | None = TIME_GPT,
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
        ``optimizer_s_per_param`` (rank 0 alone, AdamW), ``fits`` ``{op: (alpha_s,
        beta_s_per_byte, why_distrusted or None)}``, ``points`` (the timed (op,
        bytes, seconds)), ``world_size``, ``device`` ("cpu" or "cuda").

    Taught in: Chapter 13, "Measuring the machine".
    """
    rank, n = dist.get_rank(), dist.get_world_size()
    dev = ddist.world().device  # NCCL moves only tensors on the rank's GPU
    alone = torch.zeros(4, dtype=torch.float64, device=dev)
    dist.barrier()
    if rank == 0:
        alone[0], alone[2] = _matmul_flops(*gemm)
        alone[1] = _optimizer_s_per_param()
        alone[3] = _model_flops(cfg, max(1, global_batch // n)) if cfg else alone[0]
    dist.broadcast(alone, 0)
    dist.barrier()
    shared = _matmul_flops(*gemm)[0]
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
            "optimizer_s_per_param": float(alone[1]), "fits": fits,
            "device": dev.type,
            "points": points, "world_size": n}


def machine_from(measured: list[dict[str, Any]], cores: int | None,
                 name: str = "this machine") -> Machine:
    """The model's :class:`Machine` from :func:`measure_machine` at each world size.

    The compute rate is the GPT's own (``flops_model``, the median over world sizes)
    where measured, else the matmul's: the model then prices what parallelism adds
    to one process's forward and backward, not the layers' efficiency.

    A fit that :func:`fit_distrust` rejects is left out: that (op, world size) falls
    back to the all-reduce fit of the same world size, or to the trusted fits' median.

    Taught in: Chapter 13, "Measuring the machine".
    """
    fits: dict[tuple[str, int], tuple[float, float]] = {}
    for m in measured:
        n = m["world_size"]
        good = {op: (a, b) for op, (a, b, why) in m["fits"].items() if why is None}
        for op in m["fits"]:
            pick = good.get(op) or good.get("all_reduce")
            if pick is not None:
                fits[(op, n)] = pick
        if "all_reduce" in good:
            fits[("send", n)] = good["all_reduce"]  # one hop costs one alpha-beta
    alphas = sorted(a for a, _ in fits.values()) or [1e-4]
    betas = sorted(b for _, b in fits.values()) or [1e-9]
    rate = "flops_model" if all("flops_model" in m for m in measured) \
        else "flops_alone"
    return Machine(name, statistics.median(m[rate] for m in measured),
                   alpha_s=alphas[len(alphas) // 2],
                   beta_s_per_byte=betas[len(betas) // 2],
                   optimizer_s_per_param=statistics.median(
                       m["optimizer_s_per_param"] for m in measured),
                   cores=cores, fits=fits)


def time_strategies(strategies: tuple[str, ...], cfg: GPTConfig = TIME_GPT,
                    global_batch: int = 8, steps: int = 3, warmup: int = 1
                    ) -> list[dict[str, Any]]:
    """On every rank: the median step of each strategy (the slowest rank's).

    Each strategy is ``FACTORIES[name]()`` in ``run_steps`` on the same global batch
    (``global_batch`` sequences: data-parallel ranks split it, TP ranks and pipeline
    stages see all of it); ``warmup`` untimed steps first.

    Returns:
        One dict per strategy: ``strategy``, ``world_size``, ``step_time_s``,
        ``n_params``, ``n_tensors`` (of the unwrapped model).

    Taught in: Chapter 13, "Predicted against measured".
    """
    out = []
    device = ddist.world().device
    for name in strategies:
        dist.barrier()
        model = build_gpt(cfg, seed=0).to(device)
        n_params = sum(p.numel() for p in model.parameters())
        n_tensors = len(list(model.parameters()))
        run = run_steps(FACTORIES[name](), model, gpt_batches(cfg, global_batch,
                        device), warmup + steps, record_grads=False,
                        record_params=False, on_step=lambda *_: dist.barrier())
        out.append({"strategy": name, "world_size": dist.get_world_size(),
                    "step_time_s": _slowest(statistics.median(
                        run.step_times[warmup:])),
                    "n_params": n_params, "n_tensors": n_tensors})
    return out


def workload_of(cfg: GPTConfig, record: dict[str, Any], global_batch: int = 8
                ) -> Workload:
    """The model's :class:`Workload` of one :func:`time_strategies` record."""
    spec = ModelSpec(n_layers=cfg.n_layers, hidden=cfg.hidden, n_heads=cfg.n_heads,
                     vocab_size=cfg.vocab_size, seq_len=cfg.seq_len)
    return Workload(spec, global_batch, n_params=record["n_params"],
                    n_tensors=record["n_tensors"],
                    bucket_cap_bytes=BUCKET_CAP_MB * 2**20, n_micro=N_MICRO)


def compare(records: list[dict[str, Any]], machine: Machine,
            cfg: GPTConfig = TIME_GPT, global_batch: int = 8
            ) -> list[dict[str, Any]]:
    """Measured / predicted per strategy and world size.

    Taught in: Chapter 13, "Predicted against measured".
    """
    out = []
    for r in records:
        n = r["world_size"]
        p = predict(r["strategy"], workload_of(cfg, r, global_batch), machine, n)
        ratio = r["step_time_s"] / p.total_s
        out.append({"strategy": r["strategy"], "world_size": n,
                    "measured_s": r["step_time_s"], "predicted_s": p.total_s,
                    "ratio": ratio,
                    "compute_s": p.compute_s, "optimizer_s": p.optimizer_s,
                    "exposed_s": p.exposed_s, "bubble_s": p.bubble_s})
    return out


def profile_step(strategy: str, cfg: GPTConfig = TIME_GPT, global_batch: int = 8,
                 trace_dir: str | None = None) -> dict[str, Any]:
    """On every rank: ``torch.profiler`` around one step of ``strategy`` (after one
    warm-up step); the events the trace holds.

    Args:
        strategy: a key of :data:`FACTORIES`.
        trace_dir: where rank 0 writes ``<strategy>.json`` (Chrome trace format,
            opens in Perfetto), or None.
    Returns:
        ``{"events": [(name, thread, start_us, end_us)], "trace": path or None}``:
        every event the profiler recorded on the CPU, sorted by start.

    Taught in: Chapter 13, "Reading a trace".
    """
    import os

    from torch.profiler import ProfilerActivity, profile

    if strategy not in FACTORIES:
        raise ValueError(f"strategy={strategy!r} not allowed; allowed: "
                         f"{sorted(FACTORIES)}")
    device = ddist.world().device
    activities = [ProfilerActivity.CPU] + (
        [ProfilerActivity.CUDA] if device.type == "cuda" else [])
    par = FACTORIES[strategy]()
    model = build_gpt(cfg, seed=0).to(device)
    wrapped = par.apply(model)
    opt = par.make_optimizer(wrapped, torch.optim.AdamW, lr=1e-3)
    batches = gpt_batches(cfg, global_batch, device)
    kwargs = dict(wrapped=wrapped, optimizer=opt, record_grads=False,
                  record_params=False)
    run_steps(par, model, batches, 1, **kwargs)
    dist.barrier()
    with profile(activities=activities) as prof:
        run_steps(par, model, batches, 2, start=1, **kwargs)
    path = None
    if trace_dir is not None and dist.get_rank() == 0:
        os.makedirs(trace_dir, exist_ok=True)
        path = os.path.join(trace_dir, strategy.replace("/", "_") + ".json")
        prof.export_chrome_trace(path)
    events = sorted((e.name, e.thread, float(e.time_range.start),
                     float(e.time_range.end)) for e in prof.events()
                    if e.device_type.name == "CPU")
    return {"events": sorted(events, key=lambda e: e[2]), "trace": path}


def chapter_run(strategies: tuple[str, ...], traced: tuple[str, ...],
                trace_dir: str | None, steps: int = 2) -> dict[str, Any]:
    """On every rank: everything the page measures, in one launch.

    Returns:
        ``machine`` (:func:`measure_machine`), ``steps`` (:func:`time_strategies`),
        ``traces`` (``{strategy: profile_step(...)}``) and ``timeline`` (Chapter 3's
        hand-made timeline of the overlapped DDP, same GPT and buckets).

    Taught in: Chapter 13 (the page's one launch).
    """
    from dtlib.chapters.ch03_data_parallel.runs import record_timeline

    return {"machine": measure_machine(sizes=(2**12, 2**16, 2**20, 2**22),
                                       repeats=3),
            "steps": time_strategies(strategies, steps=steps),
            "traces": {s: profile_step(s, trace_dir=trace_dir) for s in traced},
            "timeline": record_timeline(TIME_GPT, 4, BUCKET_CAP_MB, steps=2)}
