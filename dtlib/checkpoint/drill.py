"""A resume drill: small training jobs that can save, "crash" and resume, with every
source of randomness a real job has, for proving that a resumed run is the run.

- :func:`train_run`: a GPT with dropout (torch RNG), a random crop of each sample
  (Python ``random``), random token noise (NumPy), a shuffled sampler whose order
  changes each epoch and a cosine learning rate. It saves, stops (the "crash": every
  object is dropped) and resumes from the newest checkpoint, restoring all or only
  some of the state, skipping the consumed batches arithmetically or by replaying
  the loader. One process, or DDP under :func:`dtlib.runtime.launch.spawn`.
- :func:`fsdp_model`, :func:`fsdp_train`: an FSDP2 job whose batches are drawn from
  the step's index, for sharded checkpoints.
- :class:`CrashDuringSave`: a value whose pickling raises :class:`SimulatedCrash`,
  so a save stops part-way as a killed process would.

Each trains through the one loop, :func:`dtlib.models.run.run_steps` (saving and the
"crash" are a callback at its ``on_save`` and ``should_stop``).

Taught in: Chapter 9, "Proof: the resumed run is the run".
"""

from __future__ import annotations

import random
import time
from functools import partial
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

from dtlib import data_parallel, zero
from dtlib.checkpoint.state import (STATE_KEYS, latest_checkpoint, load_checkpoint,
                                    rng_state, save_checkpoint, set_rng_state)
from dtlib.data_parallel.sampling import ResumableSampler
from dtlib.models.gpt import GPTConfig, build_gpt, token_batch
from dtlib.models.run import (Callback, Every, Parallelism, RunConfig, StepEnd,
                              TrainState, run_steps)
from dtlib.models.sizes import size
from dtlib.runtime.dist import world

__all__ = ["RUN_CFG", "CropNoiseTokens", "train_run", "FSDP_CFG", "fsdp_model",
           "fsdp_train", "fsdp_batch", "SimulatedCrash", "CrashDuringSave"]

#: The chapter's model: dropout > 0 so that the torch RNG matters.
RUN_CFG = size("tiny-dropout")


class CropNoiseTokens(Dataset):
    """Token windows with a random crop (Python RNG) and random noise (NumPy RNG).

    ``loads`` counts ``__getitem__`` calls; ``load_cost_s`` makes each load cost time,
    as decoding and augmenting a real sample does.
    """

    def __init__(self, n: int, cfg: GPTConfig = RUN_CFG, crop_slack: int = 8,
                 load_cost_s: float = 0.0, seed: int = 1234) -> None:
        if n < 1:
            raise ValueError(f"n={n!r} must be a positive integer")
        g = torch.Generator().manual_seed(seed)
        self.rows = torch.randint(0, cfg.vocab_size, (n, cfg.seq_len + 1 + crop_slack),
                                  generator=g)
        self.cfg, self.slack, self.load_cost_s, self.loads = cfg, crop_slack, \
            load_cost_s, 0

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.loads += 1
        if self.load_cost_s:
            time.sleep(self.load_cost_s)
        start = random.randrange(self.slack + 1)
        row = self.rows[i, start:start + self.cfg.seq_len + 1].clone()
        noisy = torch.from_numpy(np.random.rand(len(row)) < 0.1)
        row[noisy] = int(np.random.randint(self.cfg.vocab_size))
        return row[:-1], row[1:]


def _seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def train_run(total_steps: int, ckpt_dir: str | None = None, *,
              save_every: int | None = None, stop_at: int | None = None,
              resume: bool = False, restore: tuple[str, ...] | set[str] = STATE_KEYS,
              replay: bool = False, dataset_len: int = 20, batch: int = 4,
              load_cost_s: float = 0.0, seed: int = 0) -> dict[str, Any]:
    """Train :data:`RUN_CFG` ``total_steps`` steps, maybe saving, stopping, resuming.

    Args:
        total_steps: steps of the full run (the cosine schedule spans them).
        ckpt_dir: where checkpoints go (needed to save or resume).
        save_every: save after every ``save_every``-th step.
        stop_at: "crash" after this step (return early, dropping every object).
        resume: start from :func:`~dtlib.checkpoint.latest_checkpoint` when one exists.
        restore: which state keys to restore (see :data:`~dtlib.checkpoint.STATE_KEYS`).
        replay: position the data by iterating through the consumed batches (the seed's
            way) instead of starting the sampler at its saved position.
        dataset_len, batch: samples in the dataset; samples per rank per step.
        load_cost_s: seconds each sample load costs.
        seed: seeds model init; rank r seeds its generators with ``seed + r``.
    Returns:
        ``{"params": flat float32 tensor, "step", "losses", "lr", "loads",
        "resume_s": seconds from loading to the first resumed step, "start_step"}``.

    Taught in: Chapter 9, "Proof: the resumed run is the run".
    """
    for name, value in (("total_steps", total_steps), ("batch", batch)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer")
    if (save_every or resume) and ckpt_dir is None:
        raise ValueError("ckpt_dir=None: saving or resuming needs a directory")
    w = world()
    many = dist.is_initialized() and dist.get_world_size() > 1
    par = data_parallel.parallelism("torch") if many else Parallelism()  # DDP or one
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if many else (0, 1)
    _seed_all(seed + rank)
    model = par.apply(build_gpt(RUN_CFG, seed).to(w.device))
    opt = par.make_optimizer(model, torch.optim.AdamW, lr=3e-3, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=total_steps)
    data = CropNoiseTokens(dataset_len, load_cost_s=load_cost_s)
    sampler = ResumableSampler(dataset_len, rank=rank, world_size=world_size, seed=seed)
    # Its own generator: each iter(loader) draws a worker base seed, and drawing it
    # from the global torch RNG would shift dropout after a resume.
    loader = DataLoader(data, batch_size=batch, sampler=sampler,
                        generator=torch.Generator().manual_seed(seed))
    start_step, pos = 0, {"epoch": 0, "it": None}  # where the data stands
    t_load = None
    if resume and (path := latest_checkpoint(ckpt_dir)) is not None:
        t_load = time.perf_counter()
        meta = load_checkpoint(path, model, opt, sched, sampler, restore=restore)
        start_step, pos["epoch"] = meta["step"], meta["epoch"]
        if replay:  # the seed's way: rewind the epoch, load and discard what was used
            consumed = sampler.position
            sampler.set_epoch(sampler.epoch)
            generators = rng_state()  # loading samples draws crops and noise
            pos["it"] = iter(loader)
            for _ in range(-(-consumed // batch)):
                next(pos["it"])
            set_rng_state(generators)
    pos["it"] = iter(loader) if pos["it"] is None else pos["it"]

    class SaveAndCrash(Callback):
        """Save every ``save_every`` steps; "crash" (leave) after ``stop_at``."""

        def on_save(self, end: StepEnd) -> None:
            save_checkpoint(ckpt_dir, end.step, model, opt, sched, sampler,
                            epoch=pos["epoch"])

        def on_step_end(self, end: StepEnd) -> None:
            if t_load is not None and end.step == start_step + 1:
                end.result.extra["resume_s"] = time.perf_counter() - t_load

        def should_stop(self, end: StepEnd) -> bool:
            return stop_at is not None and end.step >= stop_at  # the "crash"

    config = RunConfig(total_steps, start=start_step, local_batches=True,
                       record_grads=False, save=Every(save_every or 0))
    run = run_steps(par, None, partial(_next_batch, pos, sampler, loader, w.device),
                    config, TrainState(model, opt, sched), [SaveAndCrash()])
    params = torch.cat([p.float().flatten() for p in run.params.values()])
    return {"params": params, "step": start_step + len(run.losses),
            "losses": run.losses, "lr": sched.get_last_lr()[0], "loads": data.loads,
            "resume_s": run.extra.get("resume_s", 0.0) if start_step else 0.0,
            "start_step": start_step}


def _next_batch(pos: dict[str, Any], sampler: ResumableSampler, loader: DataLoader,
                device: torch.device, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The loader's next batch, on ``device``; a new epoch when one runs out."""
    while True:
        try:
            x, y = next(pos["it"])
            return x.to(device), y.to(device)
        except StopIteration:
            pos["epoch"] += 1
            sampler.set_epoch(pos["epoch"])
            pos["it"] = iter(loader)


#: The model the sharded demos use (untied head: every parameter one DTensor).
FSDP_CFG = size("tiny-untied")


def fsdp_model(seed: int) -> tuple[Any, torch.nn.Module, Any]:
    """A fresh FSDP2 job on every rank: its Parallelism, model and AdamW.

    Args:
        seed: the model's initial weights.
    Returns:
        ``(par, model, optimizer)``; the optimizer has no state until its first step.

    Taught in: Chapter 9, "Sharded state".
    """
    w = world()
    par = zero.parallelism(3, variant="fsdp2")
    model = par.apply(build_gpt(FSDP_CFG, seed).to(w.device))
    return par, model, par.make_optimizer(model, torch.optim.AdamW, lr=1e-2)


def fsdp_train(par: Any, model: torch.nn.Module, opt: Any, first_step: int,
               steps: int) -> None:
    """Train ``steps`` steps from step ``first_step`` (each rank its rows of a global
    batch of 8, drawn from the step's index, so a resumed job sees what the
    uninterrupted one saw).

    Args:
        par, model, opt: :func:`fsdp_model`'s job.
        first_step: index of the first step (0 for a fresh run).
        steps: optimizer steps to take.
    Returns:
        None: ``model`` and ``opt`` have taken the steps.

    Taught in: Chapter 9, "Sharded state".
    """
    device = world().device
    run_steps(par, None, lambda step: fsdp_batch(device, first_step + step),
              RunConfig(steps, record_grads=False, record_params=False),
              TrainState(model, opt))


def fsdp_batch(device: torch.device, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s global batch of 8 for :data:`FSDP_CFG` (all ranks the same)."""
    return token_batch(FSDP_CFG, 8, seed=100 + step, device=device)


class SimulatedCrash(RuntimeError):
    """Raised while a checkpoint is being written: the process "dies" mid-save."""


class CrashDuringSave:
    """Put this in a state dict: pickling it raises :class:`SimulatedCrash`, so
    ``torch.save`` stops part-way, as a killed process would."""

    def __reduce__(self) -> Any:
        raise SimulatedCrash("the machine went down while the checkpoint was written")
