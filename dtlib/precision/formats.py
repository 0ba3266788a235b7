"""Floating-point formats and what autocast does with them.

Two questions the seed tutorial answers loosely: what a 16-bit (or 8-bit) float can
hold, and which dtype each operation runs in under ``torch.amp.autocast``. The format
table is derived from each format's definition (exponent and mantissa bits) and
cross-checked against ``torch.finfo`` and against bit patterns; the autocast table is
recorded, op by op, on the book's GPT on whatever device this process has.

Taught in: Chapter 7, "Floating-point formats" and "What autocast actually does".
"""

from __future__ import annotations

import warnings
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

#: (exponent bits, stored mantissa bits, has_inf) of every format the chapter tabulates.
#: TF32 has no torch dtype: it is a tensor-core *compute* format (fp32 range, fp16
#: mantissa) that fp32 matmuls may use on NVIDIA GPUs since Ampere.
FORMAT_BITS: dict[str, tuple[int, int, bool]] = {
    "fp32": (8, 23, True),
    "tf32": (8, 10, True),
    "bf16": (8, 7, True),
    "fp16": (5, 10, True),
    "fp8_e4m3": (4, 3, False),  # OCP "fn" variant: no inf, one NaN pattern, max 448
    "fp8_e5m2": (5, 2, True),
}

_DTYPES: dict[str, str] = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16",
                           "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
#: Integer dtypes of the same width, to read a format's bit patterns directly.
_SAME_WIDTH_INT = {32: torch.int32, 16: torch.int16, 8: torch.uint8}

#: Ops that PyTorch's autocast documentation lists for CUDA (a subset: those a GPT
#: uses). Source: https://docs.pytorch.org/docs/stable/amp.html , sections "CUDA Ops
#: that can autocast to float16" and "CUDA Ops that can autocast to float32".
CUDA_LOW_PRECISION_OPS = ("addmm", "baddbmm", "bmm", "linear", "matmul", "mm")
CUDA_FP32_OPS = ("cross_entropy", "exp", "layer_norm", "log", "log_softmax",
                 "nll_loss", "pow", "softmax", "sum")
#: The third list: ops that autocast runs in the widest dtype of their inputs (the
#: whole list of the same page's "CUDA Ops that promote to the widest input type",
#: and its CPU counterpart). Without autocast, several of them refuse mixed dtypes.
CUDA_PROMOTE_OPS = ("addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot",
                    "grid_sampler", "index_put", "scatter_add", "tensordot")
CPU_PROMOTE_OPS = ("cat", "index_copy", "stack")


def torch_dtype(name: str) -> torch.dtype | None:
    """The torch dtype of format ``name``, or None (tf32, or fp8 on an old torch).

    Taught in: Chapter 7, "Floating-point formats".
    """
    if name not in FORMAT_BITS:
        raise ValueError(f"format={name!r} is unknown; allowed: {tuple(FORMAT_BITS)}")
    attr = _DTYPES.get(name)
    return getattr(torch, attr, None) if attr else None


@dataclass(frozen=True)
class FormatInfo:
    """One floating-point format, derived from its bit layout.

    name: short name ("fp16", "bf16", ...).
    exponent_bits: bits of the biased exponent.
    mantissa_bits: stored fraction bits; the precision is ``mantissa_bits + 1``.
    bias: ``2**(exponent_bits - 1) - 1``.
    precision: p, significant bits including the implicit leading 1.
    eps: machine epsilon, the gap between 1 and the next float, ``2**-(p - 1)``.
    smallest_normal: ``2**(1 - bias)``.
    smallest_subnormal: ``2**(1 - bias - mantissa_bits)``, the smallest positive value.
    largest: the largest finite value.
    """

    name: str
    exponent_bits: int
    mantissa_bits: int
    bias: int
    precision: int
    eps: float
    smallest_normal: float
    smallest_subnormal: float
    largest: float


def format_info(name: str) -> FormatInfo:
    """Derive a format's constants from its definition (no ``torch.finfo``).

    Args:
        name: a key of :data:`FORMAT_BITS`.
    Returns:
        The :class:`FormatInfo`.

    Taught in: Chapter 7, "Floating-point formats".
    """
    if name not in FORMAT_BITS:
        raise ValueError(f"format={name!r} is unknown; allowed: {tuple(FORMAT_BITS)}")
    e, m, has_inf = FORMAT_BITS[name]
    bias = 2 ** (e - 1) - 1
    p = m + 1
    if has_inf:
        # IEEE: the all-ones exponent is reserved for inf/NaN, so emax = bias.
        largest = (2 - 2.0 ** -m) * 2.0 ** bias
    else:
        # e4m3fn: the all-ones exponent holds numbers too; only mantissa 111 is NaN.
        largest = (2 - 2.0 ** (1 - m)) * 2.0 ** (2 ** e - 1 - bias)
    return FormatInfo(name, e, m, bias, p, 2.0 ** -(p - 1), 2.0 ** (1 - bias),
                      2.0 ** (1 - bias - m), largest)


def subnormal_from_bits(dtype: torch.dtype) -> float:
    """The smallest positive value of ``dtype``: the bit pattern 0...01 as a float.

    Taught in: Chapter 7, "Floating-point formats".
    """
    bits = torch.finfo(dtype).bits
    if bits not in _SAME_WIDTH_INT:
        raise ValueError(f"dtype={dtype} has {bits} bits; allowed widths: 8, 16, 32")
    one = torch.ones(1, dtype=_SAME_WIDTH_INT[bits])
    return one.view(dtype).float().item()


def format_table(names: tuple[str, ...] | None = None) -> list[dict[str, Any]]:
    """One row per format: derived constants, ``torch.finfo``'s where a dtype exists.

    Args:
        names: formats to tabulate (default: all of :data:`FORMAT_BITS` this torch has,
            tf32 always, from its definition).
    Returns:
        Dicts with keys format, exponent_bits, mantissa_bits, precision, eps,
        smallest_normal, smallest_subnormal, largest, source.

    Taught in: Chapter 7, "Floating-point formats".
    """
    rows = []
    for name in names or tuple(FORMAT_BITS):
        info = format_info(name)
        dtype = torch_dtype(name)
        if dtype is None and name != "tf32":
            continue  # an fp8 format this torch does not have
        row = {"format": name, "exponent_bits": info.exponent_bits,
               "mantissa_bits": info.mantissa_bits, "precision": info.precision,
               "eps": info.eps, "smallest_normal": info.smallest_normal,
               "smallest_subnormal": info.smallest_subnormal, "largest": info.largest,
               "source": "definition"}
        if dtype is not None:
            fi = torch.finfo(dtype)
            row.update(eps=fi.eps, smallest_normal=fi.smallest_normal, largest=fi.max,
                       smallest_subnormal=subnormal_from_bits(dtype),
                       source="torch.finfo + bits")
        rows.append(row)
    return rows


def round_trip(values: list[float] | torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``values`` stored in ``dtype`` and read back as fp64: what the format keeps.

    Taught in: Chapter 7, "Floating-point formats".
    """
    return torch.as_tensor(values, dtype=torch.float64).to(dtype).double()


# ---------------------------------------------------------------- autocast inspection

class _DtypeRecorder(TorchDispatchMode):
    """Record (aten op, input float dtypes, output dtype) of every op that runs."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, tuple[str, ...], str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = tuple(_short(a.dtype) for a in args
                    if isinstance(a, torch.Tensor) and a.is_floating_point())
        first = out[0] if isinstance(out, (tuple, list)) and out else out
        if isinstance(first, torch.Tensor) and first.is_floating_point():
            self.calls.append((func.overloadpacket.__name__, ins, _short(first.dtype)))
        return out


def _short(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
            torch.float64: "fp64"}.get(dtype, str(dtype).replace("torch.", ""))


#: aten ops that only move or reshape data: left out of the op table.
_VIEW_OPS = frozenset({"view", "t", "transpose", "expand", "split", "detach", "alias",
                       "_unsafe_view", "clone", "permute", "slice", "select",
                       "unsqueeze", "squeeze", "reshape", "contiguous"})


def autocast_op_table(fn: Callable[[], Any], device_type: str,
                      dtype: torch.dtype = torch.bfloat16,
                      include_views: bool = False) -> list[dict[str, Any]]:
    """Run ``fn()`` under ``torch.amp.autocast(device_type, dtype)`` and tabulate ops.

    Args:
        fn: a closure running the forward pass (and loss) to inspect.
        device_type: ``world().device.type`` ("cpu", "cuda").
        dtype: the low-precision dtype autocast casts to.
        include_views: keep reshapes and views (default: only ops that compute).
    Returns:
        One dict per distinct (op, input dtypes, output dtype): keys op, inputs, output,
        count, in order of first appearance. ``_to_copy`` rows are autocast's casts.

    Taught in: Chapter 7, "What autocast actually does".
    """
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"dtype={dtype} must be torch.bfloat16 or torch.float16")
    rec = _DtypeRecorder()
    with torch.amp.autocast(device_type, dtype=dtype), rec:
        fn()
    counts = Counter(c for c in rec.calls if include_views or c[0] not in _VIEW_OPS)
    return [{"op": op, "inputs": ",".join(ins), "output": out, "count": n}
            for (op, ins, out), n in counts.items()]


def op_output_dtypes(table: list[dict[str, Any]]) -> dict[str, set[str]]:
    """Collapse an :func:`autocast_op_table` to ``{op: {output dtypes}}``.

    Taught in: Chapter 7, "What autocast actually does".
    """
    out: dict[str, set[str]] = {}
    for row in table:
        out.setdefault(row["op"], set()).add(row["output"])
    return out


def deprecated_amp_warnings() -> list[str]:
    """Call the deprecated ``torch.cuda.amp`` spellings; return the warnings they raise.

    The warnings are caught here, so a book build that turns warnings into errors
    stays clean. Returns an empty list on a torch that no longer has them.

    Taught in: Chapter 7, "What autocast actually does".
    """
    messages = []
    cuda_amp = getattr(torch.cuda, "amp", None)
    for name in ("autocast", "GradScaler"):
        ctor = getattr(cuda_amp, name, None)
        if ctor is None:
            continue
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                obj = ctor()
                if name == "autocast":
                    with obj:
                        pass
            except (FutureWarning, DeprecationWarning) as raised:
                # where deprecated calls are errors (the test suite's strict mode)
                # the warning arrives as an exception: it is what we came for
                text = str(raised).split(" (called from ")[0]
                messages.append(f"torch.cuda.amp.{name}: {text}")
        messages += [f"torch.cuda.amp.{name}: {w.message}" for w in caught
                     if issubclass(w.category, (FutureWarning, DeprecationWarning))]
    return messages


def widest_input_demo(device: torch.device | str,
                      dtype: torch.dtype = torch.bfloat16) -> dict[str, str]:
    """Run one op of the device's promote list on an fp32 and a 16-bit input, with
    and without autocast: ``index_copy`` on CPU, ``dot`` elsewhere.

    Args:
        device: where to run (``world().device``).
        dtype: the low-precision dtype of the second input and of autocast.
    Returns:
        ``{"op", "without autocast", "with autocast"}``: the output dtype, or the
        error's first line when the op refuses mixed dtypes.

    Taught in: Chapter 7, "What autocast actually does".
    """
    device = torch.device(device)
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"dtype={dtype} must be torch.bfloat16 or torch.float16")
    wide = torch.ones(4, device=device)
    narrow = torch.ones(4, device=device, dtype=dtype)
    if device.type == "cpu":
        name = "index_copy"
        index = torch.tensor([0], device=device)

        def op():
            return wide.index_copy(0, index, narrow[:1])
    else:
        name = "dot"

        def op():
            return torch.dot(wide, narrow)
    out = {"op": name}
    for label, enabled in (("without autocast", False), ("with autocast", True)):
        try:
            with torch.amp.autocast(device.type, dtype=dtype, enabled=enabled):
                out[label] = _short(op().dtype)
        except RuntimeError as err:
            out[label] = "error: " + str(err).splitlines()[0][:70]
    return out


def fp32_matmul_precision(mode: str | None = None) -> str:
    """Read (and with ``mode``, set) whether fp32 CUDA matmuls may use TF32.

    torch 2.9 added ``torch.backends.cuda.matmul.fp32_precision`` ("ieee": full
    fp32, "tf32": tensor cores, "none": follow the generic setting) and warns about
    the old ``allow_tf32`` flag, which it keeps only for compatibility; mixing the two
    raises. Older torch has only the flag, used here as the fallback.

    Args:
        mode: None (only read), "ieee", "tf32" or "none" (restore a saved "none";
            on torch < 2.9, the same as "ieee").
    Returns:
        The setting before any change: "ieee", "tf32" or "none".

    Taught in: Chapter 7, "Is 16-bit faster here?".
    """
    if mode not in (None, "ieee", "tf32", "none"):
        raise ValueError(f"mode={mode!r} must be None, 'ieee', 'tf32' or 'none'")
    matmul = torch.backends.cuda.matmul
    try:
        before = matmul.fp32_precision
    except AttributeError:  # torch < 2.9: only the old flag exists
        before = "tf32" if matmul.allow_tf32 else "ieee"
        if mode is not None:
            matmul.allow_tf32 = mode == "tf32"
        return before
    if mode is not None:
        matmul.fp32_precision = mode
    return before
