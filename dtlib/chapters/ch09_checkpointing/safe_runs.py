"""What chapter 9 runs to show that DCP's metadata is a pickle, and the fallback.

Taught in: Chapter 9, "Safe loads" and "When the newest checkpoint is damaged".
"""

from __future__ import annotations

import os
import pickle
import warnings
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from dtlib.checkpoint.safe_dcp import CheckpointDamaged, safe_dcp_load, write_manifest
from dtlib.checkpoint.state import load_latest_good, save_checkpoint

__all__ = ["Payload", "dcp_pickle_demo", "fallback_demo"]


class Payload:
    """What an attacker pickles: loading it calls ``open(marker, "w")``."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        return (open, (self.marker, "w"))


def dcp_pickle_demo(work_dir: str) -> dict[str, Any]:
    """Save a small DCP checkpoint, swap in a crafted ``.metadata``, load it twice.

    Returns:
        ``{"plain_ran_code": did dcp.load run the payload,
        "safe_refused": safe_dcp_load's message, "safe_ran_code": bool}``.
    """
    ck = os.path.join(work_dir, "dcp_ckpt")
    state = {"w": torch.randn(4, 3)}
    with warnings.catch_warnings():  # "assuming a single process": yes
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=ck, no_dist=True)
        out: dict[str, Any] = {}
        for way in ("plain", "safe"):
            marker = os.path.join(work_dir, f"{way}_code_ran")
            with open(os.path.join(ck, ".metadata"), "wb") as f:
                pickle.dump(Payload(marker), f)
            write_manifest(ck, world_size=1, step=0)  # the forger rewrites it too
            try:
                if way == "plain":
                    dcp.load({"w": torch.zeros(4, 3)}, checkpoint_id=ck, no_dist=True)
                else:
                    safe_dcp_load({"w": torch.zeros(4, 3)}, ck, no_dist=True)
            except CheckpointDamaged as exc:
                out["safe_refused"] = str(exc).split(": ", 1)[1]
            except CheckpointException:  # the payload is no metadata: DCP fails,
                pass  # after running it
            out[f"{way}_ran_code"] = os.path.exists(marker)
    return out


def fallback_demo(work_dir: str) -> dict[str, Any]:
    """Two checkpoints, the newest truncated (a full disk): resume from the older.

    Returns:
        ``{"resumed_step", "warning"}``.
    """
    ck = os.path.join(work_dir, "ddp_ckpt")
    net = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    save_checkpoint(ck, 3, net, opt)
    newest = save_checkpoint(ck, 6, net, opt)
    with open(newest, "r+b") as f:
        f.truncate(os.path.getsize(newest) // 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = load_latest_good(ck, net, opt)
    return {"resumed_step": got["step"] if got else None,
            "warning": str(caught[0].message) if caught else ""}
