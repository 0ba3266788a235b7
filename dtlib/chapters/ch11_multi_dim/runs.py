"""Rank functions of Chapter 11: 2-D parallel training next to one process.

- :func:`train_2d`: tensor parallel inside, data parallel across, on a dp x tp
  grid: ``"ours"`` (hand-built groups, our TP layers in our DataParallel) or
  ``"torch"`` (``init_device_mesh``, ``parallelize_module``, ``fully_shard``);
- :func:`train_hsdp`: torch's HSDP on a ("replicate", "shard") mesh;
- :func:`train_pp_dp`: our pipeline (Chapter 6's 1F1B) inside our data parallel;
  :func:`train_fsdp_pp`: torch's ``Schedule1F1B`` over FSDP2-sharded stages;
- :func:`reference`: the same training on one process (the truth);
- :func:`comm_by_dim`: the first step's collectives, per mesh dimension.

Every rank function returns the losses, the first step's gradients and the
parameters after the last step as full CPU tensors, and its first step's
collectives with the ranks of the group each ran on.

Taught in: Chapter 11.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from dtlib.collectives.accounting import count_comms
from dtlib.models.gpt import GPTConfig, build_gpt, token_batch
from dtlib.models.reference import reference_gpt_run
from dtlib.models.sizes import size
from dtlib.parallel_nd import (average_across_replicas, build_grid_groups, data_shard,
                               fsdp_pipeline_stage, fsdp_tp, hsdp, pipeline_stage_of,
                               tp_inside_dp)
from dtlib.tensor_parallel.gpt import tensor_parallelize
from dtlib.pipeline_parallel.schedules import pipeline_step
from dtlib.runtime import dist as ddist
from dtlib.tensor_parallel.gpt import full_tensors

TINY = size("tiny")
PIPELINE = size("pipeline")  # 8 blocks, untied head: cut into 2 or 4 stages
IMPLS = ("ours", "torch")


def reference(cfg: GPTConfig = TINY, batch: int = 8, steps: int = 3,
              lr: float = 1e-3, seed: int = 0) -> dict[str, Any]:
    """One process, the whole batch: what every 2-D run must equal."""
    return reference_gpt_run(cfg, batch, steps, lr=lr, seed=seed)


def _records(log: Any) -> list[dict[str, Any]]:
    return [{"op": r.op, "bytes": r.bytes, "ranks": r.ranks}
            for r in log.records]


def _train(model: Any, net: Any, dp_index: int, dp: int, cfg: GPTConfig,
           batch: int, steps: int, lr: float, functional: bool,
           tp_group: Any = None) -> dict[str, Any]:
    """The loop shared by every layout: this replica's rows of each global batch."""
    device = ddist.world().device
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    out: dict[str, Any] = {"losses": []}
    for step in range(steps):
        idx, targets = token_batch(cfg, batch, seed=step, device=device)
        idx, targets = data_shard(idx, dp_index, dp), data_shard(targets, dp_index, dp)
        with count_comms(functional=functional) as log:
            loss = model(idx, targets)[1]
            loss.backward()
        if step == 0:
            out["comms"] = _records(log)
            out["grads"] = full_tensors(net, group=tp_group, grads=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        mean = loss.detach().clone()
        dist.all_reduce(mean)  # every replica's loss, each counted tp times
        out["losses"].append(mean.item() / dist.get_world_size())
    out["params"] = full_tensors(net, group=tp_group)
    out["local_numel"] = sum((p.to_local() if hasattr(p, "to_local") else p).numel()
                             for p in net.parameters())
    return out


def train_2d(impl: str, dp: int, tp: int, cfg: GPTConfig = TINY, batch: int = 8,
             steps: int = 3, lr: float = 1e-3, seed: int = 0) -> dict[str, Any]:
    """One rank of tensor-parallel-inside, data-parallel-across training.

    Args:
        impl: "ours" (a rank grid and our layers) or "torch" (a DeviceMesh, DTensor
            TP and FSDP2 on the dp dimension).
        dp, tp: the grid; dp * tp is the world size; tp divides ``cfg.n_heads``.
        cfg, batch, steps, lr, seed: as :func:`reference` (batch divisible by dp).
    Returns:
        ``losses``, ``grads`` (first step), ``params`` (after the last step), full
        tensors by name; ``comms``: the first step's collectives; ``groups``:
        ``{dim: ranks of this rank's group}``; ``local_numel``: parameter
        elements this rank stores.

    Taught in: Chapter 11, "Two dimensions, ours and torch's".
    """
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r} is not one of {IMPLS}")
    world = ddist.world()
    model = build_gpt(cfg, seed).to(world.device)
    if impl == "ours":
        grid = build_grid_groups(("dp", "tp"), (dp, tp))
        wrapped = tp_inside_dp(model, grid)
        out = _train(wrapped, wrapped.module, grid.coords["dp"], dp, cfg, batch,
                     steps, lr, functional=False, tp_group=grid.groups["tp"])
        out["groups"] = {k: tuple(v) for k, v in grid.ranks.items()}
        return out
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(world.device.type, (dp, tp), mesh_dim_names=("dp", "tp"))
    fsdp_tp(model, mesh)
    out = _train(model, model, mesh["dp"].get_local_rank(), dp, cfg, batch, steps,
                 lr, functional=True)
    out["groups"] = {d: tuple(dist.get_process_group_ranks(mesh[d].get_group()))
                     for d in ("dp", "tp")}
    return out


def train_hsdp(replicate: int, shard: int, cfg: GPTConfig = TINY, batch: int = 8,
               steps: int = 3, lr: float = 1e-3, seed: int = 0) -> dict[str, Any]:
    """One rank of HSDP: FSDP2 on a (replicate, shard) mesh; every rank its own rows.

    Returns:
        As :func:`train_2d`, with ``groups`` ``{"replicate": ..., "shard": ...}``.

    Taught in: Chapter 11, "HSDP: shard inside, replicate across".
    """
    from torch.distributed.device_mesh import init_device_mesh

    world = ddist.world()
    mesh = init_device_mesh(world.device.type, (replicate, shard),
                            mesh_dim_names=("replicate", "shard"))
    model = hsdp(build_gpt(cfg, seed).to(world.device), mesh)
    out = _train(model, model, world.rank, world.world_size, cfg, batch, steps, lr,
                 functional=True)
    out["groups"] = {d: tuple(dist.get_process_group_ranks(mesh[d].get_group()))
                     for d in ("replicate", "shard")}
    return out


def train_pp_dp(dp: int, pp: int, cfg: GPTConfig = PIPELINE, batch: int = 8,
                n_microbatches: int = 2, steps: int = 3, lr: float = 1e-3,
                seed: int = 0) -> dict[str, Any]:
    """One rank of pipeline-inside, data-parallel-across training (ours).

    Each replica's pipeline runs Chapter 6's 1F1B on its rows of the batch, in
    ``n_microbatches`` micro-batches; then every stage averages its gradients with
    the same stage of the other replicas.

    Returns:
        ``losses``; this stage's ``grads`` (first step) and ``params`` (after the
        last step) by the full model's names; ``comms`` and ``groups`` as
        :func:`train_2d`.

    Taught in: Chapter 11, "Pipeline inside, data parallel across".
    """
    return train_3d(dp, pp, 1, cfg, batch, n_microbatches, steps, lr, seed)


def train_fsdp_pp(dp: int, pp: int, cfg: GPTConfig = PIPELINE, batch: int = 8,
                  n_microbatches: int = 2, steps: int = 3, lr: float = 1e-3,
                  seed: int = 0) -> dict[str, Any]:
    """One rank of torch's pipeline over FSDP2 stages (``Schedule1F1B``).

    Returns:
        As :func:`train_pp_dp` (this stage's tensors, gathered from their shards).

    Taught in: Chapter 11, "Pipeline inside, data parallel across".
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import Schedule1F1B

    world = ddist.world()
    mesh = init_device_mesh(world.device.type, (dp, pp), mesh_dim_names=("dp", "pp"))
    stage, pstage = fsdp_pipeline_stage(build_gpt(cfg, seed).to(world.device), mesh)

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # the mean over micro-batches, as ours (the schedule only sums)
        return torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), targets.flatten()) / n_microbatches

    schedule = Schedule1F1B(pstage, n_microbatches, loss_fn=loss_fn,
                            scale_grads=False)
    opt = torch.optim.AdamW(stage.parameters(), lr=lr)
    index, last = mesh["pp"].get_local_rank(), pp - 1
    out: dict[str, Any] = {"losses": [], "groups": {
        d: tuple(dist.get_process_group_ranks(mesh[d].get_group()))
        for d in ("dp", "pp")}}
    for step in range(steps):
        idx, targets = token_batch(cfg, batch, seed=step, device=world.device)
        rows = [data_shard(t, mesh["dp"].get_local_rank(), dp) for t in (idx, targets)]
        losses: list[torch.Tensor] = []
        with count_comms(functional=True) as log:
            if index == 0:
                schedule.step(rows[0])
            elif index == last:
                schedule.step(target=rows[1], losses=losses)
            else:
                schedule.step()
        loss = torch.stack(losses).sum().detach() if index == last else \
            torch.zeros((), device=world.device)
        if step == 0:
            out["comms"] = _records(log)
            out["grads"] = {n: p.grad.full_tensor().cpu()
                            for n, p in stage.named_parameters()}
        opt.step()
        opt.zero_grad(set_to_none=True)
        dist.all_reduce(loss)  # the last stage of each replica holds its loss
        out["losses"].append(loss.item() / dp)
    out["params"] = {n: p.full_tensor().detach().cpu()
                     for n, p in stage.named_parameters()}
    return out


def train_3d(dp: int, pp: int, tp: int, cfg: GPTConfig = PIPELINE, batch: int = 8,
             n_microbatches: int = 2, steps: int = 3, lr: float = 1e-3,
             seed: int = 0) -> dict[str, Any]:
    """One rank of dp x pp x tp training (ours): Megatron layers inside each
    pipeline stage, 1F1B across the stages, gradients averaged across replicas.

    The grid is ``arange(world).view(dp, pp, tp)``; the model is made tensor
    parallel first and then cut into stages (a stage shares the model's modules).

    Returns:
        As :func:`train_pp_dp`, with this stage's tensors gathered to full size.

    Taught in: Chapter 11, "Three dimensions".
    """
    world = ddist.world()
    grid = build_grid_groups(("dp", "pp", "tp"), (dp, pp, tp))
    model = build_gpt(cfg, seed).to(world.device)
    if tp > 1:
        tensor_parallelize(model, grid.groups["tp"])
    stage = pipeline_stage_of(model, grid)
    mine = {n for n, _ in stage.named_parameters()}

    def full(grads: bool) -> dict[str, torch.Tensor]:
        every = full_tensors(model, group=grid.groups["tp"], grads=grads)
        return {n: t for n, t in every.items() if n in mine}

    opt = torch.optim.AdamW(stage.parameters(), lr=lr)
    shape = (batch // dp // n_microbatches, cfg.seq_len, cfg.hidden)

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1),
                                                 targets.flatten())

    out: dict[str, Any] = {"losses": [], "groups": {
        k: tuple(v) for k, v in grid.ranks.items()}}
    for step in range(steps):
        idx, targets = token_batch(cfg, batch, seed=step, device=world.device)
        rows = [data_shard(t, grid.coords["dp"], dp) for t in (idx, targets)]
        with count_comms(functional=False) as log:
            res = pipeline_step(stage, *rows, n_microbatches=n_microbatches,
                                act_shape=shape, loss_fn=loss_fn,
                                schedule="1f1b", group=grid.groups["pp"])
            average_across_replicas(stage, grid)
        if step == 0:
            out["comms"] = _records(log)
            out["grads"] = full(grads=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        mean = torch.tensor(res.loss, device=world.device)
        dist.all_reduce(mean)  # every replica's loss, each counted pp * tp times
        out["losses"].append(mean.item() / world.world_size)
    out["params"] = full(grads=False)
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


# ---- the planner against published runs (pure Python; no ranks) ----------------

def _gpt(n_layers: int, hidden: int, n_heads: int) -> Any:
    from dtlib.planner import ModelSpec
    from dtlib.planner.published import GPT_SEQ_LEN, GPT_VOCAB

    return ModelSpec(n_layers, hidden, n_heads, GPT_VOCAB, GPT_SEQ_LEN)


def _beside(est: Any, best: Any, best_est: Any) -> dict[str, Any]:
    """The planner's columns: its estimate of the published run, and its choice."""
    return {"planner TFLOP/s": round(est.tflops_per_gpu),
            "memory (GB)": round(est.memory_per_gpu_bytes / 1e9, 1),
            "fits": est.fits, "bubble": round(est.bubble_fraction, 3),
            "step (s)": round(est.step_time_s, 1), "planner's choice": best.label(),
            "its step (s)": round(best_est.step_time_s, 1)}


def table1_rows() -> list[dict[str, Any]]:
    """Narayanan et al. 2021, Table 1 beside the planner: the published (t, p, d)
    estimated as Megatron ran it (full recomputation, micro-batch 1), and the
    planner's own best configuration for the same GPUs and batch.

    Taught in: Chapter 11, "The planner against Megatron-LM".
    """
    from dtlib.planner import ClusterSpec, ParallelConfig, estimate, search
    from dtlib.planner.published import TABLE1

    rows = []
    for r in TABLE1:
        model = _gpt(r.n_layers, r.hidden, r.n_heads)
        cluster = ClusterSpec.preset("A100-80GB", r.n_gpus)
        est = estimate(model, cluster, ParallelConfig(
            r.dp, r.tp, r.pp, recompute="full", sequence_parallel=False), r.batch)
        # the options of 2021: no distributed optimizer (ZeRO) in Megatron-LM yet
        best, best_est = search(model, cluster, r.batch, zero_stages=(0,))[0]
        rows.append({"params (B)": r.params_b, "GPUs": r.n_gpus, "batch": r.batch,
                     "published t,p,d": f"{r.tp},{r.pp},{r.dp}",
                     "published TFLOP/s": r.tflops_per_gpu,
                     **_beside(est, best, best_est)})
    return rows


def table2_rows() -> list[dict[str, Any]]:
    """Narayanan et al. 2021, Table 2 (PTD-P vs ZeRO-3) beside the planner.

    Taught in: Chapter 11, "The planner against Megatron-LM".
    """
    from dtlib.planner import ClusterSpec, ParallelConfig, estimate
    from dtlib.planner.published import TABLE2, TABLE2_SHAPES

    rows = []
    for r in TABLE2:
        model = _gpt(**TABLE2_SHAPES[r.params_b])
        tp, pp, zero = (8, r.model_parallel // 8, 0) if r.scheme == "PTD-P" \
            else (1, 1, 3)
        config = ParallelConfig(r.n_gpus // (tp * pp), tp, pp, zero_stage=zero,
                                micro_batch=r.micro_batch, recompute="full",
                                sequence_parallel=False)
        est = estimate(model, ClusterSpec.preset("A100-80GB", r.n_gpus), config,
                       r.batch)
        rows.append({"scheme": r.scheme, "params (B)": r.params_b, "GPUs": r.n_gpus,
                     "batch": r.batch, "micro-batch": r.micro_batch,
                     "published TFLOP/s": r.tflops_per_gpu,
                     "planner TFLOP/s": round(est.tflops_per_gpu),
                     "dominant overhead": est.breakdown.dominant})
    return rows


def llama_rows() -> list[dict[str, Any]]:
    """Dubey et al. 2024, Table 4 (Llama 3 405B) beside the planner: the published
    configuration (FSDP without resharding after forward, i.e. ZeRO-2's memory;
    FlashAttention modelled as "selective"), and
    the planner's best for the same GPUs, sequence and batch.

    Taught in: Chapter 11, "The planner against Llama 3".
    """
    from dtlib.planner import ClusterSpec, ModelSpec, ParallelConfig, estimate, search
    from dtlib.planner.published import LLAMA3_405B, TABLE4_LLAMA3

    rows = []
    for r in TABLE4_LLAMA3:
        model = ModelSpec(seq_len=r.seq_len, **LLAMA3_405B)
        cluster = ClusterSpec.preset("H100-80GB", r.n_gpus)
        config = ParallelConfig(dp=r.dp, tp=r.tp, pp=r.pp, cp=r.cp, zero_stage=2,
                                recompute="selective")
        est = estimate(model, cluster, config, r.global_batch)
        best, best_est = search(model, cluster, r.global_batch)[0]
        rows.append({"GPUs": r.n_gpus, "seq": r.seq_len,
                     "published tp,cp,pp,dp": f"{r.tp},{r.cp},{r.pp},{r.dp}",
                     "published TFLOP/s": r.tflops_per_gpu,
                     **_beside(est, best, best_est)})
    return rows
