"""Checkers for Chapter 10, "Capstone: one training script"."""

from __future__ import annotations

from typing import Callable

from dtlib.exercises import WrongAnswer, check_close, checker, passed

_CASES = ((1, 4, 32, 1), (4, 2, 32, 1), (4, 2, 32, 4), (8, 1, 1024, 16))


def _truth(world_size: int, micro_batch: int, seq_len: int, accum_steps: int) -> float:
    # The summed token loss of one micro-batch times this factor, averaged over ranks
    # by DDP and summed over micro-batches, is the mean loss over the global batch.
    return world_size / (world_size * micro_batch * seq_len * accum_steps)


@checker
def check_loss_multiplier(multiplier: Callable[[int, int, int, int], float]) -> None:
    """Check ``multiplier(world_size, micro_batch, seq_len, accum_steps)``: the factor
    that turns a micro-batch's *summed* token loss into its share of the global mean
    loss when DDP averages gradients over ranks (Chapter 10's loop, Chapter 8)."""
    for world_size, micro_batch, seq_len, accum_steps in _CASES:
        got = multiplier(world_size, micro_batch, seq_len, accum_steps)
        truth = _truth(world_size, micro_batch, seq_len, accum_steps)
        if isinstance(got, (int, float)) and world_size > 1 \
                and abs(got - truth / world_size) <= 1e-12 * truth:
            raise WrongAnswer(
                f"world_size={world_size}: {got!r} is the mean over the global batch's "
                "tokens, but DDP then divides the summed gradients by world_size "
                "again. Hint: multiply by world_size to undo that division.")
        check_close(f"multiplier(world_size={world_size}, micro_batch={micro_batch}, "
                    f"seq_len={seq_len}, accum_steps={accum_steps})", got, truth,
                    rel=1e-9, hint="count the tokens of the whole optimizer step on "
                    "all ranks, and remember what DDP does to the ranks' gradients "
                    "(Chapter 8, 'Accumulation under DDP')")
    passed(f"your multiplier is right for {len(_CASES)} configurations")
