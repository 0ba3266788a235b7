"""Timing every strategy's step on the ranks, for Chapter 13's step-time model (the
machine's inputs are measured by ``measure.py``, the drifting ones by ``probe.py``).

- :func:`build`: each strategy of :data:`~dtlib.planner.step_time.MODELLED` as
  its row of the book's one table (:mod:`dtlib.planner.strategies`) builds it;
- :func:`time_strategies`: the median step of each strategy, each a technique's
  ``parallelism(...)`` in the one loop ``run_steps``, in rounds, with the compute
  rate probed around each strategy's steps;
- :func:`profile_step`: ``torch.profiler`` around one step; its events, and the Chrome
  trace written for Perfetto (``trace.py`` reads them).

:func:`compare` turns what the ranks measured into the measured / predicted table;
:func:`measure_overheads` times each data-parallel strategy's machinery on one rank.

Taught in: Chapter 13, "Where the time goes".
"""

from __future__ import annotations

import statistics
from typing import Any

import torch
import torch.distributed as dist

from dtlib.models.gpt import GPTConfig, build_gpt
from dtlib.models.reference import gpt_batches
from dtlib.models.run import (OnStepEnd, Parallelism, RunConfig, StepEnd, TrainState,
                              run_steps)
from dtlib.planner.drift import drift_of, machine_at
from dtlib.planner.machine import Machine
from dtlib.planner.measure import slowest
from dtlib.planner.probe import Probe, probe_rate
from dtlib.planner.specs import ModelSpec
from dtlib.planner.step_time import MODELLED, Workload, predict
from dtlib.planner.strategies import STRATEGIES, Options, one_rank_names
from dtlib.runtime import dist as ddist

__all__ = ["TIME_GPT", "BUCKET_CAP_MB", "N_MICRO", "BAND", "build",
           "DATA_PARALLEL", "SPLIT_BACKWARD", "measure_overheads", "time_strategies",
           "profile_step",
           "workload_of", "compare"]

#: The GPT every strategy trains here: 4 blocks (2 and 4 stages), 8 heads (tp 2, 4),
#: ~3M parameters, so that communication and compute are both visible.
TIME_GPT = GPTConfig(vocab_size=256, seq_len=64, n_layers=4, hidden=256, n_heads=8,
                     tie_weights=False)
#: DDP's bucket cap here: several buckets, so the overlap rule has work to do.
BUCKET_CAP_MB = 4.0
N_MICRO = 4
#: The band of measured / predicted the model promises on an idle machine.
BAND = (0.75, 1.33)


def build(name: str) -> Parallelism:
    """Strategy ``name``'s Parallelism from the book's one table
    (:data:`~dtlib.planner.strategies.STRATEGIES`), with this chapter's buckets and
    micro-batches where the row reads them.

    Raises:
        ValueError: ``name`` is not a strategy the step-time model prices (naming
            those it does).
    """
    if name not in MODELLED:
        raise ValueError(f"strategy={name!r} not allowed; allowed: {MODELLED}")
    row = STRATEGIES[name]
    chosen = {"bucket_cap_mb": BUCKET_CAP_MB, "n_micro": N_MICRO}
    return row.parallelism(Options(**{k: v for k, v in chosen.items()
                                      if k in row.options}))


def time_strategies(strategies: tuple[str, ...], cfg: GPTConfig = TIME_GPT,
                    global_batch: int = 8, steps: int = 3, warmup: int = 1,
                    probe: bool = False, rounds: int = 1) -> list[dict[str, Any]]:
    """On every rank: the median step of each strategy (the slowest rank's).

    Each strategy is ``build(name)`` in ``run_steps`` on the same global batch
    (``global_batch`` sequences: data-parallel ranks split it, TP ranks and pipeline
    stages see all of it); ``warmup`` untimed steps first. A pipeline whose stages
    outnumber the model's blocks at this world size is left out
    (:meth:`~dtlib.planner.strategies.Strategy.fits` says why).

    Args:
        probe: time the inputs that drift (``probe_rate``) after every step, so
            each timed step is priced with the probes just before and after it.
        rounds: times through the strategies (a record per strategy and round).
    Returns:
        One dict per strategy and round: ``strategy``, ``world_size``,
        ``step_time_s`` (the median over the timed steps of the slowest rank's),
        ``n_params``, ``n_tensors`` (of the unwrapped model), ``round``, and with
        ``probe`` ``step_times_s`` (each timed step's) and ``probes`` (one more:
        the probe before each timed step, then the one after the last).

    Taught in: Chapter 13, "Predicted against measured".
    """
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds={rounds!r} must be an integer >= 1")
    out = []
    device = ddist.world().device
    gauge = Probe(cfg, global_batch) if probe else None
    last = [probe_rate(gauge)] if gauge else []

    def after_step(end: StepEnd) -> None:
        dist.barrier()
        if gauge is not None:
            last.append(probe_rate(gauge))

    n = dist.get_world_size()
    strategies = tuple(s for s in strategies
                       if STRATEGIES[s].fits(cfg.n_layers, n) is None)
    for k in range(rounds):
        for name in strategies:
            dist.barrier()
            model = build_gpt(cfg, seed=0).to(device)
            n_params = sum(p.numel() for p in model.parameters())
            n_tensors = len(list(model.parameters()))
            del last[:-1]  # the probe before this strategy's first step
            config = RunConfig(warmup + steps, record_grads=False,
                               record_params=False)
            run = run_steps(build(name), model, gpt_batches(
                cfg, global_batch, device), config, callbacks=[OnStepEnd(after_step)])
            times = [slowest(t) for t in run.step_times[warmup:]]
            rec = {"strategy": name, "world_size": dist.get_world_size(),
                   "step_time_s": statistics.median(times),
                   "n_params": n_params, "n_tensors": n_tensors, "round": k}
            if gauge is not None:
                rec.update(step_times_s=times, probes=last[warmup:])
            out.append(rec)
    return out


#: The modelled strategies whose machinery runs on a one-rank world as on N ranks,
#: less the bytes (a pipeline or a TP plan needs its peers): :func:`measure_overheads`.
DATA_PARALLEL = tuple(n for n in one_rank_names() if n in MODELLED)
#: The pipelines whose backward is split into B and W: on one rank (one stage, or
#: ZB-V's two) their machinery is what the split adds to 1F1B's step there.
SPLIT_BACKWARD = ("zb-h1", "zb-v")


def measure_overheads(strategies: tuple[str, ...], cfg: GPTConfig = TIME_GPT,
                      rows: int = 4, steps: int = 4, rounds: int = 3
                      ) -> dict[str, float]:
    """On a one-rank world: what each data-parallel strategy's machinery adds to a
    step where no byte moves, and what splitting the backward into B and W adds to a
    pipeline's (``Machine.overhead_s``).

    For each strategy of ``strategies`` in :data:`DATA_PARALLEL` or
    :data:`SPLIT_BACKWARD` (the others are skipped), ``rounds`` times: the plain step
    (``Parallelism()``, the identity; for a split pipeline 1F1B's on one stage) and
    the strategy's step, each the median of ``steps`` timed steps after a warm-up,
    on the same ``rows`` sequences; the strategy's figure is the median over the
    rounds of its step minus the plain step just before it, at least 0.

    Taught in: Chapter 13, "Predicted against measured".
    """
    if dist.get_world_size() != 1:
        raise ValueError(f"world size {dist.get_world_size()}: the machinery is "
                         "measured on a one-rank world, where no byte moves")
    device = ddist.world().device

    def step_s(par: Parallelism) -> float:
        run = run_steps(par, build_gpt(cfg, seed=0).to(device),
                        gpt_batches(cfg, rows, device),
                        RunConfig(1 + steps, record_grads=False, record_params=False))
        return statistics.median(run.step_times[1:])

    out: dict[str, list[float]] = {}
    for _ in range(rounds):
        for name in strategies:
            if name in DATA_PARALLEL:
                plain = step_s(Parallelism())
                out.setdefault(name, []).append(step_s(build(name)) - plain)
            elif name in SPLIT_BACKWARD:
                plain = step_s(build("1f1b"))
                out.setdefault(name, []).append(step_s(build(name)) - plain)
    return {name: max(0.0, statistics.median(d)) for name, d in out.items()}


def workload_of(cfg: GPTConfig, record: dict[str, Any], global_batch: int = 8
                ) -> Workload:
    """The model's :class:`Workload` of one :func:`time_strategies` record, with
    the small collectives the book's loop and techniques issue counted
    (``Workload.control_collectives``): the timed step runs them."""
    spec = ModelSpec(n_layers=cfg.n_layers, hidden=cfg.hidden, n_heads=cfg.n_heads,
                     vocab_size=cfg.vocab_size, seq_len=cfg.seq_len)
    return Workload(spec, global_batch, n_params=record["n_params"],
                    n_tensors=record["n_tensors"],
                    bucket_cap_bytes=BUCKET_CAP_MB * 2**20, n_micro=N_MICRO,
                    control_collectives=True)  # run_steps' and ZeRO's own, counted


def compare(records: list[dict[str, Any]], machine: Machine,
            cfg: GPTConfig = TIME_GPT, global_batch: int = 8
            ) -> list[dict[str, Any]]:
    """Measured / predicted per strategy and world size (and round).

    A record with ``probes`` prices each timed step on ``drift.machine_at`` of the
    probes just before and after it; its ratio is the median of its steps' ratios.

    Taught in: Chapter 13, "Predicted against measured".
    """
    out = []
    for r in records:
        n, w = r["world_size"], workload_of(cfg, r, global_batch)
        p = predict(r["strategy"], w, machine, n)
        row = {"strategy": r["strategy"], "world_size": n,
               "measured_s": r["step_time_s"], "predicted_s": p.total_s,
               "ratio": r["step_time_s"] / p.total_s}
        if "probes" in r:
            probes, times = r["probes"], r["step_times_s"]
            steps = [predict(r["strategy"], w, machine_at(machine, probes[i:i + 2], n),
                             n) for i in range(len(times))]
            p = steps[0]  # the terms of the first step
            row.update(predicted_s=statistics.median(s.total_s for s in steps),
                       ratio=statistics.median(t / s.total_s
                                               for t, s in zip(times, steps)),
                       round=r["round"], drift=drift_of(probes))
        row.update(compute_s=p.compute_s, optimizer_s=p.optimizer_s,
                   exposed_s=p.exposed_s, bubble_s=p.bubble_s)
        out.append(row)
    return out


def profile_step(strategy: str, cfg: GPTConfig = TIME_GPT, global_batch: int = 8,
                 trace_dir: str | None = None) -> dict[str, Any]:
    """On every rank: ``torch.profiler`` around one step of ``strategy`` (after one
    warm-up step); the events the trace holds.

    Args:
        strategy: one of :data:`~dtlib.planner.step_time.MODELLED`.
        trace_dir: where rank 0 writes ``<strategy>.json`` (Chrome trace format,
            opens in Perfetto), or None.
    Returns:
        ``{"events": [(name, thread, start_us, end_us)], "trace": path or None}``:
        every event the profiler recorded on the CPU, sorted by start.

    Taught in: Chapter 13, "Reading a trace".
    """
    import os

    from torch.profiler import ProfilerActivity, profile

    device = ddist.world().device
    activities = [ProfilerActivity.CPU] + (
        [ProfilerActivity.CUDA] if device.type == "cuda" else [])
    par = build(strategy)
    model = build_gpt(cfg, seed=0).to(device)
    wrapped = par.apply(model)
    opt = par.make_optimizer(wrapped, torch.optim.AdamW, lr=1e-3)
    batches = gpt_batches(cfg, global_batch, device)
    state = TrainState(wrapped, opt)
    run_steps(par, None, batches,
              RunConfig(1, record_grads=False, record_params=False), state)
    dist.barrier()
    with profile(activities=activities) as prof:
        run_steps(par, None, batches, RunConfig(2, start=1, record_grads=False,
                                                record_params=False), state)
    path = None
    if trace_dir is not None and dist.get_rank() == 0:
        os.makedirs(trace_dir, exist_ok=True)
        path = os.path.join(trace_dir, strategy.replace("/", "_") + ".json")
        prof.export_chrome_trace(path)
    events = sorted((e.name, e.thread, float(e.time_range.start),
                     float(e.time_range.end)) for e in prof.events()
                    if e.device_type.name == "CPU")
    return {"events": sorted(events, key=lambda e: e[2]), "trace": path}
