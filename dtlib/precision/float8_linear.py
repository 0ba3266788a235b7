"""Float8Linear: an ``nn.Linear`` whose three GEMMs run in FP8, and the swap that puts
it into a model.

Forward casts the input and the weight to E4M3, backward casts the output gradient to
E5M2 ("hybrid"); each GEMM goes through :func:`dtlib.precision.fp8.scaled_mm`
(``torch._scaled_mm`` or the dequantised fallback) with the scales of the layer's
recipe: per tensor, per row, or delayed (an amax history per operand).

Taught in: Chapter 7, "FP8".
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable

import torch
import torch.nn as nn

from dtlib.models.gpt import GPTConfig, build_gpt
from dtlib.precision.fp8 import (MATMUL_PATHS, SCALINGS, AmaxHistory, amax,
                                 choose_scale, quantize, scaled_mm)

__all__ = ["Float8LinearFunction", "Float8Linear", "keep_head", "swap_linears",
           "fsdp_allgather_bytes"]


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
    differentiates; with E4M3 operands (each within 1/16 of itself) a logit moves
    by a comparable fraction, a factor of about ``e^(logit/16)`` in a probability;
    its weight is tied to the embedding; and it is one GEMM of many, so keeping it
    buys accuracy for little time (torchao's example filter leaves the last layer
    unconverted; DeepSeek-V3 keeps embedding, head and MoE gating in bf16/fp32).

    Taught in: Chapter 7, "FP8".
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


def fsdp_allgather_bytes(cfg: GPTConfig, world_size: int) -> dict[str, float]:
    """Bytes one rank receives per all-gather of the whole model under FSDP2, with
    bf16 parameters, and with the Float8Linear weights gathered in fp8 (torchao's
    ``enable_fsdp_float8_all_gather``: one byte per element; biases, embeddings, norms
    and the head stay bf16). The scales travel apart: one all-reduce of every fp8
    weight's amax, one fp32 each (torchao's
    ``precompute_float8_dynamic_scale_for_fsdp``).

    Counted from the model itself: ``build_gpt(cfg)`` with the default swap filter.

    Returns:
        ``{"params", "fp8_params", "bf16_bytes", "fp8_bytes", "saved_fraction",
        "amax_bytes"}`` (bytes received per rank per gather: ``(N - 1) / N`` of the
        model; ``amax_bytes``: the amax all-reduce's payload).

    Taught in: Chapter 7, "FP8".
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) \
            or world_size < 2:
        raise ValueError(f"world_size={world_size!r} must be an integer >= 2")
    model = build_gpt(cfg)  # a CPU copy: a meta build would import the compiler
    swapped = swap_linears(model)
    fp8_weights = [model.get_submodule(name).weight for name in swapped]
    params = sum(p.numel() for p in model.parameters())
    fp8_params = sum(w.numel() for w in fp8_weights)
    share = (world_size - 1) / world_size
    bf16_bytes = share * 2 * params
    fp8_bytes = share * (2 * (params - fp8_params) + fp8_params)
    return {"params": params, "fp8_params": fp8_params, "bf16_bytes": bf16_bytes,
            "fp8_bytes": fp8_bytes, "saved_fraction": 1 - fp8_bytes / bf16_bytes,
            "amax_bytes": 4 * len(fp8_weights)}
