"""The capstone: one training script that puts the book's techniques together.

    torchrun --nproc_per_node=4 -m dtlib.train --strategy ddp --precision bf16 \\
        --accum-steps 2 --ckpt-dir ckpt --steps 100

Read top to bottom it is the book in order: join the world (Chapter 0), check that the
model states fit (Chapter 1), shard the data per rank (Chapter 3), wrap the model in
DDP or FSDP2 (Chapters 3-4), train in bf16 (Chapter 7) with gradient accumulation
(Chapter 8), and save/resume the whole state (Chapter 9). The same code runs on CPU
with gloo and on GPUs with NCCL: only :mod:`dtlib.runtime.dist` knows which.

Taught in: Chapter 10, "One training script".
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from dataclasses import asdict
from typing import Any, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel as DDP

from dtlib.runtime import dist as ddist
from dtlib.checkpoint.state import ResumableSampler
from dtlib.tensor_parallel.gpt import dtensor_parallelize
from dtlib.zero.fsdp import bf16_policy, shard_fsdp2
from dtlib.memory.formulas import GB, ModelStates, model_state_bytes
from dtlib.train.config import TrainConfig, parse_args
from dtlib.train.model import build_model, count_params, logits_of
from dtlib.train.state import param_digest, resume, save_state

__all__ = ["TrainConfig", "DoesNotFit", "SyntheticTokens", "check_memory",
           "prepare_model", "clip_grad_norm", "lr_lambda", "main"]


class DoesNotFit(RuntimeError):
    """The model states alone exceed the device's memory (ERRATA 34)."""


def check_memory(n_params: int, strategy: str, world_size: int,
                 device_gb: float | None) -> ModelStates:
    """Model-state bytes per device for ``strategy``; raise if they cannot fit.

    DDP keeps everything on every rank (ZeRO stage 0); FSDP2 shards parameters,
    gradients and AdamW state over the ``world_size`` ranks (stage 3). The script keeps
    fp32 parameters and optimizer state in every precision (autocast and FSDP's
    MixedPrecisionPolicy compute in bf16 but store fp32): 4 + 4 + 8 = 16 B/param.

    Args:
        n_params: parameters of the model.
        strategy: "ddp" or "fsdp".
        world_size: data-parallel ranks.
        device_gb: the device's memory in GB (1e9 B); None (CPU) only estimates.
    Returns:
        The :class:`dtlib.memory.ModelStates` per device.
    Raises:
        DoesNotFit: the states exceed ``device_gb`` before a single activation.

    Taught in: Chapter 10, "Refuse what cannot fit" (formula: Chapter 1).
    """
    if strategy not in ("ddp", "fsdp"):
        raise ValueError(f"strategy={strategy!r} is not allowed; allowed: ddp, fsdp")
    stage = 0 if strategy == "ddp" else 3
    states = model_state_bytes(n_params, zero_stage=stage, dp=world_size,
                               precision="fp32", optimizer="adam")
    if device_gb is not None and states.total > device_gb * GB:
        raise DoesNotFit(
            f"{strategy} on {world_size} ranks needs {states.total / GB:.1f} GB of "
            f"model states per device (ZeRO stage {stage}, 16 B/param x "
            f"{n_params:.3g} params) but the device has {device_gb:.0f} GB; use "
            f"--strategy fsdp, more ranks or a smaller model")
    return states


class SyntheticTokens(torch.utils.data.Dataset):
    """Deterministic sequences ``x[t+1] = (5 x[t] + 3) mod V`` with 10% random tokens.

    Learnable (the loss falls well below ln V) and the same on every rank and every
    run with the same seed, so runs of different world sizes see the same data.
    """

    def __init__(self, n: int, seq_len: int, vocab_size: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        data = torch.empty(n, seq_len + 1, dtype=torch.long)
        data[:, 0] = torch.randint(0, vocab_size, (n,), generator=g)
        for t in range(seq_len):
            data[:, t + 1] = (5 * data[:, t] + 3) % vocab_size
        noise = torch.rand(n, seq_len + 1, generator=g) < 0.1
        data[noise] = torch.randint(0, vocab_size, (int(noise.sum()),), generator=g)
        self.data = data  # (n, seq_len + 1)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[i, :-1], self.data[i, 1:]


def next_micro_batch(data: SyntheticTokens, sampler: ResumableSampler,
                     micro_batch: int, device: torch.device
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """The next ``micro_batch`` samples of this rank; a new epoch when one runs out."""
    if len(sampler) < micro_batch:  # drop the ragged end, like drop_last=True
        sampler.set_epoch(sampler.epoch + 1)
    it = iter(sampler)  # starts at sampler.position: resumable mid-epoch
    rows = data.data[[next(it) for _ in range(micro_batch)]]
    return rows[:, :-1].to(device), rows[:, 1:].to(device)


def settle_ddp_buckets(model: nn.Module, x: torch.Tensor) -> None:
    """One forward and backward whose gradients are thrown away, so that DDP has
    rebuilt its buckets before the first real step, in a fresh and a resumed run.

    DDP's first backward records the order gradients become ready and its next
    forward regroups the buckets by it. Bucket layout decides how gloo's ring cuts
    each buffer, hence the order in which the ranks' values are added: with 2 ranks
    a + b = b + a, with 4 the sums differ in the last bits. Without this, a resumed
    process runs its first step on the initial buckets where the uninterrupted run
    used rebuilt ones, and the 4-rank resume is not bit-exact. The generators are
    restored, so no random draw is consumed.

    Taught in: Chapter 9, "Exact resume under DDP".
    """
    rng = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state(x.device) if x.device.type == "cuda" else None
    (logits_of(model(x)).float().sum() * 0.0).backward()
    model.zero_grad(set_to_none=True)
    torch.set_rng_state(rng)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda, x.device)


def prepare_model(model: nn.Module, strategy: str, device: torch.device,
                  precision: str = "fp32", sync_bn: bool | None = None,
                  mesh: Any = None) -> nn.Module:
    """BatchNorm -> SyncBatchNorm, move to ``device``, *then* wrap (ERRATA 33).

    DDP and FSDP register the parameters and buffers they see when they wrap; a
    module swapped in afterwards is not what they synchronise, so the conversion comes
    first (the PyTorch docs' order). The book's GPT, like Llama, has LayerNorm/RMSNorm
    and no BatchNorm: the conversion is then a no-op, kept for models that have one.

    Args:
        model: the unwrapped model, identical on every rank.
        strategy: "ddp" or "fsdp"; precision: "bf16" gives FSDP a bf16 policy.
        device: this rank's device (from :mod:`dtlib.runtime.dist`: local rank, ERRATA 35).
        sync_bn: convert BatchNorm; None converts on CUDA only (DDP refuses
            SyncBatchNorm on CPU, where each rank keeps its own batch statistics).
        mesh: fsdp with tensor parallelism: a 2-D ``DeviceMesh`` ("dp", "tp"); the
            GPT's blocks are split across ``mesh["tp"]`` (Chapter 5's DTensor plan),
            then FSDP2 shards across ``mesh["dp"]`` (TP inside, FSDP across, as
            Chapter 11's ``fsdp_tp``).
    Returns:
        The wrapped model.

    Taught in: Chapter 10, "Wrap in the right order".
    """
    if sync_bn if sync_bn is not None else device.type == "cuda":
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = model.to(device)
    if strategy == "fsdp":
        if mesh is not None:
            dtensor_parallelize(model, mesh["tp"])
        return shard_fsdp2(model, mp_policy=bf16_policy() if precision == "bf16"
                           else None, mesh=None if mesh is None else mesh["dp"])
    # ERRATA 35: the device index is the LOCAL rank (dtlib.runtime.dist chose it), never RANK.
    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None)


def clip_grad_norm(params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """Scale the gradients so that their global L2 norm is at most ``max_norm``.

    ``torch.nn.utils.clip_grad_norm_`` stacks the per-parameter norms, which fails
    when they are DTensors on different meshes: under FSDP2 x TP the blocks' weights
    live on the 2-D (dp, tp) mesh, the embeddings and head on ``mesh["dp"]`` alone.
    Here each norm is made a full (replicated) tensor first: one small collective
    per parameter, on its own mesh.

    Returns:
        The total norm before clipping (a plain scalar tensor).

    Taught in: Chapter 10, "One training script" (Chapter 11: several meshes).
    """
    grads = [p.grad for p in params if p.grad is not None]
    norms = [torch.linalg.vector_norm(g) for g in grads]
    norms = [n.full_tensor() if hasattr(n, "full_tensor") else n for n in norms]
    total = torch.linalg.vector_norm(torch.stack(norms))
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef)
    return total


def lr_lambda(step: int, warmup: int, steps: int, min_lr_ratio: float) -> float:
    """Learning-rate multiplier: linear warm-up, then cosine decay to min_lr_ratio."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, steps - warmup))
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def main(argv: Sequence[str] | None = None) -> float:
    """Parse flags, train, and return the final step's global mean loss.

    Taught in: Chapter 10, "One training script".
    """
    cfg = parse_args(argv)  # a bad flag fails here, before any process starts work
    owns_group = not dist.is_initialized()
    world = ddist.init()  # rank, local_rank, world_size, backend and device
    try:
        return _train(cfg, world)
    finally:
        if owns_group:
            ddist.destroy()


def _train(cfg: TrainConfig, world: ddist.World) -> float:
    device, ws = world.device, world.world_size
    # ERRATA 34: count before allocating: the model itself, built on the meta device
    # (shapes only), whatever it is (the GPT, a HF Llama, a config.json).
    n_params = count_params(cfg)
    device_gb = (torch.cuda.get_device_properties(device).total_memory / GB
                 if device.type == "cuda" else None)
    states = check_memory(n_params, cfg.strategy, ws, device_gb)
    # --tp: a (dp, tp) mesh, TP inside each row, data parallel across (Chapter 11).
    dp = ws // cfg.tp
    mesh = init_device_mesh(device.type, (dp, cfg.tp), mesh_dim_names=("dp", "tp")) \
        if cfg.tp > 1 else None
    dp_rank = mesh["dp"].get_local_rank() if mesh is not None else world.rank
    dp_group = mesh["dp"].get_group() if mesh is not None else None
    model: nn.Module = build_model(cfg)  # same weights on every rank
    model = prepare_model(model, cfg.strategy, device, cfg.precision, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr,  # after wrapping (FSDP)
                            weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_lambda(
        s, cfg.warmup, cfg.steps, cfg.min_lr_ratio))
    data = SyntheticTokens(cfg.dataset_size, cfg.seq_len, cfg.vocab_size, cfg.seed)
    # Shard by dp rank only: the tp ranks of one row see the same batch.
    sampler = ResumableSampler(len(data), rank=dp_rank, world_size=dp,
                               seed=cfg.seed)
    # fp16 needs a loss scaler, bf16 does not (Chapter 7); it is part of the state,
    # so it exists before resume() restores its scale.
    scaler = torch.amp.GradScaler(device.type, init_scale=cfg.loss_scale) \
        if cfg.precision == "fp16" else None
    start = resume(cfg, model, opt, sched, sampler, scaler)
    # Autocast under DDP (fp32 weights, bf16/fp16 matmuls); FSDP's bf16 comes from its
    # MixedPrecisionPolicy.
    low = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.precision)
    use_autocast = low is not None and cfg.strategy == "ddp"
    # No padding in this data: the global token count of a step is known up front
    # (Chapter 8 all-reduces it when batches are ragged).
    global_tokens = cfg.tokens_per_micro_batch * cfg.accum_steps * dp
    ddist.rprint(f"{cfg.model}, {cfg.strategy} on {ws} x {device} ({world.backend}), "
                 f"{n_params:,} params, model states {states.total / GB:.4f} GB/device, global "
                 f"batch {cfg.micro_batch * cfg.accum_steps * dp} sequences"
                 + (f", mesh dp {dp} x tp {cfg.tp}" if mesh is not None else "")
                 + (f", resumed at step {start}" if start else ""))
    if cfg.strategy == "ddp" and ws > 1:  # same buckets fresh or resumed (4 ranks)
        settle_ddp_buckets(model, data.data[:cfg.micro_batch, :-1].to(device))
    losses: dict[int, float] = {}
    step, t0, loss = start, time.perf_counter(), float("nan")
    while step < cfg.steps:
        loss_sum = torch.zeros((), device=device)
        for i in range(cfg.accum_steps):
            last = i == cfg.accum_steps - 1
            x, y = next_micro_batch(data, sampler, cfg.micro_batch, device)
            # Gradient sync only on the last micro-batch (Chapter 8).
            if cfg.strategy == "fsdp":
                model.set_requires_gradient_sync(last)
            quiet = model.no_sync() if cfg.strategy == "ddp" and not last \
                else contextlib.nullcontext()
            amp = torch.autocast(device.type, dtype=low) if use_autocast \
                else contextlib.nullcontext()
            with quiet:
                with amp:
                    logits = logits_of(model(x))  # a HF model: ModelOutput.logits
                tok_loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(),
                                           reduction="sum")
                # DDP/FSDP average over the dp ranks: x dp turns it into the global
                # mean (the tp ranks of a row hold the same, replicated, loss).
                scaled = tok_loss * (dp / global_tokens)
                (scaler.scale(scaled) if scaler else scaled).backward()
            loss_sum += tok_loss.detach()
        if scaler:
            scaler.unscale_(opt)
        if cfg.grad_clip > 0 and mesh is not None:  # DTensors on two meshes
            clip_grad_norm(list(model.parameters()), cfg.grad_clip)
        elif cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        step += 1
        if dp > 1:  # for logging: the global mean loss (over dp: tp ranks agree)
            dist.all_reduce(loss_sum, group=dp_group)
        loss = losses[step] = float(loss_sum) / global_tokens
        if cfg.ckpt_dir and (step % cfg.save_every == 0 or step == cfg.steps):
            save_state(cfg, step, model, opt, sched, sampler, scaler)
        if step % cfg.log_every == 0 or step == cfg.steps:
            rate = (step - start) * global_tokens / (time.perf_counter() - t0)
            ddist.rprint(f"step {step:5d} | loss {loss:.4f} | lr "
                         f"{sched.get_last_lr()[0]:.2e} | {rate:,.0f} tokens/s")
        if cfg.stop_after and step - start >= cfg.stop_after:
            ddist.rprint(f"stopping after step {step} (simulated crash: no final save)")
            break
    return _summarise(cfg, world, model, start, step, losses, loss,
                      scaler.get_scale() if scaler else None)


def _summarise(cfg: TrainConfig, world: ddist.World, model: nn.Module, start: int,
               step: int, losses: dict[int, float], loss: float,
               loss_scale: float | None = None) -> float:
    digest, norm = param_digest(model)  # every rank: a collective under FSDP
    summary = {"start_step": start, "end_step": step, "final_loss": loss,
               "losses": losses, "param_sha256": digest, "param_norm": norm,
               "world_size": world.world_size, "loss_scale": loss_scale,
               "config": asdict(cfg)}
    ddist.rprint(f"done: steps {start}->{step}, final loss {loss:.4f}, "
                 f"params {digest} (norm {norm:.6f})")
    if world.is_main and cfg.summary_json:
        with open(cfg.summary_json, "w") as f:
            json.dump(summary, f)
    return loss

