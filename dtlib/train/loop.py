"""The capstone: one training script that puts the book's techniques together.

    torchrun --nproc_per_node=4 -m dtlib.train --strategy ddp --precision bf16 \\
        --accum-steps 2 --ckpt-dir ckpt --steps 100

Read top to bottom it is the book in order: join the world (Chapter 0), build the job
(:func:`dtlib.train.job.build_job`: check that the model states fit, Chapter 1; the
strategy's technique from a table, DDP or FSDP2, Chapters 3-4, FSDP x TP, Chapter 11;
bf16, Chapter 7; accumulation, Chapter 8; this rank's data, Chapter 3), resume it
(Chapter 9), and train it with the one loop every chapter uses,
:func:`dtlib.models.run.run_steps`; logging, saving and the simulated crash ride on
its ``on_step``. The same code runs on CPU with gloo and on GPUs with NCCL: only
:mod:`dtlib.runtime.dist` knows which.

Taught in: Chapter 10, "One training script".
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from typing import Any, Sequence

import torch.distributed as dist

from dtlib.memory.formulas import GB
from dtlib.models.run import RunResult, run_steps
from dtlib.runtime import dist as ddist
from dtlib.train.config import TrainConfig, parse_args
from dtlib.train.job import Job, build_job
from dtlib.train.state import param_digest, resume, save_state

__all__ = ["TrainConfig", "main", "train"]


def main(argv: Sequence[str] | None = None) -> float:
    """Parse flags, train, and return the final step's global mean loss.

    Taught in: Chapter 10, "One training script".
    """
    cfg = parse_args(argv)  # a bad flag fails here, before any process starts work
    owns_group = not dist.is_initialized()
    world = ddist.init()  # rank, local_rank, world_size, backend and device
    try:
        return train(cfg, world)["final_loss"]
    finally:
        if owns_group:
            ddist.destroy()


def train(cfg: TrainConfig, world: ddist.World) -> dict[str, Any]:
    """Build, resume and train the job ``cfg`` describes; return its summary.

    Args:
        cfg: the validated configuration; world: this process's world.
    Returns:
        The summary (every rank): ``start_step``, ``end_step``, ``final_loss``,
        ``losses`` (str(step) -> global mean loss, as JSON keeps it),
        ``param_sha256``, ``param_norm``, ``world_size``, ``loss_scale``,
        ``config``; rank 0 also writes it to ``cfg.summary_json``.

    Taught in: Chapter 10, "One training script".
    """
    job = build_job(cfg, world)
    start = resume(job)
    _announce(job, start)
    if job.strategy.warm_up is not None and job.par.dp_size > 1:
        x = job.data.data[:cfg.micro_batch, :-1].to(world.device)
        job.strategy.warm_up(job.model, x)  # DDP: same buckets fresh or resumed
    t0 = time.perf_counter()

    def on_step(step: int, loss: float, extra: dict[str, Any]) -> bool:
        if cfg.ckpt_dir and (step % cfg.save_every == 0 or step == cfg.steps):
            save_state(job, step)
        if step % cfg.log_every == 0 or step == cfg.steps:
            rate = (step - start) * job.global_tokens / (time.perf_counter() - t0)
            ddist.rprint(f"step {step:5d} | loss {loss:.4f} | lr "
                         f"{job.scheduler.get_last_lr()[0]:.2e} | {rate:,.0f} tokens/s")
        if cfg.stop_after and step - start >= cfg.stop_after:
            ddist.rprint(f"stopping after step {step} (simulated crash: no final save)")
            return True
        return False

    result = run_steps(job.par, job.model, job.batch_fn, cfg.steps, start=start,
                       local=True, wrapped=job.model, optimizer=job.optimizer,
                       scheduler=job.scheduler, scaler=job.scaler,
                       step_fn=job.step_fn,
                       max_grad_norm=cfg.grad_clip if cfg.grad_clip > 0 else None,
                       record_grads=False, record_params=False, on_step=on_step)
    return _summarise(job, start, result)


def _announce(job: Job, start: int) -> None:
    cfg, world, dp = job.cfg, job.world, job.par.dp_size
    ddist.rprint(f"{cfg.model}, {cfg.strategy} on {world.world_size} x {world.device} "
                 f"({world.backend}), {job.n_params:,} params, model states "
                 f"{job.states.total / GB:.4f} GB/device, global batch "
                 f"{cfg.micro_batch * cfg.accum_steps * dp} sequences"
                 + (f", mesh dp {dp} x tp {cfg.tp}" if cfg.tp > 1 else "")
                 + (f", resumed at step {start}" if start else ""))


def _summarise(job: Job, start: int, result: RunResult) -> dict[str, Any]:
    cfg, world = job.cfg, job.world
    losses = {str(start + i + 1): loss for i, loss in enumerate(result.losses)}
    step = start + len(result.losses)
    loss = result.losses[-1] if result.losses else float("nan")
    digest, norm = param_digest(job.model)  # every rank: a collective under FSDP
    summary = {"start_step": start, "end_step": step, "final_loss": loss,
               "losses": losses, "param_sha256": digest, "param_norm": norm,
               "world_size": world.world_size,
               "loss_scale": job.scaler.get_scale() if job.scaler else None,
               "config": asdict(cfg)}
    ddist.rprint(f"done: steps {start}->{step}, final loss {loss:.4f}, "
                 f"params {digest} (norm {norm:.6f})")
    if world.is_main and cfg.summary_json:
        with open(cfg.summary_json, "w") as f:
            json.dump(summary, f)
    return summary
