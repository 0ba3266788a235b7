"""A right number is right however it is spelled: numpy scalars, exact Fractions and
one-element tensors pass every checker that asks for a number or a count; a bool or a
string does not (the checkers' one rule, :func:`dtlib.exercises.as_number`)."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch

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
