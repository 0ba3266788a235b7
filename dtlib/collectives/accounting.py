"""Communication accounting: which collectives a block of code issues, how many bytes.

Every later chapter asks "how much did this step send?"; :func:`count_comms` answers::

    with count_comms() as log:
        loss.backward(); opt.step()
    log.summary()   # [{"op": "all_reduce", "calls": 3, "bytes": 123456}, ...]

How the collectives are seen, and why this way (Chapter 2, "Counting communication"):
at the one layer every spelling goes through. ``dist.all_reduce``,
``distributed_c10d.all_reduce``, a process group's ``allreduce`` method,
``batch_isend_irecv``, DDP's C++ reducer and torch's FSDP2 all reach the dispatcher as
``torch.ops.c10d.*``; functional collectives and DTensor as
``torch.ops._c10d_functional.*``. One dispatch mode
(:mod:`dtlib.collectives.accounting_dispatch`) records each with its message size,
dtype, group and peer, and notes when its ``Work`` is waited on or its future taken
(:attr:`CommLog.events`). Nothing in ``torch.distributed`` is replaced, so nothing
needs restoring and blocks nest freely.

Message sizes follow torch / nccl-tests: all_reduce, broadcast, reduce, send, recv: the
tensor; all_gather and gather: the gathered (output) tensor; reduce_scatter and scatter:
the full unreduced (input) tensor; all_to_all: the input.

The mode adds a Python call to every tensor operation while a block is open: count a
step, and time another.

Taught in: Chapter 2, "Counting communication"; used by Chapters 3 (DDP) and 4 (ZeRO).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator

from dtlib.collectives.accounting_dispatch import make_mode, release_completed
from dtlib.collectives.comm_log import (ACTIVE_LOGS, LOCK, OPS, CommLog, CommRecord,
                                        record)
from dtlib.models.run import Callback, StepEnd

# The records' types and the ops are re-exported: a reader who counts imports from here.
__all__ = ["OPS", "CommLog", "CommRecord", "count_comms", "record", "CountComms"]


class CountComms(Callback):
    """The one loop's callback that records optimizer step ``step`` (1-based:
    its forward, backward and optimizer step) in :func:`count_comms`; the log is
    the run's ``RunResult.comms``. A later step is usually the one to count: the
    first one also runs one-time work (DDP's bucket set-up, a broadcast).

    Taught in: Chapter 2, "Counting communication".
    """

    def __init__(self, step: int = 1) -> None:
        if isinstance(step, bool) or not isinstance(step, int) or step < 1:
            raise ValueError(f"CountComms(step={step!r}): the optimizer step to count "
                             "must be an integer >= 1")
        self.step, self.log = step, None

    @contextmanager
    def _counting(self) -> Iterator[CommLog]:
        with count_comms() as log:
            self.log = log
            yield log

    def step_context(self, step: int) -> Any:
        return self._counting() if step == self.step else super().step_context(step)

    def on_step_end(self, end: StepEnd) -> None:
        if end.step == self.step:
            end.result.comms = self.log


@contextmanager
def count_comms(future_gate: Callable[[CommRecord], Any] | None = None,
                hold: Callable[[CommRecord], float | None] | None = None
                ) -> Iterator[CommLog]:
    """Record every collective this thread issues inside the block.

    Args:
        future_gate: for checks of overlap: called with each process-group
            collective's record, it may return a ``torch.futures.Future`` that holds
            back the collective's ``get_future()`` until it completes.
        hold: for a slower network (:mod:`dtlib.collectives.slow_link`): called with
            each collective's record, it returns the ``time.monotonic()`` before
            which that collective's waits and future do not complete (or None).
    Returns:
        A :class:`CommLog` filled as the block runs: the records in issue order and
        the waits (:attr:`CommLog.events`). Blocks nest: an inner block's collectives
        are in the outer log too.

    Taught in: Chapter 2, "Counting communication".
    """
    log = CommLog()
    with LOCK:
        ACTIVE_LOGS.append(log)
    try:
        with make_mode(future_gate, hold):
            yield log
    finally:
        with LOCK:
            ACTIVE_LOGS.remove(log)
        release_completed()
