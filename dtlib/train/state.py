"""Save and resume the capstone's whole training state, in one format for every
strategy.

Every strategy saves through ``torch.distributed.checkpoint`` with its state-dict
helpers (``get_state_dict`` / ``set_state_dict``): a ``stepNNNNNNNN`` directory with
the model and optimizer (each rank writes its shards under FSDP2 and FSDP x TP; under
DDP the replicated tensors are written once, spread over the ranks), one small file
per rank for its scheduler, sampler and RNG state, the run's identity
(``run.json``, :mod:`dtlib.train.identity`) and a manifest hashing every file. The
keys are the model's own parameter names whatever wraps it, so a DDP checkpoint
resumes under FSDP2 on another number of ranks and back: DCP reads each rank's
pieces (its shard, or the whole tensor for a replica) from the saved chunks. With
``--tp`` the tensors are 2-D DTensors; the tensor-parallel layout is part of the
identity (another ``--tp`` is refused).

Nothing that exists is replaced: a save writes ``stepNNNNNNNN.tmp`` and renames it
once every rank has written; the name of a damaged checkpoint the run fell back
from is kept as ``stepNNNNNNNN.damaged-K`` when the run saves that step again.

Taught in: Chapter 10, "Crash and resume" and "A checkpoint knows its run" (the
formats: Chapter 9).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                     get_model_state_dict,
                                                     get_state_dict, set_state_dict)

from dtlib.checkpoint.safe_dcp import (MANIFEST, SafeFileSystemReader,
                                       SafeLoadPlanner, file_sha256, write_manifest)
from dtlib.checkpoint.state import (atomic_save, checkpoint_dir, clean_leftovers,
                                    rng_state, set_rng_state)
from dtlib.models.run import full_tensor, unwrap
from dtlib.runtime.dist import rprint
from dtlib.train.identity import (IDENTITY, Refusal, compare, read_identity,
                                  step_dirs)
from dtlib.low_comm import OuterStepping
from dtlib.train.job import Job, lr_lambda, stepped

__all__ = ["save_state", "begin_save", "publish", "resume", "param_digest",
           "step_dirs", "export_hf", "rank_file", "reseed", "set_aside",
           "supersede"]


def files_to_read(path: str, state: dict[str, Any]) -> set[str]:
    """The files of the DCP checkpoint ``path`` that loading ``state`` on this rank
    reads: DCP's own local read plan (the saved chunks that overlap this rank's
    shards) mapped to the files that hold them, plus the metadata.

    Taught in: Chapter 10, "Crash and resume".
    """
    metadata = SafeFileSystemReader(path).read_metadata()
    planner = SafeLoadPlanner()
    planner.set_up_planner(state, metadata, False)
    return {".metadata"} | {metadata.storage_data[item.storage_index].relative_path
                            for item in planner.create_local_plan().items}


def _check_mine(path: str, state: dict[str, Any]) -> tuple[set[str], str]:
    """(the files this rank hashed, "" or what is damaged in ``path``). Damaged
    means a file that cannot be read or whose SHA-256 differs from the manifest's."""
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            manifest = json.load(f)
        recorded = dict(manifest["files"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return set(), f"no readable {MANIFEST} ({exc})"
    present = sorted(os.path.relpath(os.path.join(root, n), path)
                     for root, _, names in os.walk(path) for n in names)
    if sorted([*recorded, MANIFEST]) != present:  # listing only: no file is read
        return set(), "its files differ from the manifest's list"
    try:
        mine = files_to_read(path, state) | {rank_file(manifest), IDENTITY}
    except Exception as exc:  # a damaged .metadata
        return set(), f".metadata unreadable ({type(exc).__name__})"
    for rel in sorted(mine):
        digest = recorded.get(rel)  # None: not in the manifest, not read at all
        if digest is None or digest != file_sha256(os.path.join(path, rel)):
            return mine, f"{rel} changed since it was saved (SHA-256 differs)"
    return mine, ""


def rank_file(manifest: dict[str, Any]) -> str:
    """The per-rank file this rank loads: its own when the world size is the
    saver's, else rank 0's (its scheduler and data position are every rank's; its
    generators are not restored, :func:`reseed`).

    Taught in: Chapter 10, "On GPUs and on many nodes".
    """
    same = manifest["world_size"] == dist.get_world_size()
    return f"rank{dist.get_rank() if same else 0}.pt"


def reseed(seed: int, step: int, rank: int) -> int:
    """Seed torch's (every device's), Python's and NumPy's generators from
    ``(seed, step, rank)``: a resume on another world size has no saved stream
    for a new rank, so every rank starts a fresh one, the same for the same
    triple. A run whose steps draw nothing (no dropout: the capstone's default)
    is unaffected; with dropout the continued run is another draw of the masks.

    Returns:
        The seed used.

    Taught in: Chapter 10, "On GPUs and on many nodes".
    """
    import random

    import numpy as np

    digest = hashlib.sha256(f"{seed}:{step}:{rank}".encode()).digest()
    value = int.from_bytes(digest[:4], "little")
    torch.manual_seed(value)  # seeds every CUDA device too
    random.seed(value)
    np.random.seed(value)
    return value


def _newest_good(job: Job, state: dict[str, Any]
                 ) -> tuple[str, set[str], list[str]]:
    """(the newest checkpoint of this run that every rank finds whole, the files
    this rank verified, what was damaged in the newer ones). Each rank hashes only
    the files it will read; the ranks agree (one all-reduce per candidate), so one
    rank's damaged shard makes every rank fall back to the one before, with a
    warning. A checkpoint of another run is never fallen back from: it is refused
    (the directory check before start-up refuses it first)."""
    damaged: list[str] = []
    for path in step_dirs(job.cfg.ckpt_dir):
        saved = read_identity(path)
        found = compare(saved, job.identity) if saved is not None else None
        if found is not None and found.fixed:
            raise Refusal(found.refusal(path))
        mine, problem = _check_mine(path, state) if saved is not None else \
            (set(), f"{IDENTITY} unreadable")
        bad = torch.tensor([int(bool(problem))], device=job.world.device)
        dist.all_reduce(bad)
        if not int(bad.item()):
            return path, mine, damaged
        where = f"rank {dist.get_rank()}: {problem}" if problem else "another rank"
        damaged.append(f"{os.path.basename(path)} ({where})")
        warnings.warn(f"{path} is damaged ({where}); falling back to the one before "
                      "of the same run", stacklevel=2)
    return "", set(), damaged


def save_state(job: Job, step: int) -> float:
    """Save after ``step`` steps: a DCP directory, whatever the strategy.

    Every rank must call it (DCP plans and writes on all ranks).

    Args:
        job: the live run (``cfg.ckpt_dir`` says where).
        step: optimizer steps done.
    Returns:
        The seconds the save took (every rank: from the first write to the
        rename, both barriers included).

    Taught in: Chapter 10, "Crash and resume".
    """
    began = time.perf_counter()
    tmp, final = begin_save(job, step)
    dcp.save(state_to_save(job), checkpoint_id=tmp)
    dist.barrier()
    if dist.get_rank() == 0:
        publish(tmp, final, step, job, time.perf_counter() - began)
    dist.barrier()
    return time.perf_counter() - began


def state_to_save(job: Job) -> dict[str, Any]:
    """``{"model", "optim"}`` of the live job, by parameter name (DCP's
    state-dict helpers), without changing the run.

    ``get_state_dict`` gives an optimizer without state (no step taken yet: every
    fp16 step so far skipped by the loss scaler, say) a state, by a step at lr 0:
    AdamW's step count would then start at 1 in this run and in every resume.
    That state is saved (the read plan of a resume needs its tensors) and taken
    away again here; :func:`begin_save` records that there was none.

    Taught in: Chapter 10, "Crash and resume".
    """
    opt = stepped(job.optimizer)
    had_state = bool(opt.state)
    msd, osd = get_state_dict(job.model, opt)
    if not had_state:
        opt.state.clear()
    return {"model": msd, "optim": osd}


def low_comm_state(job: Job) -> dict[str, Any] | None:
    """What Chapter 15's methods keep per rank, saved in the rank's own file (the
    DCP directory holds one replica's model and optimizer, rank 0's): DiLoCo's
    replica and its :class:`~dtlib.low_comm.OuterStepping` state (inner and outer
    optimizer, anchor, steps taken), or PowerSGD's memory (errors, factors, step
    count). None for the other runs.

    Taught in: Chapter 15, "In the capstone".
    """
    if isinstance(job.optimizer, OuterStepping):
        return {"replica": {k: v.detach().clone()
                            for k, v in job.model.state_dict().items()},
                "outer": job.optimizer.state_dict()}
    hook_state = getattr(job.par, "comm_state", None)
    return {"powersgd": hook_state.state_dict()} if hook_state is not None else None


def load_low_comm_state(job: Job, state: dict[str, Any] | None) -> None:
    """Put back what :func:`low_comm_state` saved (this rank's)."""
    if state is None:
        return
    if "replica" in state:
        job.model.load_state_dict(state["replica"])
        job.optimizer.load_state_dict(state["outer"])
    else:
        job.par.comm_state.load_state_dict(state["powersgd"])


def begin_save(job: Job, step: int) -> tuple[str, str]:
    """Start the save of ``step``: rank 0 deletes what this run's killed saves
    left (``.tmp``) and writes ``run.json``; every rank writes its scheduler,
    sampler and RNG file into the temporary directory. Returns (the temporary
    directory, the final one). Every rank calls it.

    Taught in: Chapter 10, "Crash and resume".
    """
    final = checkpoint_dir(job.cfg.ckpt_dir, step)
    tmp = final + ".tmp"
    rank = dist.get_rank()
    if rank == 0:
        clean_leftovers(job.cfg.ckpt_dir)  # what a killed save left behind
        os.makedirs(tmp, exist_ok=True)
        with open(os.path.join(tmp, IDENTITY), "w") as f:
            json.dump(job.identity, f, indent=1, sort_keys=True)
    dist.barrier()
    atomic_save({"step": step, "scheduler": job.scheduler.state_dict(),
                 "sampler": job.sampler.state_dict(), **rng_state(),
                 "optimizer_state_empty": not stepped(job.optimizer).state,
                 "low_comm": low_comm_state(job),
                 "scaler": job.scaler.state_dict() if job.scaler is not None
                 else None}, os.path.join(tmp, f"rank{rank}.pt"))
    return tmp, final


def publish(tmp: str, final: str, step: int, job: Job, save_s: float) -> None:
    """Make a finished save visible, on one rank once every file is written: hash
    them all into the manifest (a load verifies first; it records the save's
    seconds), then rename the temporary directory to its final name. A directory
    of that name (a damaged checkpoint the run fell back from) is kept, renamed
    by :func:`set_aside`, never replaced. Runs no collective.

    Taught in: Chapter 10, "Crash and resume".
    """
    write_manifest(tmp, world_size=dist.get_world_size(), step=step, tp=job.cfg.tp,
                   strategy=job.cfg.strategy, save_s=round(save_s, 3))
    if os.path.exists(final):
        kept = set_aside(final, "damaged")
        rprint(f"kept the damaged {os.path.basename(final)} as "
               f"{os.path.basename(kept)} (nothing is deleted)")
    os.replace(tmp, final)


def set_aside(path: str, why: str) -> str:
    """Rename ``path`` to ``path.WHY-K`` (the first K free): no resume lists it,
    nothing in it changes. Returns the new path.

    Taught in: Chapter 10, "A checkpoint knows its run".
    """
    k = 1
    while os.path.exists(f"{path}.{why}-{k}"):
        k += 1
    os.replace(path, f"{path}.{why}-{k}")
    return f"{path}.{why}-{k}"


def supersede(ckpt_dir: str) -> str | None:
    """``--fresh``: move this run's checkpoints, untouched, into
    ``ckpt_dir/superseded-K/`` (the first K free); rank 0 only. Returns the
    directory, or None when there was nothing to move.

    Taught in: Chapter 10, "A checkpoint knows its run".
    """
    paths = step_dirs(ckpt_dir)
    if not paths:
        return None
    k = 1
    while os.path.exists(os.path.join(ckpt_dir, f"superseded-{k}")):
        k += 1
    dest = os.path.join(ckpt_dir, f"superseded-{k}")
    os.makedirs(dest)
    for path in paths:
        os.replace(path, os.path.join(dest, os.path.basename(path)))
    return dest


def resume(job: Job) -> int:
    """Load the newest good checkpoint of this run in ``cfg.ckpt_dir``, if any.

    The identity saved with it is compared first (what differs is printed, or
    refused); then each rank hashes the files it will read, and a damaged
    checkpoint is fallen back from. With ``--fresh`` nothing is loaded and the
    run's checkpoints are moved into ``superseded-K/``.

    Args:
        job: built as for a fresh run (FSDP: already sharded; the fp16 scaler
            exists, so its scale resumes too).
    Returns:
        The step to continue from (0 when there is no checkpoint).
    Raises:
        Refusal: checkpoints exist and none of them loads (without ``--fresh``),
            or the one that loads was written with a value this run may not
            change.

    Taught in: Chapter 10, "Crash and resume".
    """
    cfg, model, opt, sched = job.cfg, job.model, stepped(job.optimizer), job.scheduler
    if cfg.ckpt_dir is None:
        return 0
    if cfg.fresh:
        moved = None
        if dist.get_rank() == 0:
            moved = supersede(cfg.ckpt_dir)
        dist.barrier()
        rprint("--fresh: starting from step 0" + (
            f"; this run's earlier checkpoints moved, untouched, to {moved}"
            if moved else f" ({cfg.ckpt_dir} holds no checkpoint)"))
        return 0
    if not step_dirs(cfg.ckpt_dir):
        rprint(f"no checkpoint in {cfg.ckpt_dir} yet: starting from step 0")
        return 0
    # get_state_dict initialises the optimizer's state (a step at lr 0): the read
    # plan, hence the files this rank verifies, needs its tensors
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    path, job.verified, damaged = _newest_good(job, state)
    if not path:
        raise Refusal(f"no checkpoint of {cfg.ckpt_dir} loads ({len(damaged)} damaged: "
                      f"{'; '.join(damaged)}); nothing was loaded or changed. Restore "
                      "a good copy, or pass --fresh to start from step 0 (the "
                      "damaged ones are moved, untouched, into superseded-K/)")
    saved = read_identity(path)
    found = compare(saved, job.identity, frozenset(cfg.allow_change_names))
    refused = found.refusal(path)
    if refused:
        raise Refusal(refused)
    with open(os.path.join(path, MANIFEST)) as f:
        manifest = json.load(f)
    saved_world = manifest["world_size"]
    if (cfg.diloco or cfg.powersgd) and saved_world != dist.get_world_size():
        raise Refusal(f"{path} was written by {saved_world} ranks; --diloco and "
                      "--powersgd keep state per rank (each replica, each rank's "
                      f"error), so the run resumes on {saved_world} ranks only, not "
                      f"{dist.get_world_size()}; nothing was changed on disk")
    # verified above, file by file; no pickle of the directory is run
    dcp.load(state, storage_reader=SafeFileSystemReader(path),
             planner=SafeLoadPlanner())
    set_state_dict(model, opt, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    mine = torch.load(os.path.join(path, rank_file({"world_size": saved_world})),
                      map_location="cpu", weights_only=True)
    sched.load_state_dict(mine["scheduler"])
    job.sampler.load_state_dict(mine["sampler"])
    if saved_world == dist.get_world_size():
        set_rng_state(mine)
    else:
        _reseed_elsewhere(job, saved_world, mine["step"])
    if job.scaler is not None and mine.get("scaler"):
        job.scaler.load_state_dict(mine["scaler"])
    if mine.get("optimizer_state_empty"):  # saved before any step: none, as then
        opt.state.clear()
    load_low_comm_state(job, mine.get("low_comm"))
    if found.care:
        _apply_changes(job, mine["step"])
    job.resumed = {"path": path, "step": mine["step"], "damaged": damaged,
                   "save_s": manifest.get("save_s"), "changes": found.lines(),
                   "checked": len(saved)}
    rprint(f"resumed from {path} (step {mine['step']}): run identity checked "
           f"({len(saved)} entries; every fixed one equal), SHA-256 of the "
           f"{len(job.verified)} files rank 0 reads verified"
           + (f"; fell back over {len(damaged)} damaged" if damaged else ""))
    for line in found.lines():
        rprint(line)
    return mine["step"]


def _apply_changes(job: Job, step: int) -> None:
    """``--allow-change``: the optimizer's hyperparameters and the schedule's base
    come from the checkpoint when it loads; set this run's values, and the learning
    rate of the next step from this run's schedule."""
    cfg = job.cfg
    sched = job.scheduler
    sched.base_lrs = [cfg.lr for _ in job.optimizer.param_groups]
    for group in job.optimizer.param_groups:
        group["initial_lr"] = cfg.lr
        group["weight_decay"] = cfg.weight_decay
        group["lr"] = cfg.lr * lr_lambda(step, cfg.warmup, cfg.steps,
                                         cfg.min_lr_ratio)


def _reseed_elsewhere(job: Job, saved_world: int, step: int) -> None:
    """On another world size than the saver's: say what was done, and
    :func:`reseed`."""
    ws = dist.get_world_size()
    value = reseed(job.cfg.seed, step, dist.get_rank())
    how = ("every rank read the whole model and optimizer state into its replica "
           "(DDP)" if job.strategy.zero_stage == 0 else
           "each rank read its new shards of the model and optimizer state (DCP "
           "reshards)")
    rprint(f"saved by {saved_world} ranks, resumed on {ws}: {how}; data position "
           "global; generators reseeded from (seed, step, rank) (rank 0: "
           f"{value})")


def param_digest(model: nn.Module) -> tuple[str, float]:
    """(sha256 prefix of all full fp32 parameters, their L2 norm).

    A collective under FSDP2 (each DTensor is gathered): call it on every rank. Equal
    digests mean bit-identical parameters, whatever the strategy that trained them.

    Taught in: Chapter 10, "Crash and resume".
    """
    h, sq = hashlib.sha256(), 0.0
    for _, p in sorted(model.named_parameters()):
        full = full_tensor(p.detach()).float().cpu().contiguous()
        h.update(full.numpy().tobytes())
        sq += float(full.double().pow(2).sum())
    return h.hexdigest()[:16], math.sqrt(sq)


def export_hf(job: Job, path: str) -> None:
    """``save_pretrained`` of the whole trained Hugging Face model into ``path``.

    Every rank calls it: the full state dict is gathered (FSDP2's shards, or DDP's
    replica) to CPU memory on rank 0, which loads it into a plain copy of the model
    and writes ``config.json`` and ``model.safetensors``; ``from_pretrained(path)``
    then loads it with no dtlib code.

    Taught in: Chapter 10, "A Hugging Face model".
    """
    full = get_model_state_dict(job.model, options=StateDictOptions(
        full_state_dict=True, cpu_offload=True))  # a collective under FSDP2
    if dist.get_rank() == 0:
        from dtlib.models import hf

        config = unwrap(job.model).config
        plain = hf.build_hf_llama(config)
        plain.load_state_dict(full)
        plain.save_pretrained(path)
        rprint(f"exported the model to {path} (save_pretrained)")
    dist.barrier()
