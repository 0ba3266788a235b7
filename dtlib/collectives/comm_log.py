"""The ledger of communication: records, logs, and who is counting right now.

Written by the one recorder (:mod:`dtlib.collectives.accounting_dispatch`, entered by
:func:`~dtlib.collectives.accounting.count_comms`) and by hand-written communication
that accounts for itself (:func:`record`).

Taught in: Chapter 2, "Counting communication".
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

__all__ = ["OPS", "CommRecord", "CommLog", "LOCK", "ACTIVE_LOGS", "record", "note",
           "active", "depth", "counted", "numel_of", "first_tensor"]


OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce", "gather",
       "scatter", "all_to_all", "send", "recv", "barrier")


@dataclass(frozen=True)
class CommRecord:
    """One collective as seen by one rank.

    op: canonical name (one of :data:`OPS`).
    numel: elements of the op's logical message (see the module docstring).
    bytes: ``numel`` times the element size.
    group_size: ranks in the group the op ran on.
    source: where it was seen: "c10d" (every process-group collective, whoever called
        it: ``dist.*``, a group's methods, DDP's reducer, FSDP2, ``batch_isend_irecv``),
        "functional" (functional collectives and DTensor), or what :func:`record` was
        given.
    ranks: global ranks of that group, when known (which mesh dimension it ran on).
    dtype: the message's element type ("torch.bfloat16"), "" when it holds no tensor.
    peer: for send and recv, the global rank at the other end; else None.
    seq: this process's running number of the record; :attr:`CommLog.events` name it.
    """

    op: str
    numel: int
    bytes: int
    group_size: int
    source: str
    ranks: tuple[int, ...] = ()
    dtype: str = ""
    peer: int | None = None
    seq: int = -1


@dataclass
class CommLog:
    """The records of one :func:`count_comms` block, with totals per op.

    ``events`` is the block's timeline on this rank: ``("issue", seq)`` when a
    collective is issued, ``("wait", seq)`` for a ``work.wait()`` on it (a blocking
    call is an issue and a wait) or a functional collective's wait, ``("future", seq)``
    for ``work.get_future()`` (DDP's reducer and comm hooks take the future).
    """

    records: list[CommRecord] = field(default_factory=list)
    events: list[tuple[str, int]] = field(default_factory=list)

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

    def waited(self, rec: CommRecord) -> bool:
        """True if ``rec``'s work was waited on (or its future taken) in the block."""
        return any(seq == rec.seq and kind != "issue" for kind, seq in self.events)

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
_SEQ = [0]


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
           source: str, ranks: tuple[int, ...] = (), dtype: str = "",
           peer: int | None = None) -> CommRecord:
    """Append one record to every active :func:`count_comms` log (no-op when none).

    Public so that communication no process group sees (a transport of one's own) can
    be accounted the same way.

    Returns:
        The record (its ``seq`` names it in :attr:`CommLog.events`).
    """
    if op not in OPS:
        raise ValueError(f"op={op!r} is not a collective; allowed: {OPS}")
    with LOCK:
        _SEQ[0] += 1
        rec = CommRecord(op, int(numel), int(numel) * int(element_size),
                         int(group_size), source, tuple(int(r) for r in ranks),
                         dtype, None if peer is None else int(peer), _SEQ[0])
        for log in ACTIVE_LOGS:
            log.records.append(rec)
            log.events.append(("issue", rec.seq))
    return rec


def note(kind: str, seq: int) -> None:
    """Append ``(kind, seq)`` ("wait" or "future") to every active log's timeline."""
    with LOCK:
        for log in ACTIVE_LOGS:
            log.events.append((kind, seq))


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
