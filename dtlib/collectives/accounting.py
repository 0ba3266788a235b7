"""Communication accounting: which collectives a block of code issues, how many bytes.

Every later chapter asks "how much did this step send?"; :func:`count_comms` answers::

    with count_comms() as log:
        loss.backward(); opt.step()
    log.summary()   # [{"op": "all_reduce", "calls": 3, "bytes": 123456}, ...]

How the collectives are seen, and why this way (Chapter 2, "Counting communication"):

1. **Python API** (``source="torch.distributed"``). While a block is active, the public
   collectives in both ``torch.distributed`` and ``torch.distributed.distributed_c10d``
   are replaced by thin recording wrappers and restored on exit (nest-safe: the patch
   stays installed while any block is open). Code that calls ``dist.X`` at call time is
   seen, and that includes torch's own FSDP2 (``fully_shard``): its
   ``_fsdp_collectives.py`` calls ``dist.all_gather_single`` /
   ``dist.reduce_scatter_single`` (in torch 2.13, which deprecates the old names;
   ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` before) through the
   ``torch.distributed`` module, so the patch sees them with their logical sizes.
   Wrappers that call other wrappers (``all_gather_into_tensor`` ->
   ``all_gather_single``) are counted once: only the outermost call of a thread
   records.
2. **Functional collectives and DTensor** (``source="functional"``). These never touch
   ``dist.*``: they call the dispatcher ops ``torch.ops._c10d_functional.*``. torch's
   :class:`torch.distributed.tensor.debug.CommDebugMode` sees them with a
   ``TorchDispatchMode``, but it records only *counts* per op, no sizes and no group
   size, and it does not see DDP. So we use the same mechanism (a small dispatch mode,
   returning ``NotImplemented`` for DTensor arguments exactly as CommDebugMode does, so
   that DTensor's own redistribution collectives come back to us as plain tensors), and
   record bytes. Raw ``torch.ops.c10d.*`` calls not made through a patched function are
   recorded too (``source="c10d"``).
3. **DDP** (``source="ddp_hook"``). DDP's C++ reducer calls the process group directly,
   bypassing Python. Its documented interception point is a comm hook:
   :func:`ddp_comm_hook_accounting` registers one that records each gradient bucket and
   then runs torch's default all-reduce hook (same averaging, same result). (On recent
   torch, e.g. 2.13, the reducer's call also passes the dispatcher, so the dispatch mode
   sees it as ``source="c10d"`` even without the hook; on older torch it does not. With
   the hook it is recorded once, as ``"ddp_hook"``, on every version.)

Message sizes follow torch / nccl-tests: all_reduce, broadcast, reduce, send, recv: the
tensor; all_gather and gather: the gathered (output) tensor; reduce_scatter and scatter:
the full unreduced (input) tensor; all_to_all: the input.

Taught in: Chapter 2, "Counting communication"; used by Chapters 3 (DDP) and 4 (ZeRO).
"""

from __future__ import annotations

import functools
import inspect
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from dtlib.collectives.accounting_dispatch import make_mode
from dtlib.collectives.comm_log import (ACTIVE_LOGS, LOCK, OPS, CommLog, CommRecord,
                                        counted, depth, first_tensor, numel_of, record)

# The records' types and the ops are re-exported: a reader who counts imports from here.
__all__ = ["OPS", "CommLog", "CommRecord", "count_comms", "ddp_comm_hook_accounting",
           "record"]


# ---- shared state: active logs, patch depth, the per-thread "already counted" flag

_SAVED: dict[tuple[Any, str], Callable[..., Any]] = {}


def _group_ranks(group: Any) -> tuple[int, ...]:
    try:
        return tuple(dist.get_process_group_ranks(group or dist.group.WORLD))
    except Exception:  # not initialised or not a member
        return ()


def _group_size(group: Any) -> int:
    try:
        return dist.get_world_size(group)
    except Exception:  # not initialised or not a member: still worth recording
        return -1


# name -> (canonical op, which argument holds the message, multiply by group size?)
_PY_OPS: dict[str, tuple[str, str, bool]] = {
    "all_reduce": ("all_reduce", "tensor", False),
    "all_reduce_coalesced": ("all_reduce", "tensors", False),
    "broadcast": ("broadcast", "tensor", False),
    "reduce": ("reduce", "tensor", False),
    "all_gather": ("all_gather", "tensor_list", False),
    "all_gather_single": ("all_gather", "output_tensor", False),
    "all_gather_into_tensor": ("all_gather", "output_tensor", False),
    "all_gather_coalesced": ("all_gather", "output_tensor_lists", False),
    "reduce_scatter": ("reduce_scatter", "input_list", False),
    "reduce_scatter_single": ("reduce_scatter", "input", False),
    "reduce_scatter_tensor": ("reduce_scatter", "input", False),
    "gather": ("gather", "tensor", True),
    "scatter": ("scatter", "tensor", True),
    "all_to_all": ("all_to_all", "input_tensor_list", False),
    "all_to_all_single": ("all_to_all", "input", False),
    "send": ("send", "tensor", False),
    "isend": ("send", "tensor", False),
    "recv": ("recv", "tensor", False),
    "irecv": ("recv", "tensor", False),
    "barrier": ("barrier", "", False),
}


def _wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    op, arg, times_group = _PY_OPS[name]
    sig = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if depth() > 0 or not ACTIVE_LOGS:
            return fn(*args, **kwargs)
        try:
            bound = sig.bind(*args, **kwargs).arguments
        except TypeError:
            return fn(*args, **kwargs)  # let torch raise its own error
        msg = bound.get(arg)
        group_size = _group_size(bound.get("group"))
        numel = numel_of(msg) * (group_size if times_group else 1)
        first = first_tensor(msg)
        record(op, numel, first.element_size() if first is not None else 0,
               group_size, "torch.distributed", _group_ranks(bound.get("group")))
        with counted():
            return fn(*args, **kwargs)

    wrapper.__dtlib_accounting__ = True  # type: ignore[attr-defined]
    return wrapper


def _install() -> None:
    # One wrapper per function: torch.distributed.isend and distributed_c10d.isend
    # must stay the same object, or P2POp's identity check rejects the op (it
    # compares with distributed_c10d's own isend/irecv; pipelining passes dist.isend).
    wrappers: dict[int, Callable[..., Any]] = {}
    for module in (dist, c10d):
        for name in _PY_OPS:
            fn = getattr(module, name, None)
            if fn is None or getattr(fn, "__dtlib_accounting__", False):
                continue
            _SAVED[(module, name)] = fn
            if id(fn) not in wrappers:
                wrappers[id(fn)] = _wrap(name, fn)
            setattr(module, name, wrappers[id(fn)])


def _uninstall() -> None:
    for (module, name), fn in _SAVED.items():
        setattr(module, name, fn)
    _SAVED.clear()


@contextmanager
def count_comms(functional: bool = True) -> Iterator[CommLog]:
    """Record every collective this process issues inside the block.

    Args:
        functional: also watch dispatcher-level collectives (functional collectives,
            DTensor, raw ``torch.ops.c10d``) with a dispatch mode. Leave it on unless
            the block is timed: the mode adds a Python call to every tensor op.
    Returns:
        A :class:`CommLog` filled as the block runs. Blocks nest: an inner block's
        collectives are in the outer log too. For DDP, see
        :func:`ddp_comm_hook_accounting`.

    Taught in: Chapter 2, "Counting communication".
    """
    log = CommLog()
    with LOCK:
        if not ACTIVE_LOGS:
            _install()
        ACTIVE_LOGS.append(log)
    if functional:

        mode = make_mode()
    else:
        mode = None
    try:
        if mode is not None:
            with mode:
                yield log
        else:
            yield log
    finally:
        with LOCK:
            ACTIVE_LOGS.remove(log)
            if not ACTIVE_LOGS:
                _uninstall()


def ddp_comm_hook_accounting(ddp_model: Any, process_group: Any = None) -> None:
    """Make a DDP model's gradient all-reduces visible to :func:`count_comms`.

    DDP's C++ reducer all-reduces each gradient bucket without going through Python, so
    no patch can see it. A communication hook is torch's documented way in: this one
    records ``all_reduce`` of the bucket's flat buffer (``source="ddp_hook"``), then
    runs
    torch's default ``allreduce_hook`` (divide by world size, all-reduce, same result as
    no hook). Register it once, before the first backward; outside a
    :func:`count_comms` block it only forwards.

    Args:
        ddp_model: a ``torch.nn.parallel.DistributedDataParallel`` module.
        process_group: the group DDP reduces over (default: its own / the world).
    Returns:
        None.

    Taught in: Chapter 2, "Counting communication"; used in Chapter 3 (DDP).
    """
    from torch.nn.parallel import DistributedDataParallel
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    if not isinstance(ddp_model, DistributedDataParallel):
        raise ValueError(f"ddp_model={type(ddp_model).__name__} is not "
                         "DistributedDataParallel; wrap the model in DDP first")
    group = process_group if process_group is not None else getattr(
        ddp_model, "process_group", None)

    # No annotations: DDP checks them (and a string annotation from
    # ``from __future__ import annotations`` would not be dist.GradBucket).
    def hook(state, bucket):  # noqa: ANN001, ANN202
        buf = bucket.buffer()
        if ACTIVE_LOGS:
            record("all_reduce", buf.numel(), buf.element_size(), _group_size(state),
                   "ddp_hook")
        with counted():  # the default hook calls dist.all_reduce: do not count twice
            return default_hooks.allreduce_hook(state, bucket)

    ddp_model.register_comm_hook(group, hook)
