"""A slower network on one machine: every collective priced by the alpha-beta model.

Chapter 15 asks what training costs when the ranks talk over Ethernet or across data
centres. Loopback (gloo between processes of one machine) is fast; inside
``slow_link(alpha, beta)`` it is slow in a way the cost model can check. Every
collective this thread issues, whatever spells it (the one observer of Chapter 2 sees
it: ``dist.*``, DDP's reducer and its comm hooks, FSDP2, DTensor), completes no earlier
than the alpha-beta model says it would on a link of latency ``alpha`` (seconds per
message) and ``beta`` seconds per byte (bandwidth ``1 / beta``):

- the link is this rank's network card, one collective at a time. A collective starts
  when it is issued or when the one before it has left, whichever is later, and takes
  :func:`~dtlib.collectives.cost_model.link_seconds` (a ring all-reduce of N bytes on
  n ranks: 2(n-1) alpha + 2(n-1)/n N beta);
- until then its ``wait()`` does not return and its future (what DDP's reducer and a
  comm hook take) does not complete. Computation in between goes on: DDP's buckets
  still overlap backward, and a collective waited on at once (``dist.all_reduce``)
  costs its whole time.

The real collective still runs underneath (its numbers are the loopback's, its time
is added to the model's). What it does not model: congestion, another job on the
link, a slower rank (each rank prices its own messages; the real collective under
them keeps the ranks in step).

Taught in: Chapter 15, "A slow link you can measure".
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager
from typing import Any, ContextManager, Iterator

from dtlib.collectives.accounting import count_comms
from dtlib.collectives.comm_log import CommLog, CommRecord
from dtlib.collectives.cost_model import check_link, link_seconds
from dtlib.models.run import Callback, StepEnd

__all__ = ["SlowLink", "slow_link", "SlowLinkSteps"]

class SlowLink:
    """One rank's network card: the collectives it carried and when it is free.

    alpha, beta: the link (seconds per message, seconds per byte).
    log: the collectives of the last block (the observer's :class:`CommLog`).
    held: seconds of link time charged per collective, in issue order.
    sent_bytes: message bytes of every collective charged (nccl-tests' N).

    Taught in: Chapter 15, "A slow link you can measure".
    """

    def __init__(self, alpha: float, beta: float) -> None:
        check_link(alpha, beta)
        self.alpha, self.beta = float(alpha), float(beta)
        self.log: CommLog | None = None
        self.held: list[float] = []
        self.sent_bytes = 0
        self._free_at = 0.0

    def hold(self, rec: CommRecord) -> float | None:
        """When ``rec`` may complete: it starts once the link is free and takes
        :func:`~dtlib.collectives.cost_model.link_seconds` (the ``hold`` of
        :func:`~dtlib.collectives.accounting.count_comms`)."""
        seconds = link_seconds(rec.op, rec.bytes, rec.group_size, self.alpha,
                               self.beta)
        self.held.append(seconds)
        self.sent_bytes += rec.bytes
        if seconds == 0:
            return None
        self._free_at = max(time.monotonic(), self._free_at) + seconds
        return self._free_at

    def seconds(self) -> float:
        """Link time charged so far (the sum of :attr:`held`)."""
        return math.fsum(self.held)

    @contextmanager
    def block(self) -> Iterator["SlowLink"]:
        """Price every collective this thread issues inside the block."""
        with count_comms(hold=self.hold) as log:
            self.log = log
            yield self


def slow_link(alpha: float, beta: float) -> ContextManager[SlowLink]:
    """Run the block's collectives as if over a link of latency ``alpha`` (s) and
    ``beta`` (s/byte), e.g. ``slow_link(1e-3, 1 / 100e6)``: 1 ms, 100 MB/s. Returns
    the :class:`SlowLink` (what it carried and charged).

    Taught in: Chapter 15, "A slow link you can measure".
    """
    return SlowLink(alpha, beta).block()


class SlowLinkSteps(Callback):
    """The one loop's callback that runs every step on one :class:`SlowLink`:
    ``run_steps(..., callbacks=[SlowLinkSteps(alpha, beta)])``; the run's
    ``step_times`` are then the slow link's, ``link.seconds()`` what it charged and
    :attr:`messages` each step's collectives on it, ``(op, bytes)``.

    Taught in: Chapter 15, "A slow link you can measure".
    """

    def __init__(self, alpha: float, beta: float) -> None:
        self.link = SlowLink(alpha, beta)
        self.messages: list[list[tuple[str, int]]] = []

    def step_context(self, step: int) -> ContextManager[Any]:
        return self.link.block()

    def on_step_end(self, end: StepEnd) -> None:
        self.messages.append([(r.op, r.bytes) for r in self.link.log.records])
