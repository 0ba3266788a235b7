"""The whole training state, saved so that a resumed run *is* the interrupted run.

A checkpoint that only holds the weights resumes a different run: the optimizer's
moments restart at zero, the learning rate jumps back to its first value, the data
order starts over and dropout draws different masks. This module saves everything a
step depends on: model, optimizer, LR scheduler, step and epoch, the sampler's epoch
and position within it (:class:`dtlib.data_parallel.sampling.ResumableSampler`),
and the random number generators (Python, NumPy, torch CPU,
and the CUDA device when there is one).

Three habits make the files trustworthy:

- **One name, used both ways.** :func:`checkpoint_path` builds the file name and
  :func:`latest_checkpoint` finds files by parsing the *same* pattern;
  :func:`checkpoint_dir` and :func:`step_of` do the same for a checkpoint that is a
  directory (the capstone's DCP checkpoints).
- **Atomic writes.** :func:`atomic_save` writes a temporary file in the target
  directory, fsyncs it and ``os.replace``-s it: a crash leaves the old file or the new
  one, never half of one.
- **Safe loads.** Everything saved is tensors and plain containers, so
  :func:`load_checkpoint` uses ``torch.load(weights_only=True)``, which refuses to run
  code hidden in a pickle.

Taught in: Chapter 9, "Checkpointing and resume".
"""

from __future__ import annotations

import os
import random
import re
import shutil
import tempfile
import warnings
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from dtlib.data_parallel.sampling import ResumableSampler
from dtlib.models.run import unwrap
from dtlib.runtime.dist import world

__all__ = ["CHECKPOINT_PATTERN", "CHECKPOINT_DIR_PATTERN", "checkpoint_path",
           "checkpoint_dir", "step_of", "list_checkpoints", "list_checkpoint_dirs",
           "latest_checkpoint", "atomic_save", "rng_state", "set_rng_state",
           "STATE_KEYS", "save_checkpoint", "load_checkpoint", "clean_leftovers",
           "load_latest_good", "gather_state"]

#: The one file-name scheme, for writing and for finding (zero-padded: sorts by name).
CHECKPOINT_PATTERN = "step{step:08d}.pt"
_CHECKPOINT_RE = re.compile(r"^step(\d{8})\.pt$")
#: The same scheme for a checkpoint that is a directory (DCP's).
CHECKPOINT_DIR_PATTERN = "step{step:08d}"
_CHECKPOINT_DIR_RE = re.compile(r"^step(\d{8})$")

#: What :func:`save_checkpoint` writes; :func:`load_checkpoint` can restore a subset.
STATE_KEYS = ("model", "optimizer", "scheduler", "sampler", "rng_torch", "rng_python",
              "rng_numpy", "rng_cuda")


def checkpoint_path(ckpt_dir: str | os.PathLike, step: int) -> str:
    """The file that holds the checkpoint taken after ``step`` optimizer steps.

    Taught in: Chapter 9, "One name".
    """
    _check_step(step)
    return os.path.join(os.fspath(ckpt_dir), CHECKPOINT_PATTERN.format(step=step))


def checkpoint_dir(ckpt_dir: str | os.PathLike, step: int) -> str:
    """The directory that holds the (DCP) checkpoint taken after ``step`` steps.

    Taught in: Chapter 9, "One name" (the capstone's checkpoints: Chapter 10).
    """
    _check_step(step)
    return os.path.join(os.fspath(ckpt_dir), CHECKPOINT_DIR_PATTERN.format(step=step))


def step_of(name: str, directory: bool = True) -> int | None:
    """The step in a checkpoint's name (a directory's, or with ``directory=False``
    a file's), or None when ``name`` is not one.

    Taught in: Chapter 9, "One name".
    """
    pattern = _CHECKPOINT_DIR_RE if directory else _CHECKPOINT_RE
    found = pattern.match(os.path.basename(os.path.normpath(name)))
    return int(found.group(1)) if found else None


def _check_step(step: object) -> None:
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"step={step!r} must be a non-negative integer")


def list_checkpoints(ckpt_dir: str | os.PathLike) -> list[tuple[int, str]]:
    """``[(step, path), ...]`` of the complete checkpoints in ``ckpt_dir``, by step.

    Temporary files of an unfinished :func:`atomic_save` do not match the pattern.
    """
    ckpt_dir = os.fspath(ckpt_dir)
    if not os.path.isdir(ckpt_dir):
        return []
    found = [(int(m.group(1)), os.path.join(ckpt_dir, name))
             for name in os.listdir(ckpt_dir) if (m := _CHECKPOINT_RE.match(name))]
    return sorted(found)


def list_checkpoint_dirs(ckpt_dir: str | os.PathLike) -> list[tuple[int, str]]:
    """``[(step, path), ...]`` of the checkpoint directories (DCP's) in
    ``ckpt_dir``, by step; a save's ``.tmp`` directory does not match the name.

    Taught in: Chapter 9, "One name" (the capstone's checkpoints: Chapter 10).
    """
    ckpt_dir = os.fspath(ckpt_dir)
    if not os.path.isdir(ckpt_dir):
        return []
    found = [(step, os.path.join(ckpt_dir, name)) for name in os.listdir(ckpt_dir)
             if (step := step_of(name)) is not None
             and os.path.isdir(os.path.join(ckpt_dir, name))]
    return sorted(found)


def latest_checkpoint(ckpt_dir: str | os.PathLike) -> str | None:
    """The path of the newest checkpoint in ``ckpt_dir``, or None when there is none.

    Taught in: Chapter 9, "One name".
    """
    found = list_checkpoints(ckpt_dir)
    return found[-1][1] if found else None


def atomic_save(obj: Any, path: str | os.PathLike) -> str:
    """``torch.save(obj)`` to ``path`` so that ``path`` is never half-written.

    The bytes go to a temporary file in the same directory (``os.replace`` is atomic
    only within one file system), which is flushed and fsynced before it replaces
    ``path``; the directory is fsynced so the rename itself survives a power cut.

    Args:
        obj: what to save (tensors and plain containers).
        path: the final file.
    Returns:
        ``path``.

    Taught in: Chapter 9, "Atomic writes".
    """
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=".part")
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600: others could not read it
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return path


#: What a killed save leaves behind: atomic_save's temporary files, and the
#: temporary directories of sharded saves (``step00000009.tmp``).
_LEFTOVER_RE = re.compile(r"^(\.tmp-.*\.part|step\d{8}\.tmp)$")


def clean_leftovers(ckpt_dir: str | os.PathLike) -> list[str]:
    """Delete what interrupted saves left in ``ckpt_dir``; return the names removed.

    Call it from the one writer, before a save (never while another save runs).

    Taught in: Chapter 9, "Atomic writes".
    """
    ckpt_dir = os.fspath(ckpt_dir)
    removed = []
    for name in os.listdir(ckpt_dir) if os.path.isdir(ckpt_dir) else []:
        if _LEFTOVER_RE.match(name):
            path = os.path.join(ckpt_dir, name)
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
            removed.append(name)
    return removed


def rng_state() -> dict[str, Any]:
    """Every generator a training step draws from, as tensors and plain values.

    Returns:
        ``{"rng_torch", "rng_python", "rng_numpy"}`` and ``"rng_cuda"`` (None on CPU);
        loadable with ``torch.load(weights_only=True)``.

    Taught in: Chapter 9, "What a step depends on".
    """
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    device = world().device
    return {
        "rng_torch": torch.get_rng_state(),
        "rng_python": {"version": version, "state": list(internal), "gauss": gauss},
        "rng_numpy": {"name": str(name),
                      "keys": torch.from_numpy(keys.astype(np.int64)),
                      "pos": int(pos), "has_gauss": int(has_gauss),
                      "cached": float(cached)},
        "rng_cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
    }


def set_rng_state(state: dict[str, Any], keys: tuple[str, ...] | set[str] = STATE_KEYS
                  ) -> None:
    """Restore the generators saved by :func:`rng_state` (only those in ``keys``)."""
    if "rng_torch" in keys:
        torch.set_rng_state(state["rng_torch"])
    if "rng_python" in keys:
        p = state["rng_python"]
        random.setstate((p["version"], tuple(p["state"]), p["gauss"]))
    if "rng_numpy" in keys:
        n = state["rng_numpy"]
        np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"],
                             n["has_gauss"], n["cached"]))
    if "rng_cuda" in keys and state.get("rng_cuda") is not None:
        torch.cuda.set_rng_state(state["rng_cuda"], world().device)


def save_checkpoint(ckpt_dir: str | os.PathLike, step: int, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer, scheduler: Any = None,
                    sampler: ResumableSampler | None = None, epoch: int = 0,
                    scaler: Any = None) -> str | None:
    """Save the whole training state after ``step`` steps, atomically.

    Model, optimizer and scheduler are replicated (plain data parallelism): rank 0
    writes them. The RNG and sampler states differ per rank: they are gathered to
    rank 0 and saved as one list entry per rank. (Sharded models need
    :mod:`dtlib.checkpoint.sharded` instead.) Every rank must call this.

    Args:
        ckpt_dir: directory of checkpoints; the file is :func:`checkpoint_path`.
        step: optimizer steps done; epoch: the epoch the step belongs to.
        model, optimizer, scheduler, sampler: the live training objects.
        scaler: fp16's loss scaler (GradScaler or DynamicLossScaler), if any: its
            scale and growth tracker are part of the state.
    Returns:
        The path written (rank 0), None on other ranks.

    Taught in: Chapter 9, "The whole state".
    """
    state = gather_state(step, model, optimizer, scheduler, sampler, epoch, scaler)
    path = None
    if state is not None:  # rank 0
        clean_leftovers(ckpt_dir)  # a killed save's temporary files
        path = atomic_save(state, checkpoint_path(ckpt_dir, step))
    if dist.is_initialized():
        dist.barrier()  # nobody looks for the file before it exists
    return path


def gather_state(step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 scheduler: Any = None, sampler: ResumableSampler | None = None,
                 epoch: int = 0, scaler: Any = None) -> dict[str, Any] | None:
    """What :func:`save_checkpoint` writes: on rank 0 the whole state as one dict
    (its tensors are the live ones, not copies), None on the other ranks. A
    collective (the per-rank RNG and sampler states are gathered).

    Taught in: Chapter 9, "The whole state".
    """
    per_rank = {**rng_state(), "sampler": sampler.state_dict() if sampler else None}
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, per_rank)
    else:
        gathered = [per_rank]
    if world().rank != 0:
        return None
    return {"step": step, "epoch": epoch, "world_size": len(gathered),
            "model": unwrap(model).state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict() if scheduler else None,
            "scaler": scaler.state_dict() if scaler is not None else None,
            "per_rank": gathered}


def load_checkpoint(path: str | os.PathLike, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer | None = None,
                    scheduler: Any = None,
                    sampler: ResumableSampler | None = None,
                    restore: tuple[str, ...] | set[str] = STATE_KEYS,
                    scaler: Any = None) -> dict[str, int]:
    """Restore a :func:`save_checkpoint` file into live objects (``weights_only``).

    Args:
        path: the checkpoint file.
        model, optimizer, scheduler, sampler: objects built as for a fresh run.
        restore: which parts of :data:`STATE_KEYS` to restore (all by default; the
            book restores fewer to show what each one is for).
        scaler: a loss scaler to restore, if the checkpoint has one.
    Returns:
        ``{"step", "epoch"}`` to continue from.

    Taught in: Chapter 9, "The whole state".
    """
    unknown = set(restore) - set(STATE_KEYS)
    if unknown:
        raise ValueError(f"restore={sorted(unknown)} unknown; allowed: {STATE_KEYS}")
    return _apply(torch.load(path, map_location="cpu", weights_only=True), path, model,
                  optimizer, scheduler, sampler, restore, scaler)


def _apply(state: dict[str, Any], path: str | os.PathLike, model: torch.nn.Module,
           optimizer: Any, scheduler: Any, sampler: ResumableSampler | None,
           restore: tuple[str, ...] | set[str], scaler: Any,
           any_world_size: bool = False) -> dict[str, int]:
    rank = world().rank
    ws = dist.get_world_size() if dist.is_initialized() else 1
    elsewhere = state["world_size"] != ws
    if elsewhere and any_world_size:  # a global sampler state; generators reseeded
        restore = set(restore) - {k for k in STATE_KEYS if k.startswith("rng_")}
        rank = 0
    elif elsewhere:
        raise ValueError(f"{path} was saved by {state['world_size']} ranks; this job "
                         f"has {ws} (per-rank RNG and sampler states would not match)")
    if "model" in restore:
        unwrap(model).load_state_dict(state["model"])
    if "optimizer" in restore and optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])
    if "scheduler" in restore and scheduler is not None:
        scheduler.load_state_dict(state["scheduler"])
    if scaler is not None and state.get("scaler"):
        scaler.load_state_dict(state["scaler"])
    mine = state["per_rank"][rank]
    if "sampler" in restore and sampler is not None:
        sampler.load_state_dict(mine["sampler"])
    set_rng_state(mine, restore)
    return {"step": state["step"], "epoch": state["epoch"],
            "world_size": state["world_size"]}


def load_latest_good(ckpt_dir: str | os.PathLike, model: torch.nn.Module,
                     optimizer: torch.optim.Optimizer | None = None,
                     scheduler: Any = None, sampler: ResumableSampler | None = None,
                     scaler: Any = None, any_world_size: bool = False
                     ) -> dict[str, Any] | None:
    """Restore the newest checkpoint of ``ckpt_dir`` that reads back whole.

    A truncated or corrupt newest file (a full disk, a crash during a copy) is
    skipped with a warning naming it, and the one before is tried: losing a few
    steps beats losing the run. A file that reads but does not fit (another world
    size) is an error, not a reason to go back, unless ``any_world_size``: the
    sampler state is then global (the same on every rank: rank 0's is loaded) and
    the generators are not restored (the caller reseeds them).

    Returns:
        ``{"step", "epoch", "world_size" (the saver's), "path"}``, or None when no
        checkpoint reads back.

    Taught in: Chapter 9, "When the newest checkpoint is damaged".
    """
    for step, path in reversed(list_checkpoints(ckpt_dir)):
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # truncated zip, bad CRC, not a checkpoint at all
            warnings.warn(f"checkpoint {path} is damaged ({type(exc).__name__}: "
                          f"{str(exc)[:120]}); falling back to the one before",
                          stacklevel=2)
            continue
        out = _apply(state, path, model, optimizer, scheduler, sampler, STATE_KEYS,
                     scaler, any_world_size)
        return {**out, "path": path}
    return None
