"""What Chapter 9's page runs for sharded checkpoints: FSDP2 save and load, ours and
DCP.

Taught in: Chapter 9, "Sharded checkpoints".
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from dtlib import zero
from dtlib.checkpoint.sharded import flatten, load_sharded, save_sharded, state_bytes
from dtlib.checkpoint.state import atomic_save
from dtlib.models.gpt import build_gpt, token_batch
from dtlib.models.run import RunConfig, TrainState, full_tensor, local_tensor, run_steps
from dtlib.models.sizes import size
from dtlib.runtime.dist import world

__all__ = ["FSDP_CFG", "fsdp_model", "fsdp_train", "fsdp_save_both", "fsdp_load_both"]

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
    run_steps(par, None, lambda step: _batch(device, first_step + step),
              RunConfig(steps, record_grads=False, record_params=False),
              TrainState(model, opt))


def _fsdp_job(seed: int, train_steps: int) -> tuple[torch.nn.Module, Any]:
    """FSDP2 on every rank, trained ``train_steps`` steps so that the optimizer has
    moments worth saving."""
    par, model, opt = fsdp_model(seed)
    fsdp_train(par, model, opt, 0, train_steps)
    return model, opt


def _batch(device: torch.device, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return token_batch(FSDP_CFG, 8, seed=100 + step, device=device)


def _full(state: Any) -> dict[str, torch.Tensor]:
    """Flattened full tensors of ``state`` (DTensors gathered: collective)."""
    return {k: full_tensor(v).detach().cpu().clone()
            for k, v in flatten(state).items() if isinstance(v, torch.Tensor)}


def fsdp_save_both(teach_dir: str, dcp_dir: str, naive_path: str) -> dict[str, Any]:
    """Rank function: train FSDP2 2 steps, save three ways, report what each holds.

    Saves (a) the seed's way, ``torch.save`` of rank 0's state dict to ``naive_path``,
    (b) :func:`save_sharded` to ``teach_dir``, (c) ``dcp.save`` to ``dcp_dir``.

    Returns:
        ``{"bytes": state_bytes of model+optimizer, "naive_file_bytes",
        "full": flattened full tensors}`` (``full`` on rank 0 only).

    Taught in: Chapter 9, "Sharded state".
    """
    model, opt = _fsdp_job(seed=0, train_steps=2)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    if dist.get_rank() == 0:  # ERRATA 40: what "save on rank 0" really writes
        atomic_save({k: local_tensor(v) for k, v in flatten(state).items()
                     if isinstance(v, torch.Tensor)}, naive_path)
    dist.barrier()
    save_sharded(state, teach_dir)
    dcp.save(state, checkpoint_id=dcp_dir)
    full = _full(state)
    return {"bytes": state_bytes(state),
            "naive_file_bytes": os.path.getsize(naive_path),
            "full": full if dist.get_rank() == 0 else None}


def fsdp_load_both(teach_dir: str, dcp_dir: str) -> dict[str, Any]:
    """Rank function: load both checkpoints into fresh FSDP2 jobs of this world size.

    Each fresh model starts from other weights (seed 1) and an optimizer with zeroed
    moments, so a tensor that was not loaded would show.

    Returns:
        ``{"teach": ..., "dcp": ...}``: flattened full tensors after each load.

    Taught in: Chapter 9, "Sharded state".
    """
    out = {}
    for name in ("teach", "dcp"):
        model, opt = _fsdp_job(seed=1, train_steps=0)
        msd, osd = get_state_dict(model, opt)  # initialises the optimizer's state
        state = {"model": msd, "optim": osd}
        if name == "teach":
            load_sharded(state, teach_dir)
        else:
            dcp.load(state, checkpoint_id=dcp_dir)
        set_state_dict(model, opt, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        out[name] = _full(dict(zip(("model", "optim"), get_state_dict(model, opt))))
    return out
