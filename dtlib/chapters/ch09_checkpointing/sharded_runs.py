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

from dtlib.checkpoint.drill import FSDP_CFG, fsdp_model, fsdp_train
from dtlib.checkpoint.sharded import flatten, load_sharded, save_sharded, state_bytes
from dtlib.checkpoint.state import atomic_save
from dtlib.models.run import full_tensor, local_tensor

__all__ = ["FSDP_CFG", "fsdp_model", "fsdp_train", "fsdp_save_both", "fsdp_load_both"]


def _fsdp_job(seed: int, train_steps: int) -> tuple[torch.nn.Module, Any]:
    """FSDP2 on every rank, trained ``train_steps`` steps so that the optimizer has
    moments worth saving."""
    par, model, opt = fsdp_model(seed)
    fsdp_train(par, model, opt, 0, train_steps)
    return model, opt


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
