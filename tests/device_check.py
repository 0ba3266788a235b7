"""A GPU rank's device rules, checked on a CPU: which tensors would NCCL reject?

On a GPU node every rank's device is ``cuda:local_rank`` and a tensor made without
``device=`` lands on the CPU. gloo does not care, so CPU-only CI never sees the mistake;
NCCL rejects the tensor ("Tensors must be CUDA and dense"), and a compute op that mixes
it with a CUDA tensor raises "Expected all tensors to be on the same device".

This module replays those rules on a CPU rank, for real (gloo still carries the data and
the results stay exact):

1. The world's device is made ``meta`` (``dtlib.runtime.dist._device_for`` patched), so
   ``world().device`` differs from where a device-less tensor lands, exactly as
   ``cuda:i`` differs from ``cpu`` on a GPU node.
2. A ``TorchFunctionMode`` sees every torch call. A factory (``torch.zeros``,
   ``torch.tensor``, ``torch.empty`` ...) called without ``device=`` returns a tensor
   marked *host*; ``.cpu()`` / ``.to("cpu")`` / ``.numpy()``-born tensors too. Any
   ``device=meta`` (and ``.to(meta)``) is rewritten to a real CPU copy, unmarked: that
   tensor is "on the device". Marks follow the data: an op whose tensor inputs are all
   host returns host tensors; an op that mixes a host tensor of one or more dimensions
   with a device tensor is a violation (0-d host tensors mix freely, as CPU scalars do
   with CUDA tensors).
3. Every ``torch.distributed`` collective and point-to-point call (and
   ``batch_isend_irecv``'s operations) is wrapped: a host tensor among its arguments
   is a violation. Modules given to DDP must have their parameters on the device.

``x.device`` read by rank code (not by torch itself) answers ``meta`` for a device
tensor and ``cpu`` for a host one, so ``device=x.device`` follows its tensor and an
explicit ``device="cpu"`` makes a host tensor, as on a GPU node.

Limits, stated honestly: tensors made inside C++ (autograd's gradients, gloo's
buffers) are unmarked, i.e. assumed on the device; code that branches on
``device.type == "cuda"`` runs its CPU branch here.

Use :func:`checked` as a :func:`dtlib.runtime.launch.spawn` rank function, or
:func:`install` at the top of a script run under torchrun.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

MARK = "_dtlib_host"
FACTORIES = {"empty", "zeros", "ones", "full", "rand", "randn", "randint", "randperm",
             "arange", "linspace", "logspace", "eye", "tensor", "as_tensor",
             "from_numpy", "empty_strided", "scalar_tensor", "tril_indices",
             "triu_indices"}
#: Ops that move or index across devices legally on CUDA.
CROSS_OK = {"copy_", "_has_compatible_shallow_copy_type", "__getitem__", "__setitem__",
            "to", "cpu", "cuda", "__get__", "__set__", "index_put_", "index_put"}
COMMS = ("send", "recv", "isend", "irecv", "broadcast", "all_reduce", "reduce",
         "all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter",
         "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all",
         "all_to_all_single", "gather", "scatter")

violations: list[str] = []


def _where() -> str:
    """The first frame outside torch and this file: where rank code made the call."""
    for fr in reversed(traceback.extract_stack()[:-2]):
        f = fr.filename
        if f == __file__ or f"{os.sep}torch{os.sep}" in f or "overrides" in f:
            continue
        return f"{os.path.relpath(f) if not f.startswith('<') else f}:{fr.lineno}"
    return "?"


def _flag(what: str) -> None:
    entry = f"{what} at {_where()}"
    if entry not in violations:
        violations.append(entry)


def is_host(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and getattr(t, MARK, False)


def _mark(out: Any) -> None:
    for t in tree_flatten(out)[0]:
        if isinstance(t, torch.Tensor):
            try:
                setattr(t, MARK, True)
            except Exception:  # some C++-owned tensors refuse attributes
                pass


def _meta(d: Any) -> bool:
    return d is not None and torch.device(d).type == "meta"


class DeviceRules(TorchFunctionMode):
    """Marks host tensors and flags the mixes CUDA would reject (see module doc)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        name = getattr(func, "__name__", "")
        method = "Tensor" in getattr(func, "__qualname__", "")
        explicit = None  # "device", "host" or None (the inputs decide)
        if getattr(func, "__self__", None) is torch._C.TensorBase.device and args \
                and f"{os.sep}torch{os.sep}" not in sys._getframe(1).f_code.co_filename:
            # ``x.device`` read by rank code: meta for a device tensor, so that
            # ``device=x.device`` and ``x.device == world().device`` mean what they
            # would on a GPU node. torch's own code sees the real device.
            return torch.device("cpu") if is_host(args[0]) else torch.device("meta")
        # torch's own code (FSDP, DDP, optimizers) computes where its tensors go: an
        # explicit device from it is trusted; a device-less factory is host anywhere.
        internal = f"{os.sep}torch{os.sep}" in sys._getframe(1).f_code.co_filename
        if "device" in kwargs and kwargs["device"] is not None:
            explicit = "device" if internal or _meta(kwargs["device"]) else "host"
            if _meta(kwargs["device"]):
                kwargs["device"] = "cpu"
        if method and name == "to" and args:
            parsed = torch._C._nn._parse_to(*args[1:], **kwargs)
            device, dtype, non_blocking = parsed[:3]
            if device is not None:
                src = args[0]
                out = func(src, "cpu", dtype or src.dtype, non_blocking, copy=True)
                if device.type != "meta":
                    _mark(out)
                return out
        if method and name == "cpu" and args:
            if is_host(args[0]):
                return args[0]
            out = args[0].clone()
            _mark(out)
            return out
        if (not method and name in FACTORIES) and explicit is None:
            explicit = "host"
        out_host = False
        if explicit is None:
            tensors = [t for t in tree_flatten((args, kwargs))[0]
                       if isinstance(t, torch.Tensor)]
            big = [t for t in tensors if t.dim() > 0]
            if any(is_host(t) for t in big) and not all(is_host(t) for t in big) \
                    and name not in CROSS_OK and not internal:
                _flag(f"'{name}' mixes a host tensor with device tensors")
            judged = big or tensors
            out_host = bool(judged) and all(is_host(t) for t in judged)
        out = func(*args, **kwargs)
        if explicit == "host" or out_host:
            _mark(out)
        return out


def _check_args(op: str, args: tuple, kwargs: dict) -> None:
    for t in tree_flatten((args, kwargs))[0]:
        if is_host(t):
            _flag(f"dist.{op} got a tensor that is not on the rank's device")
            return


def _called_by_torch() -> bool:
    """Whether the collective was issued by torch itself (``all_gather_object``, DCP,
    FSDP), past this file and the accounting wrappers: torch picks those devices."""
    frame = sys._getframe(2)
    while frame is not None and (frame.f_code.co_filename == __file__ or
                                 frame.f_code.co_filename.endswith("accounting.py")):
        frame = frame.f_back
    return frame is not None and f"{os.sep}torch{os.sep}" in frame.f_code.co_filename


def _wrap(op: str, fn: Callable) -> Callable:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        # batch_isend_irecv (torch) issues the isend/irecv of the caller's tensors
        if op in ("isend", "irecv") or not _called_by_torch():
            _check_args(op, args, kwargs)
        return fn(*args, **kwargs)

    wrapper.__name__ = fn.__name__
    wrapper.__wrapped__ = fn
    return wrapper


def install(report: str | None = None) -> None:
    """Put this process under the device rules (call once, first thing in the rank).

    Args:
        report: a JSON file to write the violations to at exit (for torchrun scripts).
    """
    from torch.distributed import distributed_c10d as c10d
    from torch.nn.parallel import DistributedDataParallel as DDP

    from dtlib.runtime import dist as ddist

    ddist._device_for = lambda backend, local_rank: torch.device("meta")
    for op in COMMS:
        orig = getattr(c10d, op, None)
        if orig is None:
            continue
        wrapped = _wrap(op, orig)
        setattr(c10d, op, wrapped)  # batch_isend_irecv checks ops against these
        setattr(dist, op, wrapped)
    ddp_init = DDP.__init__

    def checked_ddp(self: Any, module: Any, *args: Any, **kwargs: Any) -> None:
        if any(is_host(p) for p in module.parameters()):
            _flag("DDP was given a module whose parameters are not on the device")
        ddp_init(self, module, *args, **kwargs)

    DDP.__init__ = checked_ddp
    # A mesh or autocast on the world's device type: meta here means the CPU.
    from torch.distributed import device_mesh

    mesh_init, amp_init = device_mesh.init_device_mesh, torch.autocast.__init__
    device_mesh.init_device_mesh = lambda device_type, *a, **k: mesh_init(
        "cpu" if device_type == "meta" else device_type, *a, **k)
    torch.autocast.__init__ = lambda self, device_type, *a, **k: amp_init(
        self, "cpu" if device_type == "meta" else device_type, *a, **k)
    new_param = torch.nn.Parameter.__new__

    def marked_param(cls: Any, data: Any = None, requires_grad: bool = True) -> Any:
        p = new_param(cls, data, requires_grad)
        if is_host(data):
            _mark(p)  # a parameter made from a host tensor lives on the host
        return p

    torch.nn.Parameter.__new__ = marked_param
    module_to = torch.nn.Module.to

    def moved(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = module_to(self, *args, **kwargs)
        device = torch._C._nn._parse_to(*args, **kwargs)[0]
        if device is not None:  # parameters keep their object: set their mark
            for t in [*self.parameters(), *self.buffers()]:
                if device.type == "meta" and is_host(t):
                    delattr(t, MARK)
                elif device.type != "meta":
                    _mark(t)
        return out

    torch.nn.Module.to = moved
    DeviceRules().__enter__()  # for the life of the process
    if report is not None:
        atexit.register(lambda: json.dump(violations, open(report, "w")))


def checked(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> dict[str, Any]:
    """Rank function for ``spawn``: run ``fn`` under the device rules.

    Returns:
        ``{"value": what fn returned, "violations": [...]}``.
    """
    install()
    value = fn(*args, **kwargs)
    return {"value": value, "violations": list(violations)}
