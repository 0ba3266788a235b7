"""The method an exercise names is checked, not only the numbers: answers that get
the right values the wrong way are each rejected with what they did."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from dtlib.exercises import WrongAnswer


# ---- Chapter 5: f is the identity in forward, one all-reduce in backward --------

class _ChattyF(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        y = x.clone()
        dist.all_reduce(y)  # x is the same on every rank: the mean is x again
        return y / dist.get_world_size()

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


def column_with_a_forward_all_reduce(x, weight_shard, bias_shard):
    return F.linear(_ChattyF.apply(x), weight_shard, bias_shard)


def test_an_all_reduce_in_fs_forward_is_refused() -> None:
    from dtlib.exercises.tensor_parallel import check_column_parallel

    with pytest.raises(WrongAnswer, match=r"your forward communicates "
                                          r"\(\['all_reduce'\]\)"):
        check_column_parallel(column_with_a_forward_all_reduce, world_sizes=(2,))


# ---- Chapter 7: the reduce-scatter runs in reduce_dtype, and nothing else runs ----

def reduce_in_fp32_then_round(grad, reduce_dtype):
    n = dist.get_world_size()
    shard = torch.empty(grad.numel() // n, dtype=torch.float32)
    dist.reduce_scatter_tensor(shard, grad.float())  # the wire is fp32 either way
    return shard.to(reduce_dtype).float() / n


def all_reduce_then_slice(grad, reduce_dtype):
    n, rank = dist.get_world_size(), dist.get_rank()
    full = grad.to(reduce_dtype)
    dist.all_reduce(full)
    k = grad.numel() // n
    return full[rank * k:(rank + 1) * k].float() / n


@pytest.mark.parametrize("answer, says", [
    (reduce_in_fp32_then_round, r"\[\('reduce_scatter', 'float32'\)\] \(op, dtype\): "
                                r"the exercise asks for a reduce-scatter in bfloat16"),
    (all_reduce_then_slice, r"\[\('all_reduce', 'float32'\)\]"),
])
def test_the_wire_dtype_and_the_collective_are_checked(answer, says) -> None:
    from dtlib.exercises.precision import check_grad_shard_reduce

    with pytest.raises(WrongAnswer, match=says):
        check_grad_shard_reduce(answer)


# ---- Chapter 1: a sum over ranks that never communicated --------------------------

def saved_bytes_from_the_checkers_cases(layer, x):
    """Knows the batches the checker gives every rank and counts each of them here,
    on fake inputs: the right sum, with no collective."""
    from dtlib.exercises.memory import SAVED_CASES

    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}

    def count(inp):
        saved = {}

        def pack(t):
            if t.untyped_storage().data_ptr() not in params:
                saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            layer(inp)
        return sum(saved.values())

    case = next(c for c in SAVED_CASES
                if (c[0], c[1]) == (x.shape[1], x.shape[2])
                and c[3 + dist.get_rank()] == x.shape[0])
    return sum(count(torch.randn(b, *x.shape[1:], requires_grad=True))
               for b in case[3:])


def test_a_sum_over_ranks_needs_a_collective() -> None:
    from dtlib.exercises.memory import check_saved_bytes

    with pytest.raises(WrongAnswer, match="without any collective"):
        check_saved_bytes(saved_bytes_from_the_checkers_cases)
