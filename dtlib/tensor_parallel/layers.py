"""Tensor parallelism as in Megatron-LM: split each matmul across the ranks of a group.

A linear layer ``Y = X A^T + b`` (``A`` of shape ``(out, in)``, as in ``nn.Linear``) can
be split two ways (Shoeybi et al. 2019, §3):

- **by output features** (:class:`ColumnParallelLinear`): rank r holds rows
  ``r*out/tp .. (r+1)*out/tp`` of ``A`` and computes its slice of ``Y`` from the full,
  replicated ``X``. No communication in forward; in backward each rank's input gradient
  is only the part its slice contributes, so they are summed: operator **f**.
- **by input features** (:class:`RowParallelLinear`): rank r holds the matching columns
  of ``A`` and takes its slice of ``X``; the partial products are summed across ranks
  in forward: operator **g**. Its input gradient is already this rank's slice.

A column layer followed by a row layer (MLP: fc -> GELU -> fc_proj; attention: qkv ->
heads -> proj) needs nothing between them: the column layer's split output *is* the row
layer's split input (GELU and attention act on each slice separately). One f before the
pair, one g after it: two all-reduces per pair and step.

The operators f and g live in :mod:`dtlib.tensor_parallel.mappings`.

Taught in: Chapter 5, "Tensor parallel".
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from dtlib.tensor_parallel.mappings import (copy_to_tp, gather_from_tp,
                                            reduce_from_tp, scatter_to_tp, tp_rank,
                                            tp_size)

__all__ = ["full_linear", "gather_shards", "ColumnParallelLinear", "RowParallelLinear"]


def full_linear(in_features: int, out_features: int, bias: bool = True,
                seed: int = 0) -> nn.Linear:
    """The full ``nn.Linear`` a parallel layer built with ``seed`` is a slice of.

    Drawn with torch's default ``nn.Linear`` init (uniform, bound 1/sqrt(in_features):
    activations keep their scale) from a generator seeded with ``seed``, so every rank
    builds the same full weight and keeps its slice. This is Megatron's CPU path
    (``_initialize_affine_weight_cpu``: build the master weight, split it); it costs the
    full weight's memory for a moment on every rank, the price of exact equality.

    Args:
        in_features, out_features, bias: as ``nn.Linear``.
        seed: the seed shared by all ranks.
    Returns:
        The full layer (same on every rank).

    Taught in: Chapter 5, "Initialisation".
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Linear(in_features, out_features, bias=bias)


def _check_divisible(name: str, value: int, tp: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer")
    if value % tp:
        raise ValueError(f"{name}={value} must be divisible by the tensor-parallel "
                         f"size tp={tp} (each rank holds {name}/tp of them)")


def gather_shards(t: torch.Tensor, dim: int, group: Any = None) -> torch.Tensor:
    """The full tensor from every rank's equal slice of it along ``dim``.

    A plain all-gather (no autograd): what a comparison with one process needs to see
    a split weight or gradient whole. Collective: call on every rank of ``group``.

    Args:
        t: this rank's slice (a column layer's rows: ``dim=0``; a row layer's
            columns: ``dim=1``).
        dim: the dimension the slices were cut along.
        group: the tensor-parallel process group (None: the default group).
    Returns:
        The slices of ranks 0, 1, ... concatenated along ``dim``.

    Taught in: Chapter 5, "Equal to one process".
    """
    if tp_size(group) == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(tp_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


class ColumnParallelLinear(nn.Module):
    """``nn.Linear`` split by output features: rank r holds rows r*out/tp.. of weight.

    Input: the full ``(..., in_features)`` tensor, replicated on every rank.
    Output: ``(..., out_features / tp)`` (this rank's slice), or the full
    ``(..., out_features)`` with ``gather_output=True``.

    Args:
        in_features, out_features, bias: as ``nn.Linear``; ``out_features`` must be
            divisible by the group size.
        group: the tensor-parallel process group (None: the default group).
        gather_output: all-gather the slices into the full output.
        seed: seed of the full weight (see :func:`full_linear`), shared by all ranks.

    Taught in: Chapter 5, "Splitting by columns".
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 group: Any = None, gather_output: bool = False, seed: int = 0,
                 _full: nn.Linear | None = None) -> None:
        super().__init__()
        self.group, self.gather_output = group, gather_output
        tp = tp_size(group)
        _check_divisible("in_features", in_features, 1)
        _check_divisible("out_features", out_features, tp)
        self.in_features, self.out_features = in_features, out_features
        self.out_per_rank = out_features // tp
        full = _full if _full is not None else full_linear(
            in_features, out_features, bias, seed)
        rows = slice(tp_rank(group) * self.out_per_rank,
                     (tp_rank(group) + 1) * self.out_per_rank)
        self.weight = nn.Parameter(full.weight.detach()[rows].clone())  # (out/tp, in)
        if full.bias is not None:
            self.bias = nn.Parameter(full.bias.detach()[rows].clone())
        else:
            self.register_parameter("bias", None)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: Any = None,
                    gather_output: bool = False) -> "ColumnParallelLinear":
        """This rank's column-parallel slice of an existing (full) ``linear``."""
        return cls(linear.in_features, linear.out_features, linear.bias is not None,
                   group, gather_output, _full=linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = copy_to_tp(x, self.group)  # f: the input gradient is summed over ranks
        y = F.linear(x, self.weight, self.bias)  # (..., out/tp)
        return gather_from_tp(y, self.group) if self.gather_output else y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"out_per_rank={self.out_per_rank}, bias={self.bias is not None}")


class RowParallelLinear(nn.Module):
    """``nn.Linear`` split by input features: rank r holds columns r*in/tp.. of weight.

    Input: this rank's slice ``(..., in_features / tp)`` (``input_is_parallel=True``,
    e.g. straight from a :class:`ColumnParallelLinear`), or the full input, which is
    then split. Output: the full ``(..., out_features)``, identical on every rank.
    The bias is replicated and added once, after the all-reduce (adding it on every
    rank before the sum would count it tp times).

    Args:
        in_features, out_features, bias: as ``nn.Linear``; ``in_features`` must be
            divisible by the group size. ``bias=False`` registers ``bias`` as None.
        group: the tensor-parallel process group (None: the default group).
        input_is_parallel: the input is already split along its last dimension.
        seed: seed of the full weight (see :func:`full_linear`), shared by all ranks.

    Taught in: Chapter 5, "Splitting by rows".
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 group: Any = None, input_is_parallel: bool = True, seed: int = 0,
                 _full: nn.Linear | None = None) -> None:
        super().__init__()
        self.group, self.input_is_parallel = group, input_is_parallel
        tp = tp_size(group)
        _check_divisible("in_features", in_features, tp)
        _check_divisible("out_features", out_features, 1)
        self.in_features, self.out_features = in_features, out_features
        self.in_per_rank = in_features // tp
        full = _full if _full is not None else full_linear(
            in_features, out_features, bias, seed)
        cols = slice(tp_rank(group) * self.in_per_rank,
                     (tp_rank(group) + 1) * self.in_per_rank)
        # (out, in/tp)
        self.weight = nn.Parameter(full.weight.detach()[:, cols].clone())
        if full.bias is not None:
            self.bias = nn.Parameter(full.bias.detach().clone())
        else:
            self.register_parameter("bias", None)  # ERRATA 19: forward reads self.bias

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: Any = None,
                    input_is_parallel: bool = True) -> "RowParallelLinear":
        """This rank's row-parallel slice of an existing (full) ``linear``."""
        return cls(linear.in_features, linear.out_features, linear.bias is not None,
                   group, input_is_parallel, _full=linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tp(x, self.group)
        y = reduce_from_tp(F.linear(x, self.weight), self.group)  # g: sum of partials
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"in_per_rank={self.in_per_rank}, bias={self.bias is not None}")
