"""Proving a resume: train N steps straight, or k steps, crash, load, and N - k more.

The job is :func:`dtlib.checkpoint.drill.train_run` (every source of randomness a
real job has; it saves, "crashes" and resumes through the one loop); this page runs
it straight and crashed-and-resumed under DDP (:func:`ddp_resume_proof`) and
compares the final parameters with ``torch.equal``.

Also here: the seed tutorial's defects 36, 38 and 39 as small reproductions.

Taught in: Chapter 9, "Proof: the resumed run is the run".
"""

from __future__ import annotations

import os
from typing import Any

import torch

from dtlib.checkpoint.drill import (RUN_CFG, CropNoiseTokens, CrashDuringSave,
                                    SimulatedCrash, train_run)
from dtlib.checkpoint.state import STATE_KEYS

__all__ = ["CropNoiseTokens", "RUN_CFG", "train_run", "ddp_resume_proof",
           "seed_save_name", "seed_resume_name", "seed_resume_step", "Payload",
           "crafted_checkpoint", "SimulatedCrash", "CrashDuringSave"]


def ddp_resume_proof(ckpt_dir: str, total_steps: int, stop_at: int,
                     restore: tuple[str, ...] | set[str] = STATE_KEYS
                     ) -> dict[str, Any]:
    """On every rank of a DDP job: the straight run, then crash-and-resume; compare.

    The resumed half starts from objects built from scratch (the first half's were
    dropped when :func:`train_run` returned).

    Returns:
        ``{"equal": torch.equal of the final parameters, "max_abs_diff",
        "straight", "resumed"}`` (flat parameter tensors).

    Taught in: Chapter 9, "Proof with DDP".
    """
    straight = train_run(total_steps)["params"]
    train_run(total_steps, ckpt_dir, save_every=stop_at, stop_at=stop_at)
    resumed = train_run(total_steps, ckpt_dir, resume=True, restore=restore)["params"]
    return {"equal": torch.equal(straight, resumed),
            "max_abs_diff": (straight - resumed).abs().max().item(),
            "straight": straight, "resumed": resumed}


# ---- ERRATA 36: the name written is not the name looked for --------------------------

def seed_save_name(epoch: int, step: int) -> str:
    """The file name the seed tutorial *saves* under (ERRATA 36)."""
    return f"checkpoint_epoch{epoch}_step{step}.pt"


def seed_resume_name(epoch: int) -> str:
    """The file name the seed tutorial *looks for* when resuming epoch ``epoch``."""
    return f"checkpoint_epoch{epoch - 1}_latest.pt"


def seed_resume_step(ckpt_dir: str, epoch: int) -> int:
    """The step the seed's resume logic starts from: 0 unless its name exists."""
    path = os.path.join(ckpt_dir, seed_resume_name(epoch))
    if os.path.exists(path):
        return int(torch.load(path, weights_only=True)["step"])
    return 0  # silently: no error, no warning, training restarts


# ---- ERRATA 39: a checkpoint is a pickle, and a pickle is a program ------------------

class Payload:
    """Unpickling this runs ``code`` (here: it writes a marker file)."""

    def __init__(self, code: str) -> None:
        self.code = code

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (exec, (self.code,))


def crafted_checkpoint(path: str, marker: str) -> str:
    """Save a checkpoint-looking file whose loading writes ``marker`` (harmless demo).

    Taught in: Chapter 9, "Loading is executing".
    """
    code = f"open({marker!r}, 'w').write('code ran during torch.load')"
    torch.save({"step": 7, "model": {"w": torch.zeros(2)}, "x": Payload(code)}, path)
    return path


# ---- ERRATA 38: a crash in the middle of writing -------------------------------------
# SimulatedCrash and CrashDuringSave live in dtlib.checkpoint.drill (the exercises
# use them too); the page imports them from here.
