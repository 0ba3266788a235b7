"""Megatron sequence parallelism: the regions tensor parallelism leaves whole, split.

Tensor parallelism (Chapter 5) splits the matmuls but leaves the LayerNorms, dropouts
and residual adds replicated: every rank stores their ``(b, s, h)`` activations, the
``10 sbh`` that does not shrink with ``t`` (Korthikanti et al. 2022, §4.2.2). Sequence
parallelism splits those regions along the sequence instead, each rank keeping
``s / t`` tokens, and swaps the operators at the boundaries:

- **g** (:class:`GatherFromSequenceParallelRegion`): before a column-parallel layer.
  forward: all-gather along the sequence (the layer needs every token); backward:
  reduce-scatter (sum the ranks' partial input gradients, keep this rank's tokens).
  It replaces Chapter 5's f (identity / all-reduce).
- **ḡ** (:class:`ReduceScatterToSequenceParallelRegion`): after a row-parallel
  layer. forward: reduce-scatter (sum the partial products, keep this rank's tokens);
  backward: all-gather. It replaces Chapter 5's g (all-reduce / identity).

A ring all-reduce *is* a reduce-scatter followed by an all-gather, so the bytes on the
wire are the same as plain tensor parallelism's; the memory of the split regions is
divided by ``t``. Activations are ``(batch, seq, hidden)`` here (the book's GPT), so
the sequence is dimension 1; Megatron keeps ``(seq, batch, hidden)`` so that its
collectives act on dimension 0 without a transpose.

The parameters of the split regions (LayerNorm weights, the row layers' biases) now
see only this rank's tokens: their gradients are partial sums and must be all-reduced
over the tensor-parallel group (:func:`allreduce_sequence_parallel_grads`).

Taught in: Chapter 12, "Sequence parallelism".
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from dtlib.collectives.algorithms import all_gather_into, reduce_scatter_into
from dtlib.memory.measure import gpt_layer_activation_terms
from dtlib.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from dtlib.tensor_parallel.mappings import tp_rank, tp_size

__all__ = ["GatherFromSequenceParallelRegion", "ReduceScatterToSequenceParallelRegion",
           "gather_from_sp", "reduce_scatter_to_sp", "split_to_sp",
           "SequenceParallelColumnLinear", "SequenceParallelRowLinear",
           "sequence_parallel_block", "allreduce_sequence_parallel_grads",
           "block_activation_terms", "SEQ_DIM"]

SEQ_DIM = 1  # activations are (batch, seq, hidden)


def _gather_seq(x: torch.Tensor, group: Any) -> torch.Tensor:
    # (b, s/t, h) -> (s/t, b, h) so the ranks' pieces are contiguous along dim 0
    local = x.transpose(0, 1).contiguous()
    out = torch.empty((tp_size(group) * local.size(0), *local.shape[1:]),
                      dtype=x.dtype, device=x.device)
    all_gather_into(out, local, group)
    return out.transpose(0, 1)  # (b, s, h)


def _reduce_scatter_seq(x: torch.Tensor, group: Any) -> torch.Tensor:
    t = tp_size(group)
    if x.size(SEQ_DIM) % t:
        raise ValueError(f"sequence length {x.size(SEQ_DIM)} must be divisible by "
                         f"tp={t} for sequence parallelism")
    full = x.transpose(0, 1).contiguous()  # (s, b, h)
    out = torch.empty((full.size(0) // t, *full.shape[1:]), dtype=x.dtype,
                      device=x.device)
    reduce_scatter_into(out, full, group)
    return out.transpose(0, 1)  # (b, s/t, h)


def _split_seq(x: torch.Tensor, group: Any) -> torch.Tensor:
    t = tp_size(group)
    if x.size(SEQ_DIM) % t:
        raise ValueError(f"sequence length {x.size(SEQ_DIM)} must be divisible by "
                         f"tp={t} for sequence parallelism")
    return x.chunk(t, dim=SEQ_DIM)[tp_rank(group)].contiguous()


class GatherFromSequenceParallelRegion(torch.autograd.Function):
    """Megatron's **g** of sequence parallelism.

    forward: all-gather along the sequence, backward: reduce-scatter along the sequence.
    Sits before a column-parallel layer (each rank's gradient of the gathered input is
    a partial sum over its columns; the reduce-scatter sums and re-splits it).
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        if tp_size(group) == 1:
            return x
        return _gather_seq(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        if tp_size(ctx.group) == 1:
            return grad, None
        return _reduce_scatter_seq(grad, ctx.group), None


class ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    """Megatron's **ḡ** of sequence parallelism.

    forward: reduce-scatter along the sequence, backward: all-gather along the sequence.
    Sits after a row-parallel layer: sums the partial products, keeps this rank's
    tokens.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        if tp_size(group) == 1:
            return x
        return _reduce_scatter_seq(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        if tp_size(ctx.group) == 1:
            return grad, None
        return _gather_seq(grad, ctx.group), None


class ScatterToSequenceParallelRegion(torch.autograd.Function):
    """forward: keep this rank's tokens (split), backward: all-gather.

    Enters the sequence-parallel region from a replicated tensor (the embeddings).
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        if tp_size(group) == 1:
            return x
        return _split_seq(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        if tp_size(ctx.group) == 1:
            return grad, None
        return _gather_seq(grad, ctx.group), None


def gather_from_sp(x: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Apply g: all-gather the sequence forward, reduce-scatter backward.

    Args:
        x: ``(b, s/t, h)``, this rank's tokens.
        group: the tensor-parallel group.
    Returns:
        ``(b, s, h)``. Taught in: Chapter 12, "Sequence parallelism".
    """
    return GatherFromSequenceParallelRegion.apply(x, group)


def reduce_scatter_to_sp(x: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Apply ḡ: reduce-scatter the sequence forward, all-gather backward.

    Args:
        x: ``(b, s, h)``, a partial sum on each rank.
        group: the tensor-parallel group.
    Returns:
        ``(b, s/t, h)``. Taught in: Chapter 12, "Sequence parallelism".
    """
    return ReduceScatterToSequenceParallelRegion.apply(x, group)


def split_to_sp(x: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Keep this rank's ``s/t`` tokens forward, all-gather backward.

    Args:
        x: ``(b, s, h)``, replicated. group: the tensor-parallel group.
    Returns:
        ``(b, s/t, h)``. Taught in: Chapter 12, "Sequence parallelism".
    """
    return ScatterToSequenceParallelRegion.apply(x, group)


class SequenceParallelColumnLinear(ColumnParallelLinear):
    """A column-parallel layer whose input is sequence-split: g, then the local matmul.

    Input ``(b, s/t, in)``; output ``(b, s, out/t)``. The gathered input is what
    ``F.linear`` saves for backward (Megatron instead saves the local piece and
    all-gathers it again in backward, trading one more all-gather for ``(t-1)/t`` of
    that activation).
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(gather_from_sp(x, self.group), self.weight, self.bias)
        return y  # (b, s, out/t)


class SequenceParallelRowLinear(RowParallelLinear):
    """A row-parallel layer whose output is sequence-split: local matmul, then ḡ.

    Input ``(b, s, in/t)``; output ``(b, s/t, out)``. The bias is added after the
    reduce-scatter, once per token; its gradient is then partial (this rank's tokens).
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = reduce_scatter_to_sp(F.linear(x, self.weight), self.group)
        return y if self.bias is None else y + self.bias


def sequence_parallel_block(block: nn.Module, group: Any = None) -> nn.Module:
    """Turn a tensor-parallel block (Chapter 5) into a sequence-parallel one, in place.

    Each column-parallel layer becomes a :class:`SequenceParallelColumnLinear` and each
    row-parallel layer a :class:`SequenceParallelRowLinear` holding the same
    parameters; the block's own ``forward`` is unchanged: its LayerNorms and residual
    adds simply act on ``(b, s/t, h)``.

    Args:
        block: a ``dtlib.models.gpt.Block`` after
            ``dtlib.tensor_parallel.gpt.tensor_parallelize``.
        group: the tensor-parallel group it was split over.
    Returns:
        ``block``; it now takes and returns ``(b, s/t, h)``.

    Taught in: Chapter 12, "Sequence parallelism".
    """
    swap = {ColumnParallelLinear: SequenceParallelColumnLinear,
            RowParallelLinear: SequenceParallelRowLinear}
    found = 0
    for m in block.modules():
        if type(m) in swap:
            if m.group is not group:
                raise ValueError("group must be the group the block was split over")
            m.__class__ = swap[type(m)]  # same parameters; only forward changes
            found += 1
    if not found:
        raise ValueError("block has no column/row-parallel layers; apply "
                         "tensor_parallelize first")
    return block


def sequence_parallel_params(module: nn.Module) -> list[nn.Parameter]:
    """Parameters that see only this rank's tokens under sequence parallelism:
    LayerNorm weights and biases, and the row-parallel layers' (replicated) biases."""
    params: list[nn.Parameter] = []
    for m in module.modules():
        if isinstance(m, nn.LayerNorm):
            params += [p for p in m.parameters(recurse=False)]
        elif isinstance(m, SequenceParallelRowLinear) and m.bias is not None:
            params.append(m.bias)
    return params


def allreduce_sequence_parallel_grads(module: nn.Module, group: Any = None) -> None:
    """Sum the partial gradients of :func:`sequence_parallel_params` over ``group``.

    Args:
        module: a block or model after :func:`sequence_parallel_block`.
        group: the tensor-parallel group.
    Returns:
        None; ``p.grad`` holds the full gradient afterwards.

    Taught in: Chapter 12, "Sequence parallelism".
    """
    if tp_size(group) == 1:
        return
    for p in sequence_parallel_params(module):
        if p.grad is not None:
            dist.all_reduce(p.grad, group=group)


#: Terms of Chapter 1's itemisation a tensor-parallel rank holds 1/t of (the heads
#: and the 4h-wide MLP are split); sequence parallelism splits NORM_TERMS as well.
SPLIT_BY_TP = ("Q and K (for QK^T)", "V (for attention x V)", "softmax output",
               "attention dropout mask + output", "output projection input",
               "GELU input (4h wide)", "MLP second linear input (4h wide)")
NORM_TERMS = ("layer-norm inputs (2)", "layer-norm mean and 1/std (fp32)",
              "dropout masks after attention and MLP")


def block_activation_terms(seq_len: int, micro_batch: int, hidden: int, n_heads: int,
                           tp: int, sequence_parallel: bool, *,
                           dtype_bytes: int = 4) -> dict[str, int]:
    """Bytes one rank saves for backward in one block, term by term, with TP (and SP).

    Chapter 1's exact itemisation (``gpt_layer_activation_terms``, no dropout) with
    the split terms divided by ``t``: Korthikanti et al.'s ``sbh(10 + 24/t +
    5as/(ht))`` for tensor parallelism and ``sbh(34/t + 5as/(ht))`` with sequence
    parallelism, in this code's units. Two differences from the paper stay visible:
    the causal mask (``s^2`` bools, not split) and, with sequence parallelism, the
    inputs of the two column-parallel layers: ``F.linear`` keeps the *gathered*
    ``(b, s, h)`` input, where Megatron keeps the local ``s/t`` piece and all-gathers
    it again in backward.

    Args:
        seq_len, micro_batch, hidden, n_heads: s, b, h, a.
        tp: tensor-parallel size t (divides ``n_heads`` and ``seq_len``).
        sequence_parallel: whether the norm regions are split along the sequence.
        dtype_bytes: bytes per value (4: fp32).
    Returns:
        ``{term: bytes}`` on one rank.

    Taught in: Chapter 12, "Sequence parallelism".
    """
    if not isinstance(tp, int) or tp < 1 or n_heads % tp or seq_len % tp:
        raise ValueError(f"tp={tp!r} must be a positive integer dividing "
                         f"n_heads={n_heads} and seq_len={seq_len}")
    terms = gpt_layer_activation_terms(seq_len, micro_batch, hidden, n_heads,
                                       dtype_bytes=dtype_bytes, dropout=False)
    split = SPLIT_BY_TP + (NORM_TERMS if sequence_parallel else ())
    return {k: v // tp if k in split else v for k, v in terms.items()}
