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
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from dtlib.collectives.accounting import CountComms
from dtlib.memory.formulas import model_state_bytes
from dtlib.models.gpt import MLP, GPTConfig, build_gpt, token_batch
from dtlib.models.optimizers import optimizer_of
from dtlib.models.run import Parallelism, RunConfig, TrainState, run_steps
from dtlib.runtime import launch
from dtlib.runtime.dist import world
from dtlib.zero import StateAfterStep, bf16_policy, parallelism, zero_comm_elements

#: The GPT trained here: small enough for 4 CPU ranks, every size divisible by 4.
BENCH_GPT = dict(vocab_size=256, seq_len=32, n_layers=4, hidden=64, n_heads=4)
#: weights decay, as in chapter 4's runs: a parameter the optimizer skips shows
WEIGHT_DECAY = 0.1
TEST_GPT = dict(vocab_size=64, seq_len=16, n_layers=2, hidden=32, n_heads=2)
#: An MLP with 111 parameters (81 + 30): divisible by neither 2 nor 4.
ODD_MLP = (8, 9, 3)
VARIANTS = ("zero", "fsdp2")


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


def gpt_cross_entropy(net: nn.Module, x: torch.Tensor, y: torch.Tensor
                      ) -> torch.Tensor:
    """Mean next-token cross-entropy of the GPT's logits (in fp32).

    Taught in: Chapter 4 (the loss of its runs).
    """
    logits = net(x)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(),
                           y.reshape(-1))


def mse(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean squared error of the MLP's output (in fp32).

    Taught in: Chapter 4 (the loss of its odd-sized MLP runs).
    """
    return F.mse_loss(net(x).float(), y)


LOSSES = {"gpt": gpt_cross_entropy, "mlp": mse}


def reference_params(model: str = "gpt", steps: int = 5, world_size: int = 1,
                     batch_per_rank: int = 2, lr: float = 1e-2,
                     clip: float | None = 1.0, gpt: dict | None = None, seed: int = 0,
                     optimizer: str = "adamw") -> dict[str, torch.Tensor]:
    """One process on the whole global batch: what every sharding must match.

    Args:
        optimizer: a key of ``dtlib.models.optimizers.OPTIMIZERS``.
        clip: the gradient-norm clip, or None.
    Returns:
        Parameters by name (CPU) after ``steps`` steps.

    Taught in: Chapter 4, "Does it train the same model?".
    """
    net, x, y = _model_and_batch(model, gpt, world_size * batch_per_rank, seed)
    cls, kwargs = optimizer_of(optimizer, lr, WEIGHT_DECAY)
    config = RunConfig(steps, optimizer_class=cls, optimizer_kwargs=kwargs,
                       loss_fn=LOSSES[model], max_grad_norm=clip, record_grads=False)
    return run_steps(Parallelism(), net, lambda step: (x, y), config).params


def compare_params(params: dict[str, torch.Tensor], ref: dict[str, torch.Tensor],
                   init: dict[str, torch.Tensor]) -> dict[str, float]:
    """How far ``params`` landed from ``ref``, absolute and relative to how far
    the reference moved from ``init``.

    Returns:
        ``{"max_abs_err", "max_abs_param", "rel_update_err"}``: the largest
        ``|params - ref|``, the largest ``|ref|``, and ``|params - ref| /
        |ref - init|`` over the whole model (the yardstick for bf16, whose rounding
        changes every update a little).
    """
    err = sum(float((params[n] - r).pow(2).sum()) for n, r in ref.items())
    moved = sum(float((r - init[n]).pow(2).sum()) for n, r in ref.items())
    return {"max_abs_err": max(float((params[n] - r).abs().max())
                               for n, r in ref.items()),
            "max_abs_param": max(float(r.abs().max()) for r in ref.values()),
            "rel_update_err": (err / moved) ** 0.5 if moved else 0.0}


def train_rank(variant: str = "zero", stage: int = 3, model: str = "gpt",
               steps: int = 5, batch_per_rank: int = 2, lr: float = 1e-2,
               clip: float | None = 1.0, bf16: bool = False, gpt: dict | None = None,
               seed: int = 0, compare: bool = True, optimizer: str = "adamw",
               keep_params: bool = False,
               reference: dict[str, torch.Tensor] | None = None) -> dict[str, Any]:
    """On every rank: train with ``variant`` for ``steps`` steps and measure it.

    Args:
        variant: ``"zero"`` (:func:`dtlib.zero.parallelism` ``(stage)``, the book's)
            or ``"fsdp2"`` (``fully_shard``).
        stage: ZeRO stage 1-3 (FSDP2 is stage 3).
        model: ``"gpt"`` or ``"mlp"`` (111 parameters: no world size divides them).
        batch_per_rank: samples per rank; the global batch is sliced by rank.
        clip: the gradient-norm clip, or None.
        bf16: FSDP2 only: bf16 parameters in compute, fp32 reduction.
        compare: also compare with the single-process run (``reference``, or
            :func:`reference_params` trained here).
        optimizer: a key of ``dtlib.models.optimizers.OPTIMIZERS``.
        keep_params: return the full parameters too (``"params"``, CPU).
    Returns:
        A dict: n_params, state (bytes by role, after the last step, before
        zero_grad), comm_elements (ZeRO convention, step 2), comm_summary,
        step_time_s (median), losses, and with ``compare`` the keys of
        :func:`compare_params`.

    Taught in: Chapter 4, measured vs predicted.
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant={variant!r} not allowed; allowed: {VARIANTS}")
    cls, kwargs = optimizer_of(optimizer, lr, WEIGHT_DECAY)
    world_size = dist.get_world_size()
    net, x, y = _model_and_batch(model, gpt, world_size * batch_per_rank, seed)
    device = world().device  # cpu under gloo, this rank's GPU under NCCL
    net, x, y = net.to(device), x.to(device), y.to(device)
    n_params = sum(p.numel() for p in net.parameters())
    init = {n: p.detach().cpu().clone() for n, p in net.named_parameters()}
    par = parallelism(stage) if variant == "zero" else parallelism(
        3, variant="fsdp2", mp_policy=bf16_policy() if bf16 else None)
    wrapped = par.apply(net)
    probe = StateAfterStep(par, steps)  # after the last step
    counted = 1 if steps > 1 else 0  # the index of the step whose comms are counted
    comms = CountComms(counted + 1)
    config = RunConfig(steps, optimizer_class=cls, optimizer_kwargs=kwargs,
                       loss_fn=LOSSES[model], max_grad_norm=clip, record_grads=False)
    run = run_steps(par, None, lambda step: (x, y), config, TrainState(wrapped),
                    [probe, comms])
    times = [t for i, t in enumerate(run.step_times) if i != counted]
    out = {"variant": variant, "stage": stage, "world_size": world_size,
           "n_params": n_params, "state": probe.state,
           "comm_elements": zero_comm_elements(run.comms),
           "comm_summary": run.comms.summary(), "losses": run.losses,
           "step_time_s": statistics.median(times) if times else float("nan")}
    if variant == "fsdp2":
        out["shards"] = [
            {"name": name, "full_shape": tuple(q.shape),
             "local_shape": tuple(q.to_local().shape),
             "placements": str(tuple(q.placements)), "dtype": str(q.dtype)}
            for name, q in list(wrapped.named_parameters())[:4]]
    if keep_params:
        out["params"] = run.params
    if compare:
        ref = reference if reference is not None else reference_params(
            model, steps, world_size, batch_per_rank, lr, clip, gpt, seed, optimizer)
        out.update(compare_params(run.params, ref, init))
    return out


def compare_all(model: str = "gpt", steps: int = 5, gpt: dict | None = None
                ) -> dict[str, dict[str, Any]]:
    """On every rank: ZeRO 1-3, FSDP2 fp32 and FSDP2 bf16, each against the reference.

    Returns:
        ``{"zero1": ..., "zero2": ..., "zero3": ..., "fsdp2": ..., "fsdp2_bf16": ...}``
        of :func:`train_rank` results. One launch for Chapter 4's tables.
    """
    ref = reference_params(model, steps, dist.get_world_size(), gpt=gpt)
    out = {f"zero{s}": train_rank("zero", s, model, steps, gpt=gpt, reference=ref)
           for s in (1, 2, 3)}
    out["fsdp2"] = train_rank("fsdp2", 3, model, steps, gpt=gpt, reference=ref)
    out["fsdp2_bf16"] = train_rank("fsdp2", 3, model, steps, gpt=gpt, bf16=True,
                                   reference=ref)
    return out


def to_record(per_rank: list[dict[str, Any]], name: str) -> dict[str, Any]:
    """One benchmark record from every rank's :func:`train_rank` result.

    Taught in: Chapter 4, "Memory, measured".
    """
    r0 = per_rank[0]
    n, stage, world_size = r0["n_params"], r0["stage"], r0["world_size"]
    predicted = model_state_bytes(n, zero_stage=stage, dp=world_size,
                                  precision="fp32", optimizer="adam").total
    measured = max(r["state"]["total"] for r in per_rank)
    comm = max(r["comm_elements"] for r in per_rank)
    return {"variant": name, "stage": stage, "world_size": world_size, "n_params": n,
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
    for variant, stage in runs:
        ranks = launch.spawn(train_rank, args.nproc, variant=variant, stage=stage,
                             model="gpt", steps=max(args.steps, 3), gpt=gpt,
                             compare=False, stream=False, timeout=300)
        records.append(to_record(ranks, "fsdp2" if variant == "fsdp2"
                                 else f"zero{stage}"))
    return records
