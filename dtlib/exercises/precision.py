"""Checkers for Chapter 7, "Mixed precision"."""

from __future__ import annotations

import torch

from dtlib.exercises import WrongAnswer, check_close, checker, passed
from dtlib.precision.loss_scaling import simulate_scale
from dtlib.precision.formats import format_info


@checker
def check_format_constants(name: str, eps: float, smallest_subnormal: float) -> None:
    """Check machine epsilon and the smallest positive (subnormal) value of ``name``.

    The truth is derived from the format's bits (``dtlib.precision.format_info``).
    """
    info = format_info(name)
    check_close(f"{name} eps", eps, info.eps,
                hint="eps is the gap between 1.0 and the next number the format "
                     "holds: which mantissa bit is the last one? ('Floating-point "
                     "formats')")
    check_close(f"{name} smallest subnormal", smallest_subnormal,
                info.smallest_subnormal,
                hint="a subnormal has the smallest exponent the format allows and "
                     "only its last mantissa bit set; the exponent bias follows from "
                     "the number of exponent bits")
    passed(f"{name}: eps = {info.eps!r}, "
           f"smallest subnormal = {info.smallest_subnormal!r}")


@checker
def check_underflow_prediction(values: list[float], fp16_zero: list[bool],
                               bf16_zero: list[bool]) -> None:
    """Check which of ``values`` become exactly 0 when stored in fp16 and in bf16.

    The truth is what torch does when it casts each value.
    """
    for dtype, guess in ((torch.float16, fp16_zero), (torch.bfloat16, bf16_zero)):
        if len(guess) != len(values):
            raise WrongAnswer(f"give one bool per value: {len(values)} values, "
                              f"{len(guess)} predictions for {dtype}")
        truth = (torch.tensor(values, dtype=torch.float64).to(dtype) == 0).tolist()
        for v, g, t in zip(values, guess, truth):
            if bool(g) != t:
                raise WrongAnswer(
                    f"{v!r} in {dtype}: you said {'0' if g else 'nonzero'}, torch "
                    f"gives {'0' if t else 'nonzero'}. Hint: compare with the format's "
                    "smallest subnormal (half of it rounds to even, i.e. to 0).")
    passed("your underflow predictions match torch's casts")


@checker
def check_scale_after(flags: list[bool], init_scale: float, growth_interval: int,
                      final_scale: float, skipped: int) -> None:
    """Check the scale after a sequence of steps (True = overflow) and the skip count.

    Growth factor 2, backoff factor 0.5, as GradScaler's defaults.
    """
    truth = simulate_scale(flags, init_scale, 2.0, 0.5, growth_interval)[-1]
    n_skip = sum(bool(f) for f in flags)
    check_close("final scale", final_scale, truth,
                hint="halve after each overflow (and restart counting clean steps); "
                     f"double after every {growth_interval} clean steps in a row")
    if skipped != n_skip:
        raise WrongAnswer(f"skipped steps: got {skipped!r}, "
                          f"{'too many' if skipped > n_skip else 'too few'}.",
                          "a step is skipped when, and only when, its gradients hold "
                          "an inf or a nan ('Loss scaling')")
    passed(f"scale {truth!r} after {len(flags)} steps, {n_skip} skipped")
