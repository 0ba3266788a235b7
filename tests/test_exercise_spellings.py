"""A right number is right however it is spelled: numpy scalars, exact Fractions and
one-element tensors pass every checker that asks for a number or a count; a bool or a
string does not (the checkers' one rule, :func:`dtlib.exercises.as_number`)."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from dtlib.exercises import WrongAnswer, as_integer, as_number

SPELLINGS = [int, float, np.int64, np.float64, np.float32, Fraction,
             lambda v: torch.tensor(v), lambda v: np.array(v)]


@pytest.mark.parametrize("spell", SPELLINGS)
def test_a_number_in_any_spelling_is_that_number(spell) -> None:
    assert as_number(spell(3)) == 3.0


@pytest.mark.parametrize("value", [True, np.bool_(False), "3", None, [3],
                                   torch.tensor([1, 2]), torch.tensor(True)])
def test_what_is_not_a_number_is_refused(value) -> None:
    assert as_number(value) is None


def test_a_count_accepts_integers_and_whole_fractions_only() -> None:
    assert [as_integer(v) for v in (np.int64(4), Fraction(8, 2), torch.tensor(4),
                                    4)] == [4, 4, 4, 4]
    assert [as_integer(v) for v in (4.0, Fraction(1, 2), True, torch.tensor(4.0),
                                    "4")] == [None] * 5


@pytest.mark.parametrize("spell", [np.int64, Fraction, np.float64])
def test_checkers_of_closed_forms_accept_other_spellings(spell, capsys) -> None:
    from dtlib.exercises.accumulation import check_allreduce_calls
    from dtlib.exercises.memory import check_bytes_per_param
    from dtlib.exercises.tensor_parallel import check_tp_numbers

    check_bytes_per_param(spell(16))
    if spell is not np.float64:  # a count: an integer, in any integer type
        check_allreduce_calls(lambda a, n, no_sync: spell(n if no_sync else a * n))

    def tp(h: int, b: int, s: int, tp: int) -> dict:
        # Chapter 5's count, by hand (the book's block_tp_numbers is the truth, and
        # switched off while the answer runs)
        t = {"params_per_rank": (12 * h * h + 7 * h) // tp + 2 * h,
             "allreduce_bytes": 4 * b * s * h * 4}
        ring = Fraction(2 * (tp - 1), tp) * int(t["allreduce_bytes"])
        return {"params_per_rank": spell(int(t["params_per_rank"])),
                "allreduce_bytes": spell(int(t["allreduce_bytes"])),
                "ring_send_bytes": ring if spell is Fraction else spell(float(ring))}

    check_tp_numbers(tp)
    assert "Correct" in capsys.readouterr().out


def test_exact_fractions_pass_the_loss_multiplier(capsys) -> None:
    from dtlib.exercises.train import check_loss_multiplier

    check_loss_multiplier(lambda n, b, s, k: Fraction(1, b * s * k))
    assert "Correct" in capsys.readouterr().out


def test_a_bool_is_still_a_wrong_answer() -> None:
    from dtlib.exercises.memory import check_bytes_per_param

    with pytest.raises(WrongAnswer, match="expected a number"):
        check_bytes_per_param(True)


# ---- valid methods the checkers once refused -------------------------------------

def gpipe_with_recomputation(stage, micro_batches, targets, act_shape):
    from torch.utils.checkpoint import checkpoint
    if dist.get_rank() == 0:
        outputs = []
        for x in micro_batches:
            y = checkpoint(stage, x, use_reentrant=False)  # recomputed in backward
            dist.send(y.detach(), dst=1)
            outputs.append(y)
        for y in outputs:
            grad = torch.empty_like(y)
            dist.recv(grad, src=1)
            y.backward(grad)
        return None
    inputs, losses = [], []
    for target in targets:
        a = torch.empty(act_shape)
        dist.recv(a, src=0)
        a.requires_grad_()
        inputs.append(a)
        losses.append(F.mse_loss(stage(a), target) / len(targets))
    for a, loss in zip(inputs, losses):
        loss.backward()
        dist.send(a.grad, dst=0)
    return sum(loss.detach() for loss in losses).item()

def functional_reduce_scatter_hook(param):
    import torch.distributed._functional_collectives as fc
    n = dist.get_world_size()
    flat = param.grad.reshape(-1)
    shard = fc.reduce_scatter_tensor(flat, "sum", 0, dist.group.WORLD)
    param.grad_shard = fc.wait_tensor(shard) / n
    param.grad = None


def test_gpipe_with_recomputation_is_gpipe(capsys) -> None:
    """torch.utils.checkpoint runs a stage's forward again inside its backward: a
    recomputation, not a second micro-batch (once refused as "6 forwards for 3")."""
    from dtlib.exercises.pipeline_parallel import check_pipeline_step

    check_pipeline_step(gpipe_with_recomputation)
    assert "Correct" in capsys.readouterr().out


def test_a_functional_reduce_scatter_per_parameter_is_zero2(capsys) -> None:
    from dtlib.exercises.zero import check_zero2_hook

    check_zero2_hook(functional_reduce_scatter_hook)
    assert "Correct" in capsys.readouterr().out
