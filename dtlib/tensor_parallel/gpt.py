"""Tensor parallelism applied to the book's GPT: ours (Megatron style) and DTensor.

What is split, what is replicated (per transformer block):

- attention: ``qkv`` column-parallel, ``proj`` row-parallel. Heads are split across
  ranks: with ``a`` heads and ``tp`` ranks, rank r computes heads r*a/tp .. (r+1)*a/tp;
  attention never mixes heads, so nothing is communicated between qkv and proj.
- MLP: ``fc`` column-parallel, GELU on the slice, ``fc_proj`` row-parallel.
- replicated on every rank: token/position embeddings (and the tied head), the
  LayerNorms, the row layers' biases. Their inputs and output gradients are identical
  on all ranks (f makes the gradient entering each LayerNorm whole), so their
  gradients are identical too and need no all-reduce.

The fused ``qkv`` layer is one ``Linear(h, 3h)`` whose output rows are ``[q | k | v]``.
A contiguous slice of rows would give rank 0 all of q and part of k. We therefore lay
the rows out head-group by head-group, ``[q_0 k_0 v_0 | q_1 k_1 v_1 | ...]`` (group r =
rank r's heads, :func:`interleave_qkv`); then a plain contiguous split (ours, or
torch's ``ColwiseParallel``, which shards dim 0 contiguously) gives each rank the q, k
and v of the same heads. The attention module infers its local head count from the
width it receives (``view(b, s, -1, head_dim)``, as torchtitan does), so one module
serves the full model, ours and DTensor's.

Dropout must be 0 here (the book's default): with dropout, ranks need one random
stream shared for replicated tensors and one per rank for split heads (Megatron's RNG
tracker).

Taught in: Chapter 5, "A tensor-parallel GPT".
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from dtlib.models.gpt import GPT, CausalSelfAttention
from dtlib.models.run import full_tensor, local_tensor
from dtlib.runtime import dist as ddist
from dtlib.tensor_parallel.layers import (ColumnParallelLinear, RowParallelLinear,
                                          gather_shards, tp_size)

__all__ = ["ParallelSelfAttention", "interleave_qkv", "deinterleave_qkv",
           "tensor_parallelize", "dtensor_parallelize", "full_tensors",
           "parallel_param_count", "block_tp_numbers"]

_SPLIT = ("attn.qkv", "attn.proj", "fc", "fc_proj")


def _regroup(t: torch.Tensor, a: int, b: int) -> torch.Tensor:
    # rows viewed as (a, b, rows/(a*b)) -> (b, a, ...): a transpose of row blocks
    rest = t.shape[1:]
    return t.reshape(a, b, -1, *rest).transpose(0, 1).reshape(t.shape)


def interleave_qkv(t: torch.Tensor, tp: int) -> torch.Tensor:
    """Reorder the rows of a fused qkv weight/bias from ``[q|k|v]`` to per-rank groups.

    Args:
        t: ``(3h, ...)`` qkv weight or bias, rows ``[q | k | v]``.
        tp: tensor-parallel size (must divide h).
    Returns:
        The same rows ordered ``[q_0 k_0 v_0 | q_1 k_1 v_1 | ...]``: contiguous slice r
        holds rank r's heads.

    Taught in: Chapter 5, "Attention: split the heads".
    """
    return _regroup(t, 3, tp)


def deinterleave_qkv(t: torch.Tensor, tp: int) -> torch.Tensor:
    """Inverse of :func:`interleave_qkv`: back to ``[q | k | v]``."""
    return _regroup(t, tp, 3)


class ParallelSelfAttention(nn.Module):
    """Causal self-attention over whichever heads this rank's ``qkv`` produces.

    ``qkv`` outputs ``(b, s, 3 * heads_here * head_dim)`` laid out ``[q | k | v]`` for
    this rank's heads; ``proj`` takes ``(b, s, heads_here * head_dim)``. With plain
    ``nn.Linear`` layers it is the full attention of :class:`dtlib.models.GPT`.
    ``tp`` is the number of head groups the full ``qkv`` rows are interleaved in
    (:func:`interleave_qkv`), which :func:`full_tensors` undoes.
    """

    def __init__(self, qkv: nn.Module, proj: nn.Module, head_dim: int, n_heads: int,
                 mask: torch.Tensor, tp: int = 1) -> None:
        super().__init__()
        self.qkv, self.proj, self.head_dim = qkv, proj, head_dim
        self.n_heads = n_heads  # heads on this rank (informative; forward infers it)
        self.tp = tp
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)
        # the sizes of qkv, not of x: under sequence parallelism (Chapter 12) x holds
        # s/t tokens and qkv, after the all-gather, all s
        b, s, _ = qkv.shape
        q, k, v = qkv.chunk(3, dim=-1)  # each (b, s, heads_here * head_dim)
        q, k, v = (t.reshape(b, s, -1, self.head_dim).transpose(1, 2)
                   for t in (q, k, v))  # (b, heads_here, s, head_dim)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)
        att = F.softmax(att.masked_fill(~self.mask[:s, :s], float("-inf")), dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, s, -1)
        return self.proj(y)


def _check(model: GPT, tp: int) -> None:
    if not isinstance(model, GPT):
        raise ValueError(f"model={type(model).__name__} must be a dtlib.models.GPT")
    cfg = model.cfg
    if cfg.n_heads % tp:
        raise ValueError(f"n_heads={cfg.n_heads} must be divisible by tp={tp}")
    if cfg.dropout:
        raise ValueError(f"dropout={cfg.dropout} must be 0 for tensor parallelism here "
                         "(split heads need per-rank dropout streams)")
    if not all(isinstance(blk.attn, CausalSelfAttention) for blk in model.blocks):
        raise ValueError("model is already tensor-parallel (attention was replaced)")


def _interleaved_qkv_linear(qkv: nn.Linear, tp: int) -> nn.Linear:
    new = nn.Linear(qkv.in_features, qkv.out_features, bias=qkv.bias is not None,
                    device=qkv.weight.device)
    with torch.no_grad():
        new.weight.copy_(interleave_qkv(qkv.weight, tp))
        if qkv.bias is not None:
            new.bias.copy_(interleave_qkv(qkv.bias, tp))
    # a meta-device start-up initialises afterwards: full values in the same order
    new.init_layout = functools.partial(interleave_qkv, tp=tp)
    return new


def tensor_parallelize(model: GPT, group: Any = None) -> GPT:
    """Split every block of a (full, identical on all ranks) GPT across ``group``.

    In place: each block's attention becomes a :class:`ParallelSelfAttention` with a
    column-parallel ``qkv`` (heads split) and a row-parallel ``proj``; ``fc`` and
    ``fc_proj`` become column- and row-parallel. Each parallel layer is this rank's
    slice of the full layer, so the result computes exactly what ``model`` did.

    Args:
        model: a :class:`dtlib.models.GPT` built the same on every rank (same seed).
        group: tensor-parallel process group (None: the default group).
    Returns:
        ``model``, now tensor-parallel. Parameter names are unchanged.

    Taught in: Chapter 5, "A tensor-parallel GPT".
    """
    tp = tp_size(group)
    _check(model, tp)
    cfg = model.cfg
    for blk in model.blocks:
        attn = blk.attn
        qkv = ColumnParallelLinear.from_linear(_interleaved_qkv_linear(attn.qkv, tp),
                                               group)
        proj = RowParallelLinear.from_linear(attn.proj, group)
        blk.attn = ParallelSelfAttention(qkv, proj, cfg.hidden // cfg.n_heads,
                                         cfg.n_heads // tp, attn.mask, tp)
        blk.fc = ColumnParallelLinear.from_linear(blk.fc, group)
        blk.fc_proj = RowParallelLinear.from_linear(blk.fc_proj, group)
    return model


def dtensor_parallelize(model: GPT, mesh: Any = None) -> GPT:
    """The same split with torch's DTensor tensor parallelism (``parallelize_module``).

    ``qkv`` and ``fc`` get ``ColwiseParallel`` (weight ``Shard(0)``: f appears as the
    redistribution of the input gradient from partial to replicated), ``proj`` and
    ``fc_proj`` ``RowwiseParallel`` (``Shard(1)``; g is the redistribution of the
    partial output). The qkv rows are interleaved first (see the module docstring);
    the per-rank head count is inferred by :class:`ParallelSelfAttention` from the
    local width, and also stored in ``attn.n_heads``.

    Args:
        model: a full GPT, identical on every rank.
        mesh: a 1-D ``DeviceMesh``; None builds one over all ranks on this rank's
            device type (``dtlib.runtime.dist.world().device``).
    Returns:
        ``model``, with the split weights as DTensors (``p.full_tensor()`` gathers).

    Taught in: Chapter 5, "The same with DTensor".
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    if mesh is None:
        world = ddist.world()
        mesh = init_device_mesh(world.device.type, (world.world_size,))
    tp = mesh.size()
    _check(model, tp)
    cfg = model.cfg
    plan = {"attn.qkv": ColwiseParallel(), "attn.proj": RowwiseParallel(),
            "fc": ColwiseParallel(), "fc_proj": RowwiseParallel()}
    for blk in model.blocks:
        attn = blk.attn
        blk.attn = ParallelSelfAttention(_interleaved_qkv_linear(attn.qkv, tp),
                                         attn.proj, cfg.hidden // cfg.n_heads,
                                         cfg.n_heads // tp, attn.mask, tp)
        parallelize_module(blk, mesh, plan)
    return model


def _owner(model: nn.Module, name: str) -> nn.Module:
    return model.get_submodule(name.rpartition(".")[0])


def full_tensors(model: nn.Module, group: Any = None, grads: bool = False
                 ) -> dict[str, torch.Tensor]:
    """Every parameter (or gradient) of a tensor-parallel model as the full tensor.

    Works for ours (all-gathers the slices of every column and row layer) and
    DTensor's (``full_tensor()``), for the GPT, the Hugging Face Llama and a plain
    model; qkv rows of a :class:`ParallelSelfAttention` are put back in
    ``[q | k | v]`` order, so the result compares name by name with the
    single-process model. Collective: call on every rank.

    Args:
        model: the model after :func:`tensor_parallelize` / :func:`dtensor_parallelize`
            (or ``tensor_parallel.hf_llama``'s functions).
        group: the tensor-parallel group (ours).
        grads: gradients instead of parameters (a missing gradient is skipped).
    Returns:
        ``{name: CPU tensor}``.

    Taught in: Chapter 5, "Equal to one process".
    """
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        t = p.grad if grads else p
        if t is None:
            continue
        t, owner = full_tensor(t.detach()), _owner(model, name)
        if isinstance(owner, ColumnParallelLinear):
            t = gather_shards(t, 0, group)  # (out/tp, in) slices -> (out, in)
        elif isinstance(owner, RowParallelLinear) and name.endswith("weight"):
            t = gather_shards(t, 1, group)  # (out, in/tp) slices -> (out, in)
        attn = _owner(model, name.rpartition(".")[0])
        if isinstance(attn, ParallelSelfAttention) and owner is attn.qkv:
            t = deinterleave_qkv(t, attn.tp)
        out[name] = t.cpu().clone()
    return out


def parallel_param_count(model: GPT) -> dict[str, int]:
    """Parameters this rank stores, split into the parallel layers and the rest.

    Returns:
        ``{"parallel": elements in qkv/proj/fc/fc_proj on this rank (row biases are
        replicated and included), "replicated": everything else}``.

    Taught in: Chapter 5, "Memory per rank".
    """
    counts = {"parallel": 0, "replicated": 0}
    for name, p in model.named_parameters():
        local = local_tensor(p)
        key = "parallel" if any(f".{s}." in name for s in _SPLIT) else "replicated"
        counts[key] += local.numel()
    return counts


def block_tp_numbers(hidden: int, batch: int, seq_len: int, tp: int,
                     element_size: int = 4) -> dict[str, int]:
    """Per-rank parameters and all-reduced bytes of one tensor-parallel block.

    Parameters of the four parallel layers on one rank: the split weights and column
    biases, ``(12 h^2 + 7 h) / tp``, plus the two replicated row biases, ``2 h``.
    Traffic per training step: one all-reduce of the ``(b, s, h)`` activations per
    column -> row pair in forward (g) and one in backward (f): ``4 b s h`` elements.
    Checked against real ranks in ``tests/test_tensor_parallel.py``.

    Args:
        hidden, batch, seq_len: h, b, s.
        tp: tensor-parallel size (must divide ``hidden``).
        element_size: bytes per activation element (4 for fp32).
    Returns:
        ``{"params_per_rank": int, "allreduce_bytes": int, "allreduce_calls": 4}``.

    Taught in: Chapter 5, "Memory per rank" and "Counting the messages".
    """
    for name, value in (("hidden", hidden), ("batch", batch), ("seq_len", seq_len),
                        ("tp", tp), ("element_size", element_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer")
    if hidden % tp:
        raise ValueError(f"hidden={hidden} must be divisible by tp={tp}")
    params = (12 * hidden * hidden + 7 * hidden) // tp + 2 * hidden
    return {"params_per_rank": params, "allreduce_calls": 4,
            "allreduce_bytes": 4 * batch * seq_len * hidden * element_size}
