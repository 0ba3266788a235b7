"""The ledger of communication: records, logs, and who is counting right now.

Shared by the two interception mechanisms (:mod:`dtlib.collectives.accounting` patches
``torch.distributed``; :mod:`dtlib.collectives.accounting_dispatch` watches the
dispatcher), which both write here and never import each other's internals.

Taught in: Chapter 2, "Counting communication".
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

__all__ = ["OPS", "CommRecord", "CommLog", "LOCK", "ACTIVE_LOGS", "record", "active",
           "depth", "counted", "numel_of", "first_tensor"]


OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce", "gather",
       "scatter", "all_to_all", "send", "recv", "barrier")


@dataclass(frozen=True)
class CommRecord:
    """One collective as seen by one rank.

    op: canonical name (one of :data:`OPS`).
    numel: elements of the op's logical message (see the module docstring).
    bytes: ``numel`` times the element size.
    group_size: ranks in the group the op ran on.
    source: where it was seen: "torch.distributed", "functional", "c10d", "ddp_hook".
    ranks: global ranks of that group, when known (which mesh dimension it ran on).
    """

    op: str
    numel: int
    bytes: int
    group_size: int
    source: str
    ranks: tuple[int, ...] = ()


@dataclass
class CommLog:
    """The records of one :func:`count_comms` block, with totals per op."""

    records: list[CommRecord] = field(default_factory=list)

    def _select(self, op: str | None) -> list[CommRecord]:
        if op is not None and op not in OPS:
            raise ValueError(f"op={op!r} is not a collective; allowed: {OPS}")
        return [r for r in self.records if op is None or r.op == op]

    def calls(self, op: str | None = None) -> int:
        """Number of calls of ``op`` (all ops when None)."""
        return len(self._select(op))

    def total_bytes(self, op: str | None = None) -> int:
        """Sum of message bytes of ``op`` (all ops when None)."""
        return sum(r.bytes for r in self._select(op))

    def total_numel(self, op: str | None = None) -> int:
        """Sum of message elements of ``op`` (all ops when None)."""
        return sum(r.numel for r in self._select(op))

    def summary(self) -> list[dict[str, Any]]:
        """One dict per op seen, in first-seen order: ``op``, ``calls``, ``bytes``."""
        ops = list(dict.fromkeys(r.op for r in self.records))
        return [{"op": op, "calls": self.calls(op), "bytes": self.total_bytes(op)}
                for op in ops]


# What both interception mechanisms share: the logs being written (guarded by LOCK)
# and, per thread, how deep inside a recorded call the thread is.
LOCK = threading.RLock()
"""Guards :data:`ACTIVE_LOGS` (count_comms blocks may start on several threads)."""

ACTIVE_LOGS: list[CommLog] = []
"""The logs of the :func:`~dtlib.collectives.accounting.count_comms` blocks now open."""

_TLS = threading.local()


def depth() -> int:
    """How many recorded calls this thread is inside (0: a call here is counted).

    Taught in: Chapter 2, counting communication.
    """
    return getattr(_TLS, "depth", 0)


@contextmanager
def counted() -> Iterator[None]:
    """Mark this thread as inside a recorded call: nested collectives not counted.

    Taught in: Chapter 2, counting communication.
    """
    _TLS.depth = depth() + 1
    try:
        yield
    finally:
        _TLS.depth -= 1


def record(op: str, numel: int, element_size: int, group_size: int,
           source: str, ranks: tuple[int, ...] = ()) -> None:
    """Append one record to every active :func:`count_comms` log (no-op when none).

    Public so that hand-written communication (Chapter 2's ring collectives, a custom
    hook) can be accounted the same way.
    """
    if op not in OPS:
        raise ValueError(f"op={op!r} is not a collective; allowed: {OPS}")
    rec = CommRecord(op, int(numel), int(numel) * int(element_size), int(group_size),
                     source, tuple(int(r) for r in ranks))
    with LOCK:
        for log in ACTIVE_LOGS:
            log.records.append(rec)


def numel_of(x: Any) -> int:
    """Elements of a tensor, or of every tensor in a (nested) list or tuple.

    Args:
        x: a collective's message argument.
    Returns:
        The element count (0 for anything that holds no tensor).

    Taught in: Chapter 2, counting communication.
    """
    if isinstance(x, torch.Tensor):
        return x.numel()
    if isinstance(x, (list, tuple)):
        return sum(numel_of(t) for t in x)
    return 0


def first_tensor(x: Any) -> torch.Tensor | None:
    """The first tensor of a (nested) list or tuple, or ``x`` itself if a tensor.

    Args:
        x: a collective's message argument.
    Returns:
        That tensor (its element size prices the message), or None.

    Taught in: Chapter 2, counting communication.
    """
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, (list, tuple)):
        for t in x:
            found = first_tensor(t)
            if found is not None:
                return found
    return None


def active() -> bool:
    """True while a :func:`~dtlib.collectives.accounting.count_comms` block is open."""
    return bool(ACTIVE_LOGS)
