"""What the capstone survives: preemption signals, a dead rank, a full disk of
checkpoints.

- :class:`Preemption`: SIGTERM (what Kubernetes and Slurm send first) and SIGUSR1
  (Slurm's ``--signal=USR1@SECONDS`` warning) set a flag; at the next step boundary
  the ranks agree (one all-reduce of the flag: the signal may reach them at different
  steps), save and leave the loop, and the script exits 0. The handlers are put back
  when the run ends.
- :func:`kill_rehearsal`: ``--kill-at-step K`` SIGKILLs the last rank in the middle of
  step K, in the first attempt only (torchrun's ``TORCHELASTIC_RESTART_COUNT`` is 0):
  under ``torchrun --max-restarts=N`` the agent sees a dead worker, stops the others
  and starts the group again, and the new processes resume from the newest good
  checkpoint by themselves.
- :func:`retain`: ``--keep-last K`` deletes all but the K newest checkpoints of this
  run after each save (those whose ``run.json`` is this run's; nothing else).

Taught in: Chapter 10, "Crash and resume".
"""

from __future__ import annotations

import os
import shutil
import signal
import threading
from typing import Any, Callable

import torch
import torch.distributed as dist

from dtlib.runtime import dist as ddist
from dtlib.train.identity import own_step_dirs

__all__ = ["Preemption", "kill_rehearsal", "retain", "SIGNALS"]

#: The signals that ask for a save and a clean exit.
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preemption:
    """A context in which SIGTERM/SIGUSR1 ask the run to save and stop.

    ``requested()`` at a step boundary: whether any rank has received one (a
    collective: every rank calls it at the same step).

    Taught in: Chapter 10, "Crash and resume".
    """

    def __init__(self) -> None:
        self.signum = 0
        self._old: dict[int, Any] = {}

    def __enter__(self) -> "Preemption":
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:  # only the main thread may set handlers
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)

    def _handle(self, signum: int, frame: Any) -> None:
        self.signum = signum  # nothing else: the step in flight finishes

    def requested(self) -> str | None:
        """The signal's name if any rank got one (agreed by all), else None."""
        flag = torch.tensor([self.signum], device=ddist.world().device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        got = int(flag.item())
        return signal.Signals(got).name if got else None


def kill_rehearsal(batch_fn: Callable[[int], Any], step: int, rank: int
                   ) -> Callable[[int], Any]:
    """``batch_fn`` that SIGKILLs this process after loading step ``step``'s batch
    (the other ranks are then inside that step's collectives), when this is
    ``rank`` in torchrun's first attempt; otherwise ``batch_fn`` itself.

    Taught in: Chapter 10, "Crash and resume".
    """
    if not step or ddist.world().rank != rank \
            or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return batch_fn

    def dying(index: int) -> Any:
        batch = batch_fn(index)
        if index + 1 == step:
            ddist.rprint(f"rank {rank}: SIGKILL in step {step} (--kill-at-step)",
                         all_ranks=True, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return batch
    return dying


def retain(ckpt_dir: str, keep_last: int, identity: dict[str, Any]) -> list[str]:
    """Delete all but the ``keep_last`` newest checkpoints of this run in
    ``ckpt_dir`` (0: keep every one); rank 0 only. A checkpoint whose ``run.json``
    is not ``identity``'s (another run's, or unreadable: damaged) is never
    deleted. Returns the paths deleted.

    Taught in: Chapter 10, "Crash and resume".
    """
    if not keep_last or not ddist.world().is_main:
        return []
    gone = own_step_dirs(ckpt_dir, identity)[keep_last:]  # newest first
    for path in gone:
        shutil.rmtree(path)
    return gone
