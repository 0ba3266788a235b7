"""Counting collectives below Python: functional collectives, DTensor, raw c10d ops.

These never call ``torch.distributed.X``: they go through the dispatcher
(``torch.ops._c10d_functional.*``, ``torch.ops.c10d.*``). A ``TorchDispatchMode`` sees
them there, as :class:`torch.distributed.tensor.debug.CommDebugMode` does; unlike
CommDebugMode it records sizes and group sizes into the active :func:`count_comms` logs.
Used by :mod:`dtlib.collectives.accounting` (``count_comms(functional=True)``).

Taught in: Chapter 2, "Counting communication".
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from dtlib.collectives.comm_log import (active, counted, depth, first_tensor, numel_of,
                                        record)

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
    "recv_": "recv", "barrier": "barrier",
}


def _functional_group_size(args: tuple, kwargs: dict) -> int:
    if "group_size" in kwargs:
        return int(kwargs["group_size"])
    for a in (*args, *kwargs.values()):
        if isinstance(a, str):  # a group name: resolve it
            try:
                return c10d._resolve_process_group(a).size()
            except Exception:
                continue
    ints = [a for a in args[1:] if isinstance(a, int) and not isinstance(a, bool)]
    return ints[-1] if ints else -1


def _c10d_group_size(args: tuple) -> int:
    for a in args:
        if isinstance(a, torch.ScriptObject):  # the boxed ProcessGroup
            try:
                return int(dist.ProcessGroup.unbox(a).size())
            except Exception:
                continue
        if isinstance(a, dist.ProcessGroup):
            return int(a.size())
    return -1


def _group_ranks(args: tuple, kwargs: dict) -> tuple[int, ...]:
    """Global ranks of the group a dispatcher-level collective names (or ())."""
    for a in (*args, *kwargs.values()):
        try:
            if isinstance(a, str):
                group = c10d._resolve_process_group(a)
            elif isinstance(a, torch.ScriptObject):
                group = dist.ProcessGroup.unbox(a)
            elif isinstance(a, dist.ProcessGroup):
                group = a
            else:
                continue
            return tuple(dist.get_process_group_ranks(group))
        except Exception:
            continue
    return ()


def _dispatch_record(func: Any, args: tuple, kwargs: dict) -> None:
    namespace = getattr(func, "namespace", "")
    name = func._overloadpacket.__name__.split(".")[-1]
    if namespace in ("_c10d_functional", "c10d_functional",
                     "_c10d_functional_autograd") and name in _FUNCTIONAL_OPS:
        op = _FUNCTIONAL_OPS[name]
        group_size = _functional_group_size(args, kwargs)
        numel = numel_of(args[0])
        if op == "all_gather" and group_size > 0:
            numel *= group_size  # the input is one shard; the message is the output
        source = "functional"
    elif namespace == "c10d" and name in _C10D_OPS:
        op = _C10D_OPS[name]
        group_size = _c10d_group_size(args)
        # all_gather: the outputs come first; reduce_scatter: the inputs come second.
        msg = args[1] if op == "reduce_scatter" and len(args) > 1 else args[0]
        numel = numel_of(msg) if op != "barrier" else 0
        if op in ("gather", "scatter") and group_size > 0:
            numel = numel_of(args[1] if op == "gather" else args[0]) * group_size
        source = "c10d"
    else:
        return
    first = first_tensor(args[0])
    record(op, numel, first.element_size() if first is not None else 0, group_size,
           source, _group_ranks(args, kwargs))


def make_mode() -> Any:
    """A dispatch mode that records functional and raw c10d collectives with sizes."""
    from torch.utils._python_dispatch import TorchDispatchMode

    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch < 2.4
        DTensor = ()  # noqa: N806

    class _CollectiveMode(TorchDispatchMode):
        """Sees dispatcher-level collectives (what CommDebugMode sees), with sizes."""

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN
            kwargs = kwargs or {}
            if DTensor and any(t is DTensor or (isinstance(t, type) and
                                                issubclass(t, DTensor)) for t in types):
                return NotImplemented  # let DTensor run; its collectives come back here
            if depth() == 0 and active():
                _dispatch_record(func, args, kwargs)
            with counted():
                return func(*args, **kwargs)

    return _CollectiveMode()
