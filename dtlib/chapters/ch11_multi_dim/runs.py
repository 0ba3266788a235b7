"""Rank functions of Chapter 11: 2-D and 3-D parallel training next to one process.

Every layout is one :func:`dtlib.parallel_nd.parallelism` trained by the one loop
(:func:`~dtlib.models.run.run_steps`), SGD with momentum, the same global batches:

- :func:`train_2d`: tensor parallel inside, data parallel across, on a dp x tp
  grid: ``"ours"`` (hand-built groups, our TP layers in our DataParallel) or
  ``"torch"`` (``init_device_mesh``, ``parallelize_module``, ``fully_shard``);
- :func:`train_hsdp`: torch's HSDP on a ("replicate", "shard") mesh;
- :func:`train_pp_dp`: our pipeline (Chapter 6's 1F1B) inside our data parallel;
  :func:`train_fsdp_pp`: torch's ``Schedule1F1B`` over FSDP2-sharded stages;
  :func:`train_3d`: dp x pp x tp, ours;
- :func:`reference`: the same training on one process (the truth);
- :func:`comm_by_dim`: one step's collectives, per mesh dimension.

Every rank function returns the losses, the first step's gradients and the
parameters after the last step as full CPU tensors (every stage's, every shard's),
and the second step's collectives with the ranks of the group each ran on (the
first step's end also gathers the gradients for the comparison).

Taught in: Chapter 11.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from dtlib.collectives.accounting import CountComms
from dtlib.models.gpt import GPTConfig, build_gpt
from dtlib.models.reference import gpt_batches, reference_gpt_run
from dtlib.models.run import Parallelism, RunConfig, TrainState, local_tensor, run_steps
from dtlib.models.sizes import size
from dtlib.parallel_nd import ParallelDims, parallelism
from dtlib.runtime import dist as ddist

TINY = size("tiny")
PIPELINE = size("pipeline")  # 8 blocks, untied head: cut into 2 or 4 stages
VARIANTS = ("ours", "torch")
LR = 0.05
# SGD with momentum: its step is smooth in the gradient, so the same gradients give
# the same trajectory (AdamW turns float noise in a near-zero gradient into a step
# of up to lr, whose sign differs between machines).
MOMENTUM = 0.9
COMMS_STEP = 1  # the step whose collectives are counted (step 0 gathers gradients)


def reference(cfg: GPTConfig = TINY, batch: int = 8, steps: int = 3,
              lr: float = LR, seed: int = 0) -> Any:
    """One process, the whole batch: what every layout must equal.

    Returns:
        ``reference_gpt_run``'s :class:`~dtlib.models.run.RunResult` (SGD with
        momentum :data:`MOMENTUM` at ``lr``).

    Taught in: Chapter 11, "Two dimensions, ours and torch's".
    """
    return reference_gpt_run(cfg, batch, steps, lr=lr, seed=seed,
                             optimizer_class=torch.optim.SGD, momentum=MOMENTUM)


def _records(log: Any) -> list[dict[str, Any]]:
    return [{"op": r.op, "bytes": r.bytes, "ranks": r.ranks}
            for r in log.records]


def train(par: Parallelism, cfg: GPTConfig, batch: int, steps: int,
          lr: float = LR, seed: int = 0) -> dict[str, Any]:
    """One rank of any layout: ``run_steps`` on this rank's part of each batch.

    Args:
        par: the layout (:func:`dtlib.parallel_nd.parallelism`).
        cfg, batch, steps, lr, seed: the GPT, the global batch, SGD (momentum 0.9).
    Returns:
        ``losses``, ``grads`` (first step), ``params`` (after the last step), full
        tensors by name; ``comms``: step :data:`COMMS_STEP`'s collectives;
        ``local_numel``: parameter elements this rank stores; ``local_names``: the
        names of the parameters this rank's module holds (a stage's own).

    Taught in: Chapter 11, "Two dimensions, ours and torch's".
    """
    if steps <= COMMS_STEP:
        raise ValueError(f"steps={steps} must be > {COMMS_STEP} (the counted step)")
    device = ddist.world().device
    wrapped: nn.Module = par.apply(build_gpt(cfg, seed).to(device))
    config = RunConfig(steps, optimizer_class=torch.optim.SGD,
                       optimizer_kwargs={"lr": lr, "momentum": MOMENTUM})
    res = run_steps(par, None, gpt_batches(cfg, batch, device), config,
                    TrainState(wrapped), [CountComms(COMMS_STEP + 1)])
    return {"losses": res.losses, "grads": res.grads, "params": res.params,
            "comms": _records(res.comms),
            "local_numel": sum(local_tensor(p).numel() for p in wrapped.parameters()),
            "local_names": [n for n, _ in wrapped.named_parameters()]}


def _mesh_groups(mesh: Any) -> dict[str, tuple[int, ...]]:
    return {d: tuple(dist.get_process_group_ranks(mesh[d].get_group()))
            for d in mesh.mesh_dim_names}


def train_2d(variant: str, dp: int, tp: int, cfg: GPTConfig = TINY, batch: int = 8,
             steps: int = 3, lr: float = LR, seed: int = 0) -> dict[str, Any]:
    """One rank of tensor-parallel-inside, data-parallel-across training.

    Args:
        variant: "ours" (a rank grid and our layers) or "torch" (a DeviceMesh,
            DTensor TP and FSDP2 on the dp dimension).
        dp, tp: the grid; dp * tp is the world size; tp divides ``cfg.n_heads``.
        cfg, batch, steps, lr, seed: as :func:`reference` (batch divisible by dp).
    Returns:
        As :func:`train`, and ``groups``: ``{dim: ranks of this rank's group}``.

    Taught in: Chapter 11, "Two dimensions, ours and torch's".
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant={variant!r} is not one of {VARIANTS}")
    if variant == "ours":
        grid = ParallelDims(dp_shard=dp, tp=tp).grid(("dp", "tp"))
        out = train(parallelism("tp_dp", grid=grid), cfg, batch, steps, lr, seed)
        out["groups"] = {k: tuple(v) for k, v in grid.ranks.items()}
        return out
    mesh = ParallelDims(dp_shard=dp, tp=tp).mesh(("dp", "tp"))
    out = train(parallelism("fsdp_tp", mesh=mesh), cfg, batch, steps, lr, seed)
    out["groups"] = _mesh_groups(mesh)
    return out


def train_hsdp(replicate: int, shard: int, cfg: GPTConfig = TINY, batch: int = 8,
               steps: int = 3, lr: float = LR, seed: int = 0) -> dict[str, Any]:
    """One rank of HSDP: FSDP2 on a (replicate, shard) mesh; every rank its own rows.

    Returns:
        As :func:`train_2d`, with ``groups`` ``{"replicate": ..., "shard": ...}``.

    Taught in: Chapter 11, "HSDP: shard inside, replicate across".
    """
    mesh = ParallelDims(dp_replicate=replicate, dp_shard=shard).mesh(
        ("replicate", "shard"))
    out = train(parallelism("hsdp", mesh=mesh), cfg, batch, steps, lr, seed)
    out["groups"] = _mesh_groups(mesh)
    return out


def train_pp_dp(dp: int, pp: int, cfg: GPTConfig = PIPELINE, batch: int = 8,
                n_microbatches: int = 2, steps: int = 3, lr: float = LR,
                seed: int = 0) -> dict[str, Any]:
    """One rank of pipeline-inside, data-parallel-across training (ours).

    Each replica's pipeline runs Chapter 6's 1F1B on its rows of the batch, in
    ``n_microbatches`` micro-batches; then every stage averages its gradients with
    the same stage of the other replicas.

    Returns:
        As :func:`train_2d` (every stage's tensors, gathered over the pp group).

    Taught in: Chapter 11, "Pipeline inside, data parallel across".
    """
    return train_3d(dp, pp, 1, cfg, batch, n_microbatches, steps, lr, seed)


def train_fsdp_pp(dp: int, pp: int, cfg: GPTConfig = PIPELINE, batch: int = 8,
                  n_microbatches: int = 2, steps: int = 3, lr: float = LR,
                  seed: int = 0) -> dict[str, Any]:
    """One rank of torch's pipeline over FSDP2 stages (``Schedule1F1B``).

    Returns:
        As :func:`train_pp_dp` (every stage's tensors, gathered from their shards).

    Taught in: Chapter 11, "Pipeline inside, data parallel across".
    """
    mesh = ParallelDims(dp_shard=dp, pp=pp).mesh(("dp", "pp"))
    par = parallelism("fsdp_pp", mesh=mesh, schedule="1f1b", n_micro=n_microbatches)
    out = train(par, cfg, batch, steps, lr, seed)
    out["groups"] = _mesh_groups(mesh)
    return out


def train_3d(dp: int, pp: int, tp: int, cfg: GPTConfig = PIPELINE, batch: int = 8,
             n_microbatches: int = 2, steps: int = 3, lr: float = LR,
             seed: int = 0) -> dict[str, Any]:
    """One rank of dp x pp x tp training (ours): Megatron layers inside each
    pipeline stage, 1F1B across the stages, gradients averaged across replicas.

    The grid is ``arange(world).view(dp, pp, tp)``; the model is made tensor
    parallel first and then cut into stages (a stage shares the model's modules).

    Returns:
        As :func:`train_pp_dp`, every stage's tensors gathered to full size.

    Taught in: Chapter 11, "Three dimensions".
    """
    names = ("dp", "pp", "tp") if tp > 1 else ("dp", "pp")
    grid = ParallelDims(dp_shard=dp, pp=pp, tp=tp).grid(names)
    par = parallelism("pp_dp", grid=grid, schedule="1f1b", n_micro=n_microbatches)
    out = train(par, cfg, batch, steps, lr, seed)
    out["groups"] = {k: tuple(v) for k, v in grid.ranks.items()}
    out["stage_names"] = out["local_names"]
    return out


def comm_by_dim(result: dict[str, Any]) -> dict[str, dict[str, int]]:
    """The first step's collectives of one rank, summed per mesh dimension.

    Args:
        result: one rank's value from :func:`train_2d` or :func:`train_hsdp`.
    Returns:
        ``{dim: {op: bytes}}``; a collective whose group matches no dimension (the
        whole world, or a single rank) is filed under "other".

    Taught in: Chapter 11, "What crosses each dimension".
    """
    names = {ranks: dim for dim, ranks in result["groups"].items()}
    out: dict[str, dict[str, int]] = {}
    for rec in result["comms"]:
        dim = names.get(tuple(rec["ranks"]), "other")
        ops = out.setdefault(dim, {})
        ops[rec["op"]] = ops.get(rec["op"], 0) + rec["bytes"]
    return out


def all_layouts(dp: int, inner: int, cfg: GPTConfig = TINY, batch: int = 8,
                steps: int = 3) -> dict[str, dict[str, Any]]:
    """One rank of every 2-D layout in turn (one launch for the page and the test).

    Args:
        dp: replicas (the outer dimension).
        inner: the inner dimension: tp, HSDP's shard group, and pp.
        cfg, batch, steps: the GPT of the TP and HSDP layouts and the training;
            the pipeline layout trains ``PIPELINE`` (8 blocks) in 2 micro-batches.
    Returns:
        ``{"ours": ..., "torch": ..., "hsdp": ..., "pp_dp": ..., "fsdp_pp": ...}``:
        :func:`train_2d` ours and torch on a dp x tp grid, :func:`train_hsdp` on
        replicate=dp x shard=inner, :func:`train_pp_dp` and :func:`train_fsdp_pp`
        on dp x pp.

    Taught in: Chapter 11.
    """
    return {"ours": train_2d("ours", dp, inner, cfg, batch, steps),
            "torch": train_2d("torch", dp, inner, cfg, batch, steps),
            "hsdp": train_hsdp(dp, inner, cfg, batch, steps),
            "pp_dp": train_pp_dp(dp, inner, PIPELINE, batch, steps=steps),
            "fsdp_pp": train_fsdp_pp(dp, inner, PIPELINE, batch, steps=steps)}
