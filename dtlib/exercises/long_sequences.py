"""Checkers for Chapter 12, "Long sequences"."""

from __future__ import annotations

from typing import Any, Callable

from dtlib.context_parallel.volume import cp_volume
from dtlib.exercises import WrongAnswer, check_close, checker, passed


@checker
def check_cp_volume(predict: Callable[[int, int, int, int], dict[str, Any]],
                    cases: tuple[tuple[int, int, int, int], ...] = (
                        (1, 16, 32, 2), (2, 4096, 1024, 4), (1, 131072, 8192, 16))
                    ) -> None:
    """Check ``predict(b, s, h, cp)`` -> ``{"ring", "ulysses"}``: bytes one rank sends
    in the *forward* pass of one attention layer (fp32, as many K/V heads as query
    heads), ring attention vs DeepSpeed-Ulysses. The truth is
    :func:`dtlib.context_parallel.cp_volume`, checked against real ranks in the tests.
    """
    for b, s, h, cp in cases:
        got = predict(b, s, h, cp)
        if not isinstance(got, dict):
            raise WrongAnswer(f"predict must return a dict, got {type(got).__name__}")
        truth = cp_volume(b, s, h, cp, n_heads=cp)
        where = f"b={b}, s={s}, h={h}, cp={cp}"
        check_close(f"{where}: ring", got.get("ring"), truth.ring_forward, hint=(
            "a rank passes on K and V (each b x s/cp x h) once per hop, and a block "
            "needs cp - 1 hops to visit every other rank"))
        check_close(f"{where}: ulysses", got.get("ulysses"), truth.ulysses_forward,
                    hint=("four all-to-alls (q, k, v in; the output back), each of a "
                          "b x s/cp x h tensor of which a rank keeps 1/cp"))
    passed("ring attention sends 2(cp-1) b (s/cp) h values per layer, Ulysses "
           "4 b (s/cp) h (cp-1)/cp: the ring's volume grows with cp, Ulysses' does not")
