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
is counted): :func:`scaled_mm`. The layer itself, and :func:`swap_linears` that swaps
a model's ``nn.Linear`` layers (the head kept in higher precision by default), are in
:mod:`dtlib.precision.float8_linear`.

Taught in: Chapter 7, "FP8".
"""

from __future__ import annotations

import torch

from dtlib.precision.formats import format_info

__all__ = ["FP8_FORMATS", "SCALINGS", "MATMUL_PATHS", "fp8_dtype", "fp8_max",
           "amax", "choose_scale", "quantize", "dequantize", "AmaxHistory",
           "scaled_mm", "scaled_mm_support"]

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
