"""Save and resume the capstone's whole training state, for DDP and for FSDP2.

DDP: the model is replicated, so :func:`dtlib.checkpoint.save_checkpoint` writes one
atomic file from rank 0 with every rank's sampler and RNG state. FSDP2: every rank holds
a shard, so every rank writes: a ``torch.distributed.checkpoint`` directory for the
sharded model and optimizer, plus one small file per rank for its scheduler, sampler
and RNG state, renamed into place once all are written. With ``--tp`` the same code
saves and loads 2-D DTensors (FSDP shard on dp x TP split on tp): DCP stores each
rank's local pieces with their offsets in the full tensors.

Taught in: Chapter 10, "Crash and resume" (the formats: Chapter 9).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
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
from dtlib.checkpoint.state import (atomic_save, clean_leftovers, list_checkpoints,
                                    load_latest_good, rng_state, save_checkpoint,
                                    set_rng_state)
from dtlib.models.run import full_tensor, unwrap
from dtlib.runtime.dist import rprint
from dtlib.train.job import Job

__all__ = ["save_state", "begin_sharded", "publish_sharded", "resume", "param_digest",
           "dcp_dirs", "export_hf", "rank_file", "reseed"]


def dcp_dirs(ckpt_dir: str) -> list[str]:
    """The finished sharded checkpoints of ``ckpt_dir``, newest first."""
    names = [n for n in os.listdir(ckpt_dir) if re.fullmatch(r"step\d{8}", n)] \
        if os.path.isdir(ckpt_dir) else []
    return [os.path.join(ckpt_dir, n) for n in sorted(names, reverse=True)]


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


def _check_mine(path: str, state: dict[str, Any], cfg: Any) -> tuple[set[str], str]:
    """(the files this rank hashed, "" or what is wrong with ``path``); another tp
    raises (every rank reads the same manifest)."""
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            manifest = json.load(f)
        recorded = dict(manifest["files"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return set(), f"no readable {MANIFEST} ({exc})"
    _check_world(path, manifest, cfg)
    present = sorted(os.path.relpath(os.path.join(root, n), path)
                     for root, _, names in os.walk(path) for n in names)
    if sorted([*recorded, MANIFEST]) != present:  # listing only: no file is read
        return set(), "its files differ from the manifest's list"
    try:
        mine = files_to_read(path, state) | {rank_file(manifest)}
    except Exception as exc:  # a damaged .metadata
        return set(), f".metadata unreadable ({type(exc).__name__})"
    for rel in sorted(mine):
        digest = recorded.get(rel)  # None: not in the manifest, not read at all
        if digest is None or digest != file_sha256(os.path.join(path, rel)):
            return mine, f"{rel} changed since it was saved (SHA-256 differs)"
    return mine, ""


def _check_world(path: str, manifest: dict[str, Any], cfg: Any) -> None:
    saved = manifest.get("tp", 1)
    if saved != cfg.tp:  # qkv rows are stored interleaved for the saver's tp
        raise ValueError(f"{path} was saved with --tp {saved}; this job has --tp "
                         f"{cfg.tp}: resume with --tp {saved} (the saved tensor-"
                         f"parallel layout is tp {saved}'s)")


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


def _newest_good_dcp(job: Job, state: dict[str, Any]) -> tuple[str, set[str]] | None:
    """The newest sharded checkpoint that every rank finds whole, and the files this
    rank verified. Each rank hashes only the files it will read; the ranks agree
    (one all-reduce per candidate), so one rank's damaged shard makes every rank
    fall back to the one before, with a warning."""
    for path in dcp_dirs(job.cfg.ckpt_dir):
        mine, problem = _check_mine(path, state, job.cfg)
        bad = torch.tensor([int(bool(problem))], device=job.world.device)
        dist.all_reduce(bad)
        if not int(bad.item()):
            return path, mine
        where = f"rank {dist.get_rank()}: {problem}" if problem else "another rank"
        warnings.warn(f"{path} is damaged ({where}); falling back to the one before",
                      stacklevel=2)
    return None


def save_state(job: Job, step: int) -> None:
    """Save after ``step`` steps: one atomic file (DDP) or a DCP directory (FSDP).

    Every rank must call it (both formats gather or write on all ranks).

    Args:
        job: the live run (its strategy says which format; ``cfg.ckpt_dir`` where).
        step: optimizer steps done.

    Taught in: Chapter 10, "Crash and resume".
    """
    cfg, model, opt, sched = job.cfg, job.model, job.optimizer, job.scheduler
    sampler, scaler = job.sampler, job.scaler
    if not job.strategy.sharded_checkpoint:  # replicated: rank 0 writes one file
        save_checkpoint(cfg.ckpt_dir, step, model, opt, sched, sampler, scaler=scaler)
        return
    # FSDP: every rank writes its shards (DCP) and its own sampler/RNG file into a
    # temporary directory; rank 0 renames it once all are done (atomic, like Ch. 9).
    tmp, final = begin_sharded(job, step)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=tmp)
    dist.barrier()
    if dist.get_rank() == 0:
        publish_sharded(tmp, final, step, cfg.tp)
    dist.barrier()


def begin_sharded(job: Job, step: int) -> tuple[str, str]:
    """Start the sharded save of ``step``: rank 0 deletes what killed saves left, and
    every rank writes its scheduler, sampler and RNG file into the temporary
    directory. Returns (the temporary directory, the final one). Every rank calls it.

    Taught in: Chapter 10, "Crash and resume".
    """
    final = os.path.join(job.cfg.ckpt_dir, f"step{step:08d}")
    tmp = final + ".tmp"
    rank = dist.get_rank()
    if rank == 0:
        clean_leftovers(job.cfg.ckpt_dir)  # what a killed save left behind
    dist.barrier()
    atomic_save({"step": step, "scheduler": job.scheduler.state_dict(),
                 "sampler": job.sampler.state_dict(), **rng_state(),
                 "scaler": job.scaler.state_dict() if job.scaler is not None
                 else None}, os.path.join(tmp, f"rank{rank}.pt"))
    return tmp, final


def publish_sharded(tmp: str, final: str, step: int, tp: int) -> None:
    """Make a finished sharded save visible, on one rank once every file is written:
    hash them all into the manifest (a load verifies first), then rename the
    temporary directory to its final name. Runs no collective.

    Taught in: Chapter 10, "Crash and resume".
    """
    write_manifest(tmp, world_size=dist.get_world_size(), step=step, tp=tp)
    if os.path.isdir(final):  # a damaged save of this step, resumed from before
        shutil.rmtree(final)
    os.replace(tmp, final)


def resume(job: Job) -> int:
    """Load the latest checkpoint in ``cfg.ckpt_dir`` into the live job, if any.

    Args:
        job: built as for a fresh run (FSDP: already sharded; the fp16 scaler
            exists, so its scale resumes too).
    Returns:
        The step to continue from (0 when there is no checkpoint).

    Taught in: Chapter 10, "Crash and resume".
    """
    cfg, model, opt, sched = job.cfg, job.model, job.optimizer, job.scheduler
    sampler, scaler = job.sampler, job.scaler
    if cfg.ckpt_dir is None:
        return 0
    if not job.strategy.sharded_checkpoint:
        got = load_latest_good(cfg.ckpt_dir, model, opt, sched, sampler, scaler,
                               any_world_size=True)
        if got is None:
            return _fresh(cfg.ckpt_dir)
        _reseed_elsewhere(job, got["world_size"], got["step"])
        rprint(f"resumed from {got['path']} (step {got['step']})")
        return got["step"]
    if not dcp_dirs(cfg.ckpt_dir):
        return _fresh(cfg.ckpt_dir)
    # get_state_dict initialises the optimizer's state (a step at lr 0): the read
    # plan, hence the files this rank verifies, needs its tensors
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    found = _newest_good_dcp(job, state)
    if found is None:
        opt.state.clear()  # a fresh start: AdamW's step count starts from 0 again
        return _fresh(cfg.ckpt_dir)
    path, job.verified = found
    # verified above, file by file; no pickle of the directory is run
    dcp.load(state, storage_reader=SafeFileSystemReader(path),
             planner=SafeLoadPlanner())
    set_state_dict(model, opt, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    with open(os.path.join(path, MANIFEST)) as f:
        saved_world = json.load(f)["world_size"]
    mine = torch.load(os.path.join(path, rank_file({"world_size": saved_world})),
                      map_location="cpu", weights_only=True)
    sched.load_state_dict(mine["scheduler"])
    sampler.load_state_dict(mine["sampler"])
    if saved_world == dist.get_world_size():
        set_rng_state(mine)
    else:
        _reseed_elsewhere(job, saved_world, mine["step"])
    if scaler is not None and mine.get("scaler"):
        scaler.load_state_dict(mine["scaler"])
    rprint(f"resumed from {path} (step {mine['step']})")
    return mine["step"]


def _reseed_elsewhere(job: Job, saved_world: int, step: int) -> None:
    """On another world size than the saver's: say so and :func:`reseed`."""
    ws = dist.get_world_size()
    if saved_world == ws:
        return
    value = reseed(job.cfg.seed, step, dist.get_rank())
    rprint(f"saved by {saved_world} ranks, resumed on {ws}: parameters and "
           "optimizer state resharded, data position global, generators reseeded "
           f"from (seed, step, rank) (rank 0: {value})")


def _fresh(ckpt_dir: str) -> int:
    """Say that nothing was loaded, and why, before starting from step 0."""
    n = len(dcp_dirs(ckpt_dir)) + len(list_checkpoints(ckpt_dir)) \
        if os.path.isdir(ckpt_dir) else 0
    rprint(f"no loadable checkpoint in {ckpt_dir} ("
           + (f"{n} damaged" if n else "none saved yet") + "): starting from step 0")
    return 0


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
