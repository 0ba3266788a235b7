"""FP8 training from scratch: E4M3/E5M2 quantisers, three scalings, a Float8Linear.

An 8-bit float holds too little range for a raw tensor, so every cast carries a scale
{cite:p}`micikevicius2022fp8`: ``q = cast(clamp(x * s, -max, max))`` and
``x ~ q / s``. The scale maps the tensor's largest magnitude (amax) onto the format's
largest value, ``s = max / amax``. Three ways to choose amax:

- ``"tensor"``: current scaling, one amax for the whole tensor, of this step;
- ``"row"``: one amax per row of the operand (per token of an activation, per output
  feature of a weight), so one outlier row does not squash the others;
- ``"delayed"``: the largest amax of the last ``history`` steps (Transformer Engine's
  default recipe): the cast needs no reduction over the tensor first, but a tensor
  larger than its history saturates at ``max``.

:class:`Float8Linear` is a drop-in ``nn.Linear`` whose forward casts input and
weight to E4M3 and whose backward casts the output gradient to E5M2 (wider range,
less precision), the "hybrid" recipe. Its three GEMMs run as torch runs them,
``torch._scaled_mm(a_fp8, b_fp8, scale_a, scale_b, out_dtype)``, where that exists
and accepts the operands, else by dequantising to fp32 and multiplying (which path ran
is counted). :func:`swap_linears` swaps a model's ``nn.Linear`` layers, the head kept
in higher precision by default.

Taught in: Chapter 7, "FP8".
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable

import torch
import torch.nn as nn

from dtlib.precision.formats import format_info

__all__ = ["FP8_FORMATS", "SCALINGS", "MATMUL_PATHS", "fp8_dtype", "fp8_max",
           "amax", "choose_scale", "quantize", "dequantize", "AmaxHistory",
           "scaled_mm", "scaled_mm_support", "Float8LinearFunction",
           "Float8Linear",
           "swap_linears", "keep_head"]

#: The two formats, as chapter 7's format table names them.
FP8_FORMATS = ("fp8_e4m3", "fp8_e5m2")
SCALINGS = ("tensor", "row", "delayed")
#: How a GEMM may run: ``"auto"`` tries ``torch._scaled_mm`` and falls back.
MATMUL_PATHS = ("auto", "scaled_mm", "dequantized")
#: amax below this is treated as this (an all-zero tensor gets a finite scale).
AMAX_EPS = 1e-12


def fp8_dtype(fmt: str) -> torch.dtype:
    """The torch dtype of ``fmt`` (``"fp8_e4m3"``: ``float8_e4m3fn``, or
    ``"fp8_e5m2"``); a clear error on a torch without fp8 dtypes."""
    if fmt not in FP8_FORMATS:
        raise ValueError(f"fmt={fmt!r} must be one of {FP8_FORMATS}")
    name = {"fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}[fmt]
    if not hasattr(torch, name):
        raise ValueError(f"fmt={fmt!r}: this torch ({torch.__version__}) has no "
                         f"torch.{name}")
    return getattr(torch, name)


def fp8_max(fmt: str) -> float:
    """The largest finite value of ``fmt``, from its bit layout (448, 57344)."""
    if fmt not in _MAX:
        raise ValueError(f"fmt={fmt!r} must be one of {FP8_FORMATS}")
    return _MAX[fmt]


_MAX = {fmt: format_info(fmt).largest for fmt in FP8_FORMATS}


def amax(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Largest magnitude of ``x`` (fp32): over all of it (``dim=None``, a scalar), or
    along ``dim`` with the dimension kept (one value per row for ``dim=-1``)."""
    a = x.detach().abs().float()
    return a.amax() if dim is None else a.amax(dim=dim, keepdim=True)


def choose_scale(amax_: torch.Tensor, fmt: str) -> torch.Tensor:
    """The scale that maps ``amax_`` onto ``fmt``'s largest value: ``max / amax``.

    Args:
        amax_: a tensor of amaxes (any shape; one per scaled block).
        fmt: ``"fp8_e4m3"`` or ``"fp8_e5m2"``.
    Returns:
        fp32 scales of ``amax_``'s shape (``q = x * scale``, ``x ~ q / scale``).

    Taught in: Chapter 7, "FP8".
    """
    return fp8_max(fmt) / amax_.float().clamp(min=AMAX_EPS)


def quantize(x: torch.Tensor, fmt: str, scale: torch.Tensor) -> torch.Tensor:
    """``x * scale``, saturated at ``+-max`` and rounded to ``fmt`` (nearest even).

    The clamp is the saturating cast of the FP8 paper: a value past the format's
    range becomes ``+-max``, never inf (a plain ``.to(float8_e5m2)`` overflows to
    inf, ``.to(float8_e4m3fn)`` has no inf at all).

    Taught in: Chapter 7, "FP8".
    """
    m = fp8_max(fmt)
    return (x.float() * scale).clamp(-m, m).to(fp8_dtype(fmt))


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The fp32 value a quantised tensor stands for: ``q / scale``."""
    return q.float() / scale


class AmaxHistory:
    """Delayed scaling's state for one tensor: the amaxes of the last ``history``
    steps; the scale of a step comes from the largest of them.

    Args:
        history: how many past amaxes to keep (the window), >= 1.

    ``scale(fmt, current)`` uses the window as it stands, and only when it is empty
    (the first step) this step's amax; ``record(current)`` then appends this step's
    amax, dropping the oldest beyond the window (Transformer Engine's "max" amax
    algorithm; the first-step rule is ours, so that step 0 is not cast with scale 1).

    Taught in: Chapter 7, "FP8".
    """

    def __init__(self, history: int = 16) -> None:
        if isinstance(history, bool) or not isinstance(history, int) or history < 1:
            raise ValueError(f"history={history!r} must be a positive integer")
        self.history = history
        self._buf: torch.Tensor | None = None  # a ring of the last `history` amaxes
        self.steps = 0

    @property
    def amaxes(self) -> torch.Tensor:
        """The amaxes in the window (oldest first), fp32."""
        if self._buf is None:
            return torch.zeros(0)
        n = min(self.steps, self.history)
        return self._buf.roll(-(self.steps % self.history))[-n:] \
            if self.steps > self.history else self._buf[:n]

    def scale(self, fmt: str, current: torch.Tensor) -> torch.Tensor:
        """The scale for this step (from the past window, else from ``current``)."""
        if self._buf is None:
            return choose_scale(current, fmt)
        return choose_scale(self._buf[:min(self.steps, self.history)].amax(), fmt)

    def record(self, current: torch.Tensor) -> None:
        """Append this step's amax; keep the last ``history``."""
        if self._buf is None:
            self._buf = torch.zeros(self.history, device=current.device)
        self._buf[self.steps % self.history] = current.detach().float()
        self.steps += 1


def scaled_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor,
              scale_b: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16,
              path: str = "auto") -> tuple[torch.Tensor, str]:
    """``(a / scale_a) @ (b / scale_b)`` for fp8 ``a`` (M, K) and ``b`` (K, N).

    ``scale_a`` is a scalar or (M, 1), ``scale_b`` a scalar or (1, N): scales along
    the dimensions the product keeps, so they factor out of the sum over K.

    Args:
        path: ``"scaled_mm"`` (``torch._scaled_mm``, which takes the inverse scales
            and ``b`` column-major), ``"dequantized"`` (fp32 values, an fp32 matmul,
            rounded to ``out_dtype``: the reference) or ``"auto"`` (the first, and
            the second where ``_scaled_mm`` is missing or refuses these operands).
    Returns:
        ``(product in out_dtype, the path that ran)``.

    Taught in: Chapter 7, "FP8".
    """
    if path not in MATMUL_PATHS:
        raise ValueError(f"path={path!r} must be one of {MATMUL_PATHS}")
    if path != "dequantized" and hasattr(torch, "_scaled_mm"):
        inv_a, inv_b = scale_a.float().reciprocal(), scale_b.float().reciprocal()
        inv_a = inv_a.reshape(-1, 1) if inv_a.dim() else inv_a
        inv_b = inv_b.reshape(1, -1) if inv_b.dim() else inv_b
        try:
            out = torch._scaled_mm(a.contiguous(), b.t().contiguous().t(),
                                   scale_a=inv_a, scale_b=inv_b, out_dtype=out_dtype)
            return out, "scaled_mm"
        except (RuntimeError, TypeError, NotImplementedError):
            if path == "scaled_mm":
                raise
    elif path == "scaled_mm":
        raise ValueError(f"path='scaled_mm': torch {torch.__version__} has no "
                         "torch._scaled_mm")
    out = dequantize(a, scale_a) @ dequantize(b, scale_b)
    return out.to(out_dtype), "dequantized"


def scaled_mm_support(device: torch.device | str = "cpu") -> dict[str, str]:
    """Which fp8 operand pairs ``torch._scaled_mm`` accepts on ``device``.

    Returns:
        ``{"e4m3 x e4m3": "ok" or the error's first line, ...}`` for the three
        pairs Float8Linear's GEMMs use or could use, with per-tensor and per-row
        scales of shapes (16, 32) x (32, 16).

    Taught in: Chapter 7, "FP8".
    """
    device = torch.device(device)
    out: dict[str, str] = {}
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(16, 32, generator=gen).to(device)
    b = torch.randn(32, 16, generator=gen).to(device)
    for fa, fb in (("fp8_e4m3", "fp8_e4m3"), ("fp8_e5m2", "fp8_e4m3"),
                   ("fp8_e5m2", "fp8_e5m2")):
        for scaling, sa, sb in (("tensor", amax(a), amax(b)),
                                ("row", amax(a, -1), amax(b, 0))):
            key = f"{fa[4:]} x {fb[4:]}, per-{scaling}"
            qa = quantize(a, fa, choose_scale(sa, fa))
            qb = quantize(b, fb, choose_scale(sb, fb))
            try:
                scaled_mm(qa, qb, choose_scale(sa, fa), choose_scale(sb, fb),
                          path="scaled_mm")
                out[key] = "ok"
            except (RuntimeError, TypeError, ValueError, NotImplementedError) as e:
                out[key] = str(e).strip().splitlines()[0][:80]
    return out


class _Recipe:
    """One Float8Linear's scaling state: the scaling, its histories, path counts."""

    def __init__(self, scaling: str, history: int, path: str) -> None:
        if scaling not in SCALINGS:
            raise ValueError(f"scaling={scaling!r} must be one of {SCALINGS}")
        if path not in MATMUL_PATHS:
            raise ValueError(f"path={path!r} must be one of {MATMUL_PATHS}")
        self.scaling, self.path = scaling, path
        self.histories = {k: AmaxHistory(history) for k in ("x", "w", "grad")}
        self.paths: Counter[str] = Counter()

    def scale(self, t: torch.Tensor, fmt: str, role: str, dim: int = -1
              ) -> torch.Tensor:
        """The scale of operand ``t`` (role x, w or grad); ``dim``: the dimension
        the GEMM sums over, along which a per-row amax is taken."""
        if self.scaling == "row":
            return choose_scale(amax(t, dim), fmt)
        current = amax(t)
        if self.scaling == "tensor":
            return choose_scale(current, fmt)
        hist = self.histories[role]
        s = hist.scale(fmt, current)
        hist.record(current)
        return s

    def mm(self, qa: torch.Tensor, sa: torch.Tensor, qb: torch.Tensor,
           sb: torch.Tensor) -> torch.Tensor:
        """One GEMM of quantised operands; counts the path that ran."""
        out, ran = scaled_mm(qa, qb, sa, sb, path=self.path)
        self.paths[ran] += 1
        return out


class Float8LinearFunction(torch.autograd.Function):
    """forward: ``x @ w.T`` with x, w in E4M3; backward: the output gradient in E5M2,
    ``grad_x = g @ w`` and ``grad_w = g.T @ x`` (w, x in E4M3 again)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor,
                recipe: _Recipe) -> torch.Tensor:
        e4 = "fp8_e4m3"
        sx, sw = recipe.scale(x, e4, "x"), recipe.scale(w, e4, "w")  # (M|N, 1) or ()
        qx, qw = quantize(x, e4, sx), quantize(w, e4, sw)
        y = recipe.mm(qx, sx, qw.t(), sw.t())
        if recipe.scaling == "row":  # backward scales along the other axis
            ctx.save_for_backward(x, w)
        else:  # one scale per tensor: backward reuses the fp8 copies (1 byte each)
            ctx.save_for_backward(qx, qw, sx, sw)
        ctx.recipe, ctx.dtypes = recipe, (x.dtype, w.dtype)
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        r, (x_dtype, w_dtype) = ctx.recipe, ctx.dtypes
        e4, e5 = "fp8_e4m3", "fp8_e5m2"
        sg = r.scale(g, e5, "grad")  # per row of g for grad_x's GEMM
        qg = quantize(g, e5, sg)
        if r.scaling == "row":
            x, w = ctx.saved_tensors
            # grad_x (M, K) = g (M, N) @ w (N, K): w per column.
            sw = choose_scale(amax(w, 0), e4)
            grad_x = r.mm(qg, sg, quantize(w, e4, sw), sw)
            # grad_w (N, K) = g.T (N, M) @ x (M, K): g and x per column.
            sg_t = choose_scale(amax(g, 0), e5).t()
            sx = choose_scale(amax(x, 0), e4)
            grad_w = r.mm(quantize(g.t(), e5, sg_t), sg_t, quantize(x, e4, sx), sx)
        else:
            qx, qw, sx, sw = ctx.saved_tensors
            grad_x = r.mm(qg, sg, qw, sw)
            grad_w = r.mm(qg.t(), sg, qx, sx)
        return grad_x.to(x_dtype), grad_w.to(w_dtype), None


class Float8Linear(nn.Linear):
    """``nn.Linear`` whose three GEMMs run in FP8 (inputs and weight E4M3, the output
    gradient E5M2); the weight, bias and optimizer state stay in their own dtype.

    Args:
        in_features, out_features, bias: as ``nn.Linear``.
        scaling: ``"tensor"``, ``"row"`` or ``"delayed"`` (see the module).
        history: delayed scaling's window (steps of amax kept).
        path: ``"auto"``, ``"scaled_mm"`` or ``"dequantized"`` (:func:`scaled_mm`).

    ``self.recipe.paths`` counts the GEMMs each path ran. The bias is added in the
    input's dtype after the GEMM (its output is bf16, as ``_scaled_mm`` gives it).

    Taught in: Chapter 7, "FP8".
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 scaling: str = "tensor", history: int = 16, path: str = "auto",
                 device: Any = None, dtype: Any = None) -> None:
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.recipe = _Recipe(scaling, history, path)

    @classmethod
    def from_linear(cls, linear: nn.Linear, **kwargs: Any) -> "Float8Linear":
        """A Float8Linear sharing ``linear``'s parameters (tied weights stay tied)."""
        new = cls(linear.in_features, linear.out_features, bias=False,
                  device="meta", **kwargs)
        new.weight = linear.weight
        new.bias = linear.bias
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = Float8LinearFunction.apply(x.reshape(-1, x.size(-1)), self.weight,
                                       self.recipe)
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, scaling={self.recipe.scaling}"


def keep_head(name: str, module: nn.Linear) -> bool:
    """The default filter of :func:`swap_linears`: every Linear but the head.

    The head's GEMM makes the logits that softmax exponentiates and cross-entropy
    differentiates; an E4M3 logit is off by up to 1/16 of itself, i.e. a factor
    ``e^(logit/16)`` in a probability; its weight is tied to the embedding; and it
    is one GEMM of many, so keeping it buys accuracy for little time (torchtitan's
    float8 converter filters the output layer out; DeepSeek-V3 keeps embedding,
    head and MoE router in bf16/fp32).
    """
    return name.split(".")[-1] != "head"


def swap_linears(model: nn.Module,
                 filter_fn: Callable[[str, nn.Linear], bool] = keep_head,
                 **kwargs: Any) -> list[str]:
    """Replace every ``nn.Linear`` of ``model`` for which ``filter_fn(name, module)``
    is true by a :class:`Float8Linear` sharing its parameters (in place).

    Args:
        filter_fn: which layers to swap (default :func:`keep_head`).
        kwargs: Float8Linear's ``scaling``, ``history``, ``path``.
    Returns:
        The names of the swapped layers.

    Taught in: Chapter 7, "FP8".
    """
    swapped = []
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if type(child) is nn.Linear and filter_fn(full, child):
                setattr(module, child_name, Float8Linear.from_linear(child, **kwargs))
                swapped.append(full)
    return swapped
