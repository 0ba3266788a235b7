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

__all__ = ["OPS", "CommRecord", "CommLog", "record", "active"]


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


_LOCK = threading.RLock()


_ACTIVE: list[CommLog] = []


_TLS = threading.local()


def _depth() -> int:
    return getattr(_TLS, "depth", 0)


@contextmanager
def _counted() -> Iterator[None]:
    """Mark this thread as inside a recorded call: nested collectives not counted."""
    _TLS.depth = _depth() + 1
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
    with _LOCK:
        for log in _ACTIVE:
            log.records.append(rec)


def _numel(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel()
    if isinstance(x, (list, tuple)):
        return sum(_numel(t) for t in x)
    return 0


def _first_tensor(x: Any) -> torch.Tensor | None:
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, (list, tuple)):
        for t in x:
            found = _first_tensor(t)
            if found is not None:
                return found
    return None


def active() -> bool:
    """True while at least one :func:`~dtlib.collectives.accounting.count_comms` runs."""
    return bool(_ACTIVE)
