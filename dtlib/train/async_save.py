"""Saves that do not stop training: ``--async-save``.

A synchronous save stalls every rank for the whole write (serialise, write, fsync,
hash). An asynchronous one stalls the loop only while the state is copied to CPU
memory (the copy is what the next optimizer step may no longer change); a
background thread writes the copy while training goes on:
``torch.distributed.checkpoint.async_save``, for every strategy (one format,
:mod:`dtlib.train.state`), on a gloo process group of its own
(:func:`dtlib.runtime.dist.cpu_group`): DCP's planning and finishing collectives run
in its writer thread, and on the training group they would interleave with the
steps' collectives in another order on each rank.

Publishing is what makes a checkpoint visible, and it comes last: the DCP directory
is written as ``stepNNNNNNNN.tmp`` and renamed, after its manifest, once every
rank's writer is done (rank 0's DCP future completes only after every rank's
``write_data``). The next save, and the
end of the run, first wait for the previous one: one save in flight at most, and
``--keep-last`` deletes old checkpoints only once the new one is published. A crash
in the middle leaves a ``.tmp`` directory, which no resume lists and the next save
deletes.

Taught in: Chapter 10, "Crash and resume".
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from dtlib.runtime import dist as ddist
from dtlib.train.job import Job
from dtlib.train.state import begin_save, publish, state_to_save

__all__ = ["BackgroundSaver"]


class BackgroundSaver:
    """Asynchronous saves of a :class:`~dtlib.train.job.Job`, one in flight at most.

    ``save(step)`` waits for the previous save, stages this one and returns;
    ``close()`` waits for the last one. Every rank calls both at the same steps.

    Args:
        job: the live run (its strategy says which format; ``cfg.ckpt_dir`` where).
        published: called on every rank once a save is published (the capstone's
            ``--keep-last`` retention).

    Taught in: Chapter 10, "Crash and resume".
    """

    def __init__(self, job: Job, published: Callable[[], Any] | None = None) -> None:
        if not hasattr(dcp, "async_save"):  # pragma: no cover - torch < 2.3
            raise RuntimeError("--async-save needs torch.distributed.checkpoint."
                               "async_save (torch >= 2.3); this is "
                               f"{torch.__version__}")
        self.job, self.published = job, published
        self.pending: Future | None = None
        #: (step, seconds from the start of its save to its files all written) of
        #: the newest save known to be done, for the preemption window; None
        #: before the first one finishes. (``save`` returns sooner: it only stages.)
        self.written: tuple[int, float] | None = None
        self.group: Any = None  # the writer's gloo group, made at the first save
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt")

    def save(self, step: int) -> float:
        """Wait for the previous save, then start the save of ``step``. Returns
        the seconds the loop was held (the wait and the staging)."""
        held = time.perf_counter()
        self.wait()
        began = time.perf_counter()  # this save's own clock starts after the wait
        job = self.job
        if self.group is None:
            self.group = ddist.cpu_group()  # a collective: every rank, same save
        tmp, final = begin_save(job, step)
        written = dcp.async_save(state_to_save(job), checkpoint_id=tmp,
                                 process_group=self.group)  # staged when it returns
        written = getattr(written, "upload_completion", written)  # newer stagers
        publishes = dist.get_rank() == 0

        def done() -> None:  # rank 0's future: every rank's files are written
            written.result()
            if publishes:
                publish(tmp, final, step, job, time.perf_counter() - began)
            self.written = (step, time.perf_counter() - began)  # before wait returns
        self.pending = self.pool.submit(done)
        return time.perf_counter() - held

    def wait(self) -> None:
        """Block until the save in flight (if any) is written and published; a
        writer's error is raised here."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        pending.result()
        if self.published is not None:
            self.published()

    def close(self) -> None:
        """Wait for the last save; every rank returns once it is published."""
        self.wait()
        self.pool.shutdown()
        if dist.is_initialized():
            dist.barrier()
