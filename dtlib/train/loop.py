"""The capstone: one training script that puts the book's techniques together.

    torchrun --nproc_per_node=4 -m dtlib.train --strategy ddp --precision bf16 \\
        --accum-steps 2 --ckpt-dir ckpt --steps 100

Read top to bottom it is the book in order: join the world (Chapter 0), build the job
(:func:`dtlib.train.job.build_job`: check that the model states fit, Chapter 1; the
strategy's technique from a table, DDP or FSDP2, Chapters 3-4, FSDP x TP, Chapter 11;
bf16, Chapter 7; accumulation, Chapter 8; this rank's data, Chapter 3), resume it
(Chapter 9), and train it with the one loop every chapter uses,
:func:`dtlib.models.run.run_steps`; logging (:mod:`dtlib.train.metrics`), saving,
evaluation, the simulated crash and a preemption signal (:mod:`dtlib.train.faults`)
are one :class:`~dtlib.models.run.Callback` at the loop's named points (``on_save``,
``on_eval``, ``on_step_end``, ``should_stop``). The same code runs on CPU with gloo
and on GPUs with NCCL: only :mod:`dtlib.runtime.dist` knows which.

Taught in: Chapter 10, "One training script".
"""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import asdict
from typing import Any, Sequence

import torch
import torch.distributed as dist

from dtlib.memory.formulas import GB
from dtlib.models.run import Callback, Every, RunResult, StepEnd, run_steps
from dtlib.runtime import dist as ddist
from dtlib.train.async_save import BackgroundSaver
from dtlib.train.config import TrainConfig, parse_args
from dtlib.train.faults import SIGNALS, Preemption, kill_rehearsal, retain
from dtlib.train.identity import Refusal, check_directory, fingerprint
from dtlib.train.job import Job, build_job, plain_hook
from dtlib.planner.measure import matmul_flops
from dtlib.train.metrics import RunLog, evaluate, flops_per_token, peak_memory
from dtlib.train.state import export_hf, param_digest, resume, save_state

__all__ = ["TrainConfig", "main", "train", "Capstone"]


def main(argv: Sequence[str] | None = None) -> float:
    """Parse flags, train, and return the final step's global mean loss.

    Taught in: Chapter 10, "One training script".
    """
    cfg = parse_args(argv)  # a bad flag fails here, before any process starts work
    owns_group = not dist.is_initialized()
    world = ddist.init()  # rank, local_rank, world_size, backend and device
    try:
        return train(cfg, world)["final_loss"]
    except Refusal as exc:  # found after start-up: every rank refuses alike
        if world.is_main:
            print(f"python -m dtlib.train: error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
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
        ``eval_losses`` (str(step) -> held-out loss), ``preempted`` (the signal's
        name or None), ``verified_files`` (of a resumed sharded checkpoint, this
        rank's), ``startup_bytes`` (this rank's parameter storage during set-up:
        ``Job.startup_bytes``), ``n_params``, ``config``, ``resumed`` (what the
        resume loaded and checked), ``save_s`` (this rank's seconds per save);
        rank 0 also writes it to ``cfg.summary_json``.
    Raises:
        Refusal: ``cfg.ckpt_dir`` or its log belongs to another run, or a resume
            would change what it may not (:mod:`dtlib.train.identity`): nothing
            was built, loaded or written.

    Taught in: Chapter 10, "One training script".
    """
    # Before any model or file exists: may this run use cfg.ckpt_dir (and its log)?
    check_directory(cfg, world.world_size)
    ddist.rprint(f"setting up: {cfg.model} for {cfg.strategy} on {world.world_size} "
                 f"rank(s) ({world.backend}, {world.device.type})", flush=True)
    job = build_job(cfg, world)
    start = resume(job)
    _announce(job, start)
    identity = job.identity
    window = _preemption_window(job)
    if job.strategy.warm_up is not None and job.par.dp_size > 1 \
            and not cfg.diloco:  # DiLoCo's replicas are not wrapped in DDP
        x = job.data.rows(torch.arange(cfg.micro_batch))[:, :-1].to(world.device)
        with plain_hook(job):  # PowerSGD's memory is not the warm-up's to change
            job.strategy.warm_up(job.model, x)  # DDP: same buckets fresh or resumed
    log = RunLog(cfg.log_file or (os.path.join(cfg.ckpt_dir, "train_log.jsonl")
                                  if cfg.ckpt_dir else None), cfg.tensorboard)
    log.header({"run": fingerprint(identity), "start_step": start,
                "world_size": world.world_size, "strategy": cfg.strategy})
    flops = flops_per_token(job.n_params, cfg.n_layers, cfg.seq_len, cfg.hidden) \
        * job.global_tokens  # per step, every device together
    peak = _peak_flops(job)
    stop = Preemption()
    batch_fn = kill_rehearsal(job.batch_fn, cfg.kill_at_step, world.world_size - 1)
    saver = BackgroundSaver(job, published=lambda: retain(
        cfg.ckpt_dir, cfg.keep_last, identity)) if cfg.async_save and cfg.ckpt_dir \
        else None
    capstone = Capstone(job, start, log, flops, peak, window, saver, stop)
    # Saves at every --save-every-th step and the last; evaluations likewise.
    config = job.run_config(start=start, save=Every(cfg.save_every, last=True),
                            evaluate=Every(cfg.eval_every, last=cfg.eval_every > 0))
    with stop:
        result = run_steps(job.par, None, batch_fn, config, job.train_state,
                           [capstone])
    if saver is not None:
        saver.close()  # the last save is written and published before we leave
        if saver.written is not None and saver.written[0] not in window.steps:
            window.saved(*saver.written, result.step_times[-1] if result.step_times
                         else None)
    log.close()
    if cfg.export_hf:
        export_hf(job, cfg.export_hf)
    result.extra.update(eval_losses=capstone.evals, preempted=capstone.preempted,
                        save_s=window.seconds)
    return _summarise(job, start, result)


class Capstone(Callback):
    """What the capstone adds to the one loop, at its named points: saves
    (``on_save``), evaluations (``on_eval``), the log line (``on_step_end``), and
    leaving the loop (``should_stop``) for the simulated crash (``--stop-after``)
    or a preemption signal (saving first). The loop's step times leave all of
    this out."""

    def __init__(self, job: Job, start: int, log: RunLog, flops: int,
                 peak: tuple[float, str], window: "_Window",
                 saver: BackgroundSaver | None, stop: Preemption) -> None:
        self.job, self.cfg, self.start, self.log = job, job.cfg, start, log
        self.flops, self.peak, self.window = flops, peak, window
        self.saver, self.stop = saver, stop
        self.evals: dict[str, float] = {}
        self.times: list[float] = []  # the step times since the last log line
        self.saved_at: int | None = None
        self.preempted: str | None = None

    def on_save(self, end: StepEnd) -> None:
        if self.cfg.ckpt_dir:
            self._save(end)

    def _save(self, end: StepEnd) -> None:
        cfg, step = self.cfg, end.step
        self.saved_at = step
        if self.saver is None:
            self.window.saved(step, save_state(self.job, step), end.seconds)
            retain(cfg.ckpt_dir, cfg.keep_last, self.job.identity)
            return
        self.saver.save(step)  # waits for the previous save, stages this one
        written = self.saver.written
        if written is not None and written[0] not in self.window.steps:
            self.window.saved(*written, end.seconds)

    def on_eval(self, end: StepEnd) -> None:
        self.evals[str(end.step)] = value = evaluate(self.job)
        self.log.write({"step": end.step, "eval_loss": value},
                       f"step {end.step:5d} | eval loss {value:.4f} (held out)")

    def on_step_end(self, end: StepEnd) -> None:
        cfg, step = self.cfg, end.step
        self.times.append(end.seconds)
        if step == self.start + 1:
            ddist.rprint(f"step {step} took {end.seconds:.2f} s (the first step "
                         "includes one-time work: allocation, buckets, kernels' "
                         "first calls)", flush=True)
        if step == cfg.steps or (cfg.log_every and step % cfg.log_every == 0):
            mean = sum(self.times) / len(self.times)
            self.times = []
            # The norm is always measured: run_config clips to inf at --grad-clip 0.
            _log_step(self.job, self.log, step, end.loss, float(end.grad_norm), mean,
                      self.flops, self.peak)

    def should_stop(self, end: StepEnd) -> bool:
        cfg, step = self.cfg, end.step
        if cfg.stop_after and step - self.start >= cfg.stop_after:
            ddist.rprint(f"stopping after step {step} (simulated crash: no final "
                         "save)")
            return True
        signal_name = self.stop.requested()  # every rank, every step: they agree
        if not signal_name:
            return False
        if cfg.ckpt_dir and self.saved_at != step:
            self._save(end)
        ddist.rprint(f"{signal_name} received: " + (
            f"saved step {step}" if cfg.ckpt_dir else "no --ckpt-dir to save to")
            + ", leaving the loop (exit status 0)")
        self.preempted = signal_name
        return True


def _peak_flops(job: Job) -> tuple[float, str]:
    """(one device's peak FLOP/s, where it comes from): ``--peak-flops``, or a
    matmul in the run's compute dtype measured on rank 0's device."""
    cfg = job.cfg
    if cfg.peak_flops:
        return cfg.peak_flops, "--peak-flops"
    if not job.world.is_main:  # only rank 0 logs
        return math.nan, "not measured on this rank"
    dtype = torch.bfloat16 if cfg.precision == "bf16" else torch.float16 \
        if cfg.precision == "fp16" and job.world.device.type == "cuda" \
        else torch.float32
    ddist.rprint("measuring one device's matmul rate for MFU (--peak-flops skips "
                 "it) ...", flush=True)
    n = 4096 if job.world.device.type == "cuda" else 512  # a few milliseconds each
    peak = matmul_flops(n, n, n, seconds=0.0, device=job.world.device, dtype=dtype)[1]
    source = f"measured: {str(dtype).replace('torch.', '')} matmul"
    ddist.rprint(f"MFU is over a peak of {peak / 1e12:.3g} TFLOP/s per device "
                 f"({source}; give --peak-flops for the datasheet's)")
    return peak, source


def _log_step(job: Job, log: RunLog, step: int, loss: float, grad_norm: float,
              step_time: float, flops: int, peak: tuple[float, str]) -> None:
    """One line and one JSON record: what a practitioner reads at ``step``."""
    rate = job.global_tokens / step_time
    mfu = flops / step_time / (job.world.world_size * peak[0])
    mem, kind = peak_memory(job.world.device)
    lr = job.scheduler.get_last_lr()[0]
    log.write({"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm,
               "step_time_s": step_time, "tokens_per_s": rate, "mfu": mfu,
               "peak_flops": peak[0], "peak_flops_source": peak[1],
               "peak_memory_bytes": mem, "peak_memory_kind": kind},
              f"step {step:5d} | loss {loss:.4f} | lr {lr:.2e} | grad norm "
              f"{grad_norm:.3f} | {step_time * 1e3:.1f} ms/step | {rate:,.0f} tokens/s"
              f" | MFU {mfu:.1%} | {kind} {mem / 2 ** 20:,.0f} MiB")


class _Window:
    """Whether a preemption save fits torchrun's ``--shutdown-timeout``: torchrun
    forwards a signal to the workers, waits that long, then SIGKILLs them. A save
    asked for by a signal starts at the next step boundary, so it needs up to one
    step plus one save. ``saved`` measures each save; the first one, and any that
    would not fit, are reported with the margin."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s, self.reported = timeout_s, False
        self.steps: list[int] = []  # the saves measured, and their seconds
        self.seconds: list[float] = []

    def saved(self, step: int, save_s: float, step_s: float | None) -> None:
        self.steps.append(step)
        self.seconds.append(save_s)
        need = save_s + (step_s or 0.0)
        fits = need < self.timeout_s
        if self.reported and fits:
            return
        self.reported = True
        ddist.rprint(
            f"saving step {step} took {save_s:.2f} s: a preemption save (up to one "
            f"step, {step_s or 0.0:.2f} s, then a save) needs {need:.2f} s of "
            f"torchrun's {self.timeout_s:g} s --shutdown-timeout, "
            + (f"{self.timeout_s - need:.2f} s to spare" if fits else
               "MORE than it has: torchrun would SIGKILL the ranks mid-save (the "
               "newest checkpoint then stays the one before); give torchrun a longer "
               "--shutdown-timeout and this run the same --shutdown-timeout, or "
               "save less often with --async-save"), flush=True)


def _preemption_window(job: Job) -> _Window:
    """Say, at start-up, what a preemption needs: which signals torchrun forwards
    (``TORCHELASTIC_SIGNALS_TO_HANDLE``, set by torchrun >= 2.8), and the window
    the save must fit in."""
    cfg = job.cfg
    window = _Window(cfg.shutdown_timeout)
    if not cfg.ckpt_dir:
        return window
    forwarded = os.environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE")
    wanted = [s.name for s in SIGNALS]
    if forwarded is not None:
        missing = [s for s in wanted if s not in forwarded.split(",")]
        if missing:
            ddist.rprint(f"torchrun forwards {forwarded} only: {', '.join(missing)} "
                         "sent to torchrun will not reach this script; give torchrun "
                         f"--signals-to-handle={forwarded},{','.join(missing)}")
    last = (job.resumed or {}).get("save_s")
    ddist.rprint(f"on {' or '.join(wanted)} the run saves at the next step boundary "
                 f"and exits 0; torchrun allows {cfg.shutdown_timeout:g} s "
                 "(--shutdown-timeout) before SIGKILL"
                 + (f"; the checkpoint resumed took {last:.2f} s to save"
                    if last is not None else "; the first save measures it"))
    return window


def _announce(job: Job, start: int) -> None:
    cfg, world, dp = job.cfg, job.world, job.par.dp_size
    ddist.rprint(f"{cfg.model}, {cfg.strategy} on {world.world_size} x {world.device} "
                 f"({world.backend}), {job.n_params:,} params, model states "
                 f"{job.states.total / GB:.4f} GB/device (set-up peak "
                 f"{job.startup_bytes['peak'] / GB:.4f} GB of parameters), "
                 f"global batch "
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
               "eval_losses": result.extra["eval_losses"],
               "preempted": result.extra["preempted"],
               "verified_files": sorted(job.verified),
               "resumed": job.resumed, "save_s": result.extra["save_s"],
               "startup_bytes": job.startup_bytes, "n_params": job.n_params,
               "config": asdict(cfg)}
    ddist.rprint(f"done: steps {start}->{step}, final loss {loss:.4f}, "
                 f"params {digest} (norm {norm:.6f})")
    if world.is_main and cfg.summary_json:
        with open(cfg.summary_json, "w") as f:
            json.dump(summary, f)
    return summary
