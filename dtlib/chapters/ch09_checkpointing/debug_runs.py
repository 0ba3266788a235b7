"""What Chapter 9's "When it goes wrong on a cluster" runs: the seed's collective
that only rank 0 calls (ERRATA 10), caught by the standard tools instead of a
timeout.

- :func:`detail_mismatch`: under ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` torch wraps
  every process group in a checker that, before each collective, compares the
  collective's fingerprint (operation, shapes, dtypes, sequence number) across the
  ranks through a gloo side group: the mismatch is an error naming both calls on
  the first collective that differs, not a hang.
- :func:`missing_rank`: ``dist.monitored_barrier`` (gloo) waits for each rank in
  turn and names the ones that did not arrive within its timeout.

Taught in: Chapter 9, "When it goes wrong on a cluster".
"""

from __future__ import annotations

import re
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from dtlib.runtime.dist import cpu_group, world

__all__ = ["seed_step", "detail_mismatch", "without_devices", "missing_rank"]


def seed_step(group: dist.ProcessGroup | None = None) -> None:
    """The seed's mistake (ERRATA 10, Chapter 2): only rank 0 calls ``reduce``;
    the others go on to the next collective (the next step's gradient all-reduce)."""
    t = torch.tensor([world().rank + 1.0], device=world().device)
    if world().rank == 0:  # the mistake: a collective only one rank calls
        dist.reduce(t, dst=0, group=group)
    grads = torch.zeros(4, device=world().device)
    dist.all_reduce(grads, group=group)


def detail_mismatch() -> str:
    """On every rank: :func:`seed_step` on a group made at the DETAIL debug level;
    returns the first line of the error this rank got (or "no error")."""
    # TORCH_DISTRIBUTED_DEBUG is read when torch.distributed is imported; these
    # ranks fork from a process that has imported it, so set the level here and
    # make the group after it: the level applies to groups created from now on.
    dist.set_debug_level(dist.DebugLevel.DETAIL)
    group = dist.new_group()  # the world's backend, wrapped by the checker
    try:
        seed_step(group)
    except RuntimeError as exc:
        return without_devices(str(exc).strip().splitlines()[0])
    finally:
        dist.set_debug_level(dist.DebugLevel.OFF)
    return "no error"


def without_devices(message: str) -> str:
    """The checker's message without the long ``TensorDeviceTypes=TensorOptions(...)``
    of each fingerprint (the operation, shapes and dtypes stay)."""
    return re.sub(r",? ?TensorDeviceTypes=TensorOptions\((?:[^()]|\([^()]*\))*\)",
                  "", message)


def missing_rank(stuck_s: float = 2.0, timeout_s: float = 0.5) -> str:
    """On every rank: the last rank is stuck (sleeps ``stuck_s``, as in a
    deadlocked collective or a slow file system); the others call
    ``monitored_barrier`` with a ``timeout_s`` timeout. Returns what it said."""
    me, last = world().rank, world().world_size - 1
    group = cpu_group()  # monitored_barrier is gloo's (a side group on NCCL)
    if me == last:
        time.sleep(stuck_s)
        return "stuck"
    try:
        dist.monitored_barrier(group=group, timeout=timedelta(seconds=timeout_s),
                               wait_all_ranks=True)
    except RuntimeError as exc:
        return str(exc).strip().splitlines()[0]
    return "passed"
