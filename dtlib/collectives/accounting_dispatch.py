"""The one recorder of communication: every collective, at the dispatcher.

Whatever spelling issues a collective (``dist.all_reduce``,
``distributed_c10d.all_reduce``, ``dist.group.WORLD.allreduce``, ``batch_isend_irecv``,
DDP's C++ reducer, FSDP2, a functional collective, a DTensor redistribution), it reaches
the dispatcher as one operator: ``torch.ops.c10d.*`` for a process group's collectives,
``torch.ops._c10d_functional.*`` for the functional ones (which DTensor uses). A
``TorchDispatchMode`` sees both there, as torch's own
:class:`torch.distributed.tensor.debug.CommDebugMode` does; unlike CommDebugMode it
records message sizes, dtypes, groups and peers into the open
:func:`~dtlib.collectives.accounting.count_comms` logs.

It also sees what happens to each collective afterwards. A process group's collective
returns a ``Work``; the mode hands back a :class:`RecordedWork` around it, which notes
every ``wait()`` and ``get_future()`` (a blocking call is an issue followed by a wait)
and can hold the future back (``future_gate``: the exercise checkers use it to show
that a DDP hook does not wait for its own all-reduce). A functional collective's wait
is its ``wait_tensor``. ``hold`` gives each collective a moment before which its
waits and its future do not complete (:mod:`dtlib.collectives.slow_link` prices it
on a slower network).

What it does not see: collectives issued on another thread than the one that opened the
block (a dispatch mode is per thread), and anything that is not a torch process group.
Used by :mod:`dtlib.collectives.accounting` (:func:`count_comms`).

Taught in: Chapter 2, "Counting communication".
"""

from __future__ import annotations

import datetime
import threading
import time
import weakref
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from dtlib.collectives.comm_log import (CommRecord, active, counted, depth,
                                        first_tensor, note, numel_of, record)

__all__ = ["RecordedWork", "make_mode", "sleep_until", "delayed"]

_FUNCTIONAL_OPS = {
    "all_reduce": "all_reduce", "all_reduce_": "all_reduce",
    "all_reduce_coalesced": "all_reduce", "all_reduce_coalesced_": "all_reduce",
    "all_gather_into_tensor": "all_gather", "all_gather_into_tensor_out": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "all_to_all_single": "all_to_all", "broadcast": "broadcast",
    "broadcast_": "broadcast",
    "isend": "send", "irecv": "recv",
}
_C10D_OPS = {
    "allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce",
    "allgather_": "all_gather", "_allgather_base_": "all_gather",
    "allgather_coalesced_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather",
    "reduce_scatter_": "reduce_scatter", "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter", "broadcast_": "broadcast",
    "reduce_": "reduce", "gather_": "gather", "scatter_": "scatter",
    "alltoall_": "all_to_all", "alltoall_base_": "all_to_all", "send": "send",
    "recv_": "recv", "recv_any_source_": "recv", "barrier": "barrier",
}
_FUNCTIONAL_NAMESPACES = ("_c10d_functional", "c10d_functional",
                          "_c10d_functional_autograd")


def _group_of(args: tuple, kwargs: dict) -> Any:
    """The process group a dispatcher-level collective names (or None)."""
    for a in (*args, *kwargs.values()):
        try:
            if isinstance(a, dist.ProcessGroup):
                return a
            if isinstance(a, torch.ScriptObject):  # the boxed ProcessGroup
                return dist.ProcessGroup.unbox(a)
            if isinstance(a, str):  # a functional collective's group name
                return c10d._resolve_process_group(a)
        except Exception:  # a ScriptObject or a string that is not a group
            continue
    return None


def _ranks_of(group: Any) -> tuple[int, ...]:
    try:
        return tuple(dist.get_process_group_ranks(group))
    except Exception:  # not a registered group (a test's own): ranks unknown
        return ()


def _message(op: str, args: tuple, group_size: int, functional: bool
             ) -> tuple[int, Any]:
    """The logical message of a collective: (elements, a tensor that prices them).

    Sizes follow torch and nccl-tests: all_reduce, broadcast, reduce, send, recv: the
    tensor; all_gather and gather: the gathered (output) tensor; reduce_scatter and
    scatter: the full unreduced (input) tensor; all_to_all: the input.
    """
    if op == "barrier":
        return 0, None
    if functional:
        numel = numel_of(args[0])
        if op == "all_gather" and group_size > 0:
            numel *= group_size  # the input is one shard; the message is the output
        return numel, args[0]
    # c10d schemas: outputs come first, inputs second (where there are both).
    if op in ("reduce_scatter", "all_to_all"):
        return numel_of(args[1]), args[1]
    if op == "gather":  # the root's output list is empty elsewhere: n inputs
        return numel_of(args[1]) * max(group_size, 0), args[1]
    if op == "scatter":
        return numel_of(args[0]) * max(group_size, 0), args[0]
    return numel_of(args[0]), args[0]


def _record(func: Any, args: tuple, kwargs: dict) -> CommRecord | None:
    namespace = getattr(func, "namespace", "")
    name = func._overloadpacket.__name__.split(".")[-1]
    functional = namespace in _FUNCTIONAL_NAMESPACES
    if functional and name in _FUNCTIONAL_OPS:
        op = _FUNCTIONAL_OPS[name]
    elif namespace == "c10d" and name in _C10D_OPS:
        op = _C10D_OPS[name]
    else:
        return None
    group = _group_of(args, kwargs)
    ranks = _ranks_of(group) if group is not None else ()
    if functional and "group_size" in kwargs:
        group_size = int(kwargs["group_size"])
    elif group is not None:
        group_size = int(group.size())
    else:
        ints = [a for a in args[1:] if isinstance(a, int) and not isinstance(a, bool)]
        group_size = ints[-1] if ints else -1
    numel, priced = _message(op, args, group_size, functional)
    first = first_tensor(priced)
    peer = None
    if op in ("send", "recv") and not functional and name != "recv_any_source_":
        peer = int(args[2])  # a group rank: made global below
        if ranks and 0 <= peer < len(ranks):
            peer = ranks[peer]
    return record(op, numel, first.element_size() if first is not None else 0,
                  group_size, "functional" if functional else "c10d", ranks,
                  str(first.dtype) if first is not None else "", peer)


# A Work handed to C++ (DDP's reducer, ProcessGroup::allreduce) keeps only its C++ half
# alive: if its Python half were collected, C++ would call the base Work::wait, which
# never returns. Every RecordedWork is therefore kept: in _LIVE while it holds the real
# Work, then in _RELEASED, a small object per collective counted (count a step, not a
# run), never looked at again.
_LIVE: list["RecordedWork"] = []
_RELEASED: list["RecordedWork"] = []
_KEPT_LOCK = threading.Lock()


class RecordedWork(dist.Work):
    """A process group's ``Work`` that tells the logs when it is waited on.

    Args:
        inner: the real Work.
        seq: the :class:`CommRecord` it belongs to.
        gate: None, or a future that must complete before :meth:`get_future`'s does
            (``wait()`` itself is never held: a wait is what a check wants to see).
    """

    def __init__(self, inner: Any, seq: int, gate: Any = None,
                 any_source: bool = False, ready_at: float | None = None) -> None:
        super().__init__()
        self._inner, self._seq, self._gate = inner, seq, gate
        self._ready_at = ready_at  # time.monotonic() before which it is not done
        self._any_source = any_source  # keeps its Work: the sender is asked later
        self._future: Any = None
        self._done = False
        with _KEPT_LOCK:
            _LIVE.append(self)

    def wait(self, timeout: Any = datetime.timedelta(0)) -> bool:
        note("wait", self._seq)
        if self._done:
            return True
        if isinstance(timeout, datetime.timedelta) and timeout.total_seconds() > 0:
            done = self._inner.wait(timeout)
        else:
            done = self._inner.wait()
        sleep_until(self._ready_at)
        return done

    def get_future(self) -> Any:
        note("future", self._seq)
        if self._future is None:
            real = self._inner.get_future()
            future = real if self._gate is None else self._gate.then(
                lambda _: real.wait())
            self._future = delayed(future, self._ready_at)
        return self._future

    def is_completed(self) -> bool:
        return self._done or self._inner.is_completed()

    def is_success(self) -> bool:
        return self._done or self._inner.is_success()

    def exception(self) -> Any:
        return None if self._done else self._inner.exception()

    def source_rank(self) -> int:
        return self._inner.source_rank()

    def _source_rank(self) -> int:  # what dist.recv(src=None) asks
        return self._inner._source_rank()

    def result(self) -> Any:
        return self._inner.result()

    def synchronize(self) -> None:
        if not self._done:
            self._inner.synchronize()

    def release(self) -> None:
        """Drop the real Work if its collective has completed (outside any block)."""
        if not self._done and self._inner.is_completed() and (
                self._future is None or self._future.done()) and not self._any_source:
            self._done, self._inner = True, None


def sleep_until(moment: float | None) -> None:
    """Block until ``time.monotonic()`` reaches ``moment`` (None: return at once)."""
    if moment is not None:
        left = moment - time.monotonic()
        if left > 0:
            time.sleep(left)


def delayed(future: Any, moment: float | None) -> Any:
    """A future with ``future``'s value that completes no earlier than ``moment``
    (``future`` itself when ``moment`` is None)."""
    if moment is None:
        return future
    out = torch.futures.Future()

    def settle(done: Any) -> None:
        try:
            value = done.wait()
        except Exception as error:  # the collective failed: so does its future
            out.set_exception(error)
            return
        left = moment - time.monotonic()
        if left <= 0:
            out.set_result(value)
        else:
            timer = threading.Timer(left, out.set_result, (value,))
            timer.daemon = True
            timer.start()

    future.add_done_callback(settle)
    return out


def release_completed() -> None:
    """Let every completed :class:`RecordedWork` drop its real Work (and tensors)."""
    with _KEPT_LOCK:
        live = list(_LIVE)
    done = []
    for work in live:
        try:
            work.release()
        except Exception:  # a failed collective: keep it, its wait raises
            continue
        if work._done:
            done.append(work)
    with _KEPT_LOCK:
        gone = set(map(id, done))
        _LIVE[:] = [w for w in _LIVE if id(w) not in gone]
        _RELEASED.extend(done)


def _wrap_work(result: Any, rec: CommRecord, gate: Any,
               ready_at: float | None = None) -> Any:
    """Put a :class:`RecordedWork` where the operator returned its boxed Work."""
    if isinstance(result, torch.ScriptObject):
        try:
            inner = dist.Work.unbox(result)
        except Exception:  # not a Work
            return result
        return RecordedWork(inner, rec.seq, gate,
                            rec.op == "recv" and rec.peer is None, ready_at).boxed()
    if isinstance(result, tuple) and result and \
            isinstance(result[-1], torch.ScriptObject):
        return (*result[:-1], _wrap_work(result[-1], rec, gate, ready_at))
    return result


def make_mode(future_gate: Callable[[CommRecord], Any] | None = None,
              hold: Callable[[CommRecord], float | None] | None = None) -> Any:
    """The dispatch mode that records every collective of this thread.

    Args:
        future_gate: called with each process-group collective's record; a future it
            returns holds back that collective's ``get_future()`` until it completes.
        hold: called with each collective's record as it is issued; the
            ``time.monotonic()`` it returns is when that collective may complete:
            its waits and its future return no earlier (None: as soon as it is done).
    Returns:
        A ``TorchDispatchMode`` to enter for as long as the logs are open.
    """
    from torch.utils._python_dispatch import TorchDispatchMode

    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch < 2.4
        DTensor = ()  # noqa: N806
    # A functional collective's output -> its record, until its wait_tensor. Keyed by
    # id with a weak reference (a tensor's == is elementwise, so no WeakKeyDictionary).
    pending: dict[int, tuple[Any, int, float | None]] = {}

    class _CollectiveMode(TorchDispatchMode):
        """Sees dispatcher-level collectives (what CommDebugMode sees), with sizes."""

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN
            kwargs = kwargs or {}
            if DTensor and any(t is DTensor or (isinstance(t, type) and
                                                issubclass(t, DTensor)) for t in types):
                return NotImplemented  # let DTensor run; its collectives come back here
            namespace = getattr(func, "namespace", "")
            if namespace not in ("c10d", *_FUNCTIONAL_NAMESPACES):
                return func(*args, **kwargs)
            if func._overloadpacket.__name__.endswith("wait_tensor") and args:
                ref, seq, ready_at = pending.pop(id(args[0]), (None, -1, None))
                mine = ref is not None and ref() is args[0]
                if mine:
                    note("wait", seq)
                out = func(*args, **kwargs)
                if mine:
                    sleep_until(ready_at)
                return out
            rec = _record(func, args, kwargs) if depth() == 0 and active() else None
            with counted():
                result = func(*args, **kwargs)
            if rec is None:
                return result
            ready_at = hold(rec) if hold else None
            if namespace == "c10d":
                gate = future_gate(rec) if future_gate else None
                return _wrap_work(result, rec, gate, ready_at)
            for out in (result if isinstance(result, (list, tuple)) else [result]):
                if isinstance(out, torch.Tensor):
                    pending[id(out)] = (weakref.ref(out), rec.seq, ready_at)
            return result

    return _CollectiveMode()
