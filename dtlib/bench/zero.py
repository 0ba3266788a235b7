"""ZeRO 1-3 and FSDP2: model-state bytes and communication per step, vs theory.

``python -m dtlib.bench zero [--nproc 4] [--steps 6] --json PATH`` trains the book's GPT
for a few steps with each implementation and records, per implementation: the model
states one rank holds (max over ranks) against ``dtlib.memory.model_state_bytes``
(fp32 Adam), the communication of one step in the ZeRO paper's convention against
2 Psi / 3 Psi, and the median step time.

:func:`train_rank` is what each rank runs; the tests and Chapter 4 call it through
:func:`dtlib.runtime.launch.spawn` too.

Taught in: Chapter 4 (the measurements behind its tables).
"""

from __future__ import annotations

import argparse
import statistics
import time
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from dtlib.runtime import launch
from dtlib.runtime.dist import sync, world
from dtlib.models.gpt import MLP, GPTConfig, build_gpt, token_batch

#: The GPT trained here: small enough for 4 CPU ranks, every size divisible by 4.
BENCH_GPT = dict(vocab_size=256, seq_len=32, n_layers=4, hidden=64, n_heads=4)
TEST_GPT = dict(vocab_size=64, seq_len=16, n_layers=2, hidden=32, n_heads=2)
#: An MLP with 111 parameters (81 + 30): divisible by neither 2 nor 4.
ODD_MLP = (8, 9, 3)
IMPLS = ("zero", "fsdp2")


def _model_and_batch(model: str, gpt: dict | None, batch: int, seed: int
                     ) -> tuple[nn.Module, Any, Any]:
    if model == "gpt":
        cfg = GPTConfig(**(gpt or TEST_GPT))
        return build_gpt(cfg, seed), *token_batch(cfg, batch, seed + 1)
    if model == "mlp":
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            net = MLP(ODD_MLP)
            gen = torch.Generator().manual_seed(seed + 1)
            x = torch.randn(batch, ODD_MLP[0], generator=gen)
            y = torch.randn(batch, ODD_MLP[-1], generator=gen)
        return net, x, y
    raise ValueError(f"model={model!r} not allowed; allowed: 'gpt', 'mlp'")


def _loss(net: nn.Module, model: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if model == "gpt":
        logits = net(x)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(),
                               y.reshape(-1))
    return F.mse_loss(net(x).float(), y)


def reference_params(model: str = "gpt", steps: int = 5, world_size: int = 1,
                     batch_per_rank: int = 2, lr: float = 1e-2, clip: float = 1.0,
                     gpt: dict | None = None, seed: int = 0) -> dict[str, torch.Tensor]:
    """Single-process AdamW on the whole global batch: what every sharding must match.

    Returns:
        Parameters by name after ``steps`` steps.
    """
    net, x, y = _model_and_batch(model, gpt, world_size * batch_per_rank, seed)
    opt = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=0.1)
    for _ in range(steps):
        _loss(net, model, x, y).backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in net.named_parameters()}


def train_rank(impl: str = "zero", stage: int = 3, model: str = "gpt", steps: int = 5,
               batch_per_rank: int = 2, lr: float = 1e-2, clip: float = 1.0,
               bf16: bool = False, gpt: dict | None = None, seed: int = 0,
               compare: bool = True) -> dict[str, Any]:
    """On every rank: train with ``impl`` for ``steps`` steps and measure it.

    Args:
        impl: ``"zero"`` (:class:`dtlib.zero.ZeRO`) or ``"fsdp2"`` (``fully_shard``).
        stage: ZeRO stage 1-3 (FSDP2 is stage 3).
        model: ``"gpt"`` or ``"mlp"`` (111 parameters: no world size divides them).
        batch_per_rank: samples per rank; the global batch is sliced by rank.
        bf16: FSDP2 only: bf16 parameters in compute, fp32 reduction.
        compare: also train the single-process reference and report the difference.
    Returns:
        A dict: n_params, state (bytes by role, after a step, before zero_grad),
        comm_elements (ZeRO convention, step 2), comm_summary, step_time_s (median),
        max_abs_err, max_abs_param and rel_update_err (|params - reference| over
        |reference - initial|, whole model) against the reference, on this rank.

    Taught in: Chapter 4, measured vs predicted.
    """
    from dtlib.collectives.accounting import count_comms
    from dtlib.zero.optimizer import ZeRO, zero_comm_elements

    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r} not allowed; allowed: {IMPLS}")
    world_size, rank = dist.get_world_size(), dist.get_rank()
    net, x, y = _model_and_batch(model, gpt, world_size * batch_per_rank, seed)
    device = world().device  # cpu under gloo, this rank's GPU under NCCL
    net = net.to(device)
    x, y = x.chunk(world_size)[rank].to(device), y.chunk(world_size)[rank].to(device)
    n_params = sum(p.numel() for p in net.parameters())
    init = {n: p.detach().cpu().clone() for n, p in net.named_parameters()}
    if impl == "zero":
        wrapped = ZeRO(net, stage, lr=lr, weight_decay=0.1)
        opt: Any = wrapped
    else:
        from dtlib.zero.fsdp import bf16_policy, shard_fsdp2

        wrapped = shard_fsdp2(net, mp_policy=bf16_policy() if bf16 else None)
        opt = torch.optim.AdamW(wrapped.parameters(), lr=lr, weight_decay=0.1)
    times, comm, summary, state = [], 0, [], {}
    for i in range(steps):
        counting = i == 1 or steps == 1
        sync()  # CUDA: start the clock on an idle device
        t0 = time.perf_counter()
        with count_comms() if counting else nullcontext() as log:
            _loss(wrapped, model, x, y).backward()
            if impl == "zero":
                wrapped.clip_grad_norm_(clip)
            else:
                torch.nn.utils.clip_grad_norm_(wrapped.parameters(), clip)
            opt.step()
        if counting:
            comm, summary = zero_comm_elements(log), log.summary()
        else:
            sync()  # CUDA: the step's kernels have finished, not only been queued
            times.append(time.perf_counter() - t0)
        if i == steps - 1:
            if impl == "zero":
                state = wrapped.state_bytes()
            else:
                from dtlib.zero.fsdp import fsdp_state_bytes

                state = fsdp_state_bytes(wrapped, opt)
        opt.zero_grad()
    if impl == "zero":
        params = wrapped.full_parameters()
    else:
        from dtlib.zero.fsdp import full_parameters

        params = full_parameters(wrapped)
    out = {"impl": impl, "stage": stage, "world_size": world_size,
           "n_params": n_params, "state": state, "comm_elements": comm,
           "comm_summary": summary,
           "step_time_s": statistics.median(times) if times else float("nan")}
    if impl == "fsdp2":
        out["shards"] = [
            {"name": name, "full_shape": tuple(q.shape),
             "local_shape": tuple(q.to_local().shape),
             "placements": str(tuple(q.placements)), "dtype": str(q.dtype)}
            for name, q in list(wrapped.named_parameters())[:4]]
    params = {n: t.cpu() for n, t in params.items()}
    if compare:
        ref = reference_params(model, steps, world_size, batch_per_rank, lr, clip,
                               gpt, seed)
        out["max_abs_err"] = max(float((params[n] - r).abs().max())
                                 for n, r in ref.items())
        out["max_abs_param"] = max(float(r.abs().max()) for r in ref.values())
        # How far the training moved, and how far from the reference it landed:
        # the yardstick for bf16, whose rounding changes every update a little.
        err = sum(float((params[n] - r).pow(2).sum()) for n, r in ref.items())
        moved = sum(float((r - init[n]).pow(2).sum()) for n, r in ref.items())
        out["rel_update_err"] = (err / moved) ** 0.5 if moved else 0.0
    return out


def compare_all(model: str = "gpt", steps: int = 5, gpt: dict | None = None
                ) -> dict[str, dict[str, Any]]:
    """On every rank: ZeRO 1-3, FSDP2 fp32 and FSDP2 bf16, each against the reference.

    Returns:
        ``{"zero1": ..., "zero2": ..., "zero3": ..., "fsdp2": ..., "fsdp2_bf16": ...}``
        of :func:`train_rank` results. One launch for Chapter 4's tables.
    """
    out = {f"zero{s}": train_rank("zero", s, model, steps, gpt=gpt) for s in (1, 2, 3)}
    out["fsdp2"] = train_rank("fsdp2", 3, model, steps, gpt=gpt)
    out["fsdp2_bf16"] = train_rank("fsdp2", 3, model, steps, gpt=gpt, bf16=True)
    return out


def to_record(per_rank: list[dict[str, Any]], name: str) -> dict[str, Any]:
    """One benchmark record from every rank's :func:`train_rank` result."""
    from dtlib.memory.formulas import model_state_bytes

    r0 = per_rank[0]
    n, stage, world_size = r0["n_params"], r0["stage"], r0["world_size"]
    predicted = model_state_bytes(n, zero_stage=stage, dp=world_size,
                                  precision="fp32", optimizer="adam").total
    measured = max(r["state"]["total"] for r in per_rank)
    comm = max(r["comm_elements"] for r in per_rank)
    return {"impl": name, "stage": stage, "world_size": world_size, "n_params": n,
            "measured_state_bytes": measured, "predicted_state_bytes": predicted,
            "state_ratio": measured / predicted, "comm_elements_per_step": comm,
            "comm_over_psi": comm / n,
            "step_time_s": max(r["step_time_s"] for r in per_rank)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``python -m dtlib.bench zero``."""
    parser.add_argument("--nproc", type=int, default=4, help="ranks (default 4)")
    parser.add_argument("--steps", type=int, default=6, help="steps per run")
    parser.add_argument("--layers", type=int, default=BENCH_GPT["n_layers"])
    parser.add_argument("--hidden", type=int, default=BENCH_GPT["hidden"])


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Stages 1-3 and FSDP2 on ``args.nproc`` ranks; one record per implementation."""
    gpt = {**BENCH_GPT, "n_layers": args.layers, "hidden": args.hidden}
    runs = [("zero", 1), ("zero", 2), ("zero", 3), ("fsdp2", 3)]
    records = []
    for impl, stage in runs:
        ranks = launch.spawn(train_rank, args.nproc, impl=impl, stage=stage,
                             model="gpt", steps=max(args.steps, 3), gpt=gpt,
                             compare=False, stream=False, timeout=300)
        records.append(to_record(ranks, "fsdp2" if impl == "fsdp2" else f"zero{stage}"))
    return records
