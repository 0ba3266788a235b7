"""Checkers for Chapter 7, "Mixed precision"."""

from __future__ import annotations

from typing import Any, Callable

import torch

from dtlib.exercises import WrongAnswer, check_close, checker, passed, run_on_ranks
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


# ---- build it: one dynamic loss-scaler update that all ranks agree on ----------------

# Which rank's gradients overflow at each step (2 ranks): the ranks disagree at 2
# and 5.
_OVERFLOWS = ((False, False), (False, False), (False, True), (True, True),
              (False, False), (True, False), (False, False), (False, False))
_INIT_SCALE, _INTERVAL = 2.0 ** 16, 3


def _scaler_on_rank(step: Callable[..., tuple]) -> list[Any]:
    """On each of two ranks: the learner's update over :data:`_OVERFLOWS`, with this
    rank's own (scaled) gradients; what it returned and what it left in them."""
    import torch.distributed as dist

    rank = dist.get_rank()
    scale, tracker, out = _INIT_SCALE, 0, []
    for i, flags in enumerate(_OVERFLOWS):
        gen = torch.Generator().manual_seed(10 * i + rank)
        grads = [torch.randn(4, generator=gen) * scale, torch.randn(3, generator=gen)
                 * scale]
        if flags[rank]:
            grads[1][0] = float("inf")
        want = [g / scale for g in grads]
        skip, scale, tracker = step(grads, scale, tracker, _INTERVAL)
        unscaled = flags[rank] or all(torch.allclose(g, w) for g, w in zip(grads, want))
        out.append((bool(skip), float(scale), int(tracker), unscaled))
    return out


@checker
def check_scaler_step(step: Callable[..., tuple]) -> None:
    """Check ``step(grads, scale, growth_tracker, growth_interval)`` -> ``(skip,
    new_scale, new_growth_tracker)`` on two real ranks.

    Each rank unscales its own gradients in place; the ranks agree whether any of them
    overflowed (then all skip, the scale halves and the tracker resets); after
    ``growth_interval`` clean steps in a row the scale doubles. Growth factor 2,
    backoff 0.5, as GradScaler's defaults.
    """
    truth = simulate_scale([any(f) for f in _OVERFLOWS], _INIT_SCALE, 2.0, 0.5,
                           _INTERVAL)
    ranks = run_on_ranks(_scaler_on_rank, step, 2, what="your scaler step")
    for i, flags in enumerate(_OVERFLOWS):
        (skip0, s0, _, u0), (skip1, s1, _, u1) = ranks[0][i], ranks[1][i]
        where = f"step {i} (overflow on rank 0: {flags[0]}, on rank 1: {flags[1]})"
        if skip0 != skip1 or s0 != s1:
            raise WrongAnswer(
                f"{where}: the ranks disagree: rank 0 skip={skip0}, scale={s0:g}; "
                f"rank 1 skip={skip1}, scale={s1:g}. A rank that steps while another "
                "skips makes the replicas drift apart.",
                "each rank sees only its own gradients; let every rank learn whether "
                "any rank found an inf or a nan (one all-reduce of a flag, with "
                "ReduceOp.MAX)")
        if skip0 != any(flags):
            raise WrongAnswer(f"{where}: skip={skip0}.", "a step is skipped when, and "
                              "only when, some rank's gradients hold an inf or a nan")
        if s0 != truth[i]:
            side = "too large" if s0 > truth[i] else "too small"
            raise WrongAnswer(f"{where}: the scale afterwards is {side}.",
                              "halve after an overflow and restart counting clean "
                              f"steps; double after {_INTERVAL} clean steps in a row "
                              "('Loss scaling')")
        if not (u0 and u1):
            raise WrongAnswer(f"{where}: the gradients were not unscaled in place "
                              "(divided by the scale the loss was multiplied by).")
    passed("both ranks skip together and update the scale like GradScaler over "
           f"{len(_OVERFLOWS)} steps")
