"""Chapter 8: gradient accumulation normalised by the global token count.

- :mod:`~dtlib.accumulation.micro_batches`: micro-batch groups, token counts, the
  accumulation of one step (synchronising once, through the Parallelism's
  ``grad_sync``), its ``step_fn`` for the one loop, and a small trainer on it.
"""

from __future__ import annotations

from dtlib.accumulation.micro_batches import (IGNORE_INDEX, MicroBatch, LossFn,
                                              count_tokens, token_loss_sum,
                                              micro_batch_groups,
                                              GroupStats, accumulate_gradients,
                                              AccumulationStep, accumulation_step,
                                              make_grad_scaler, EpochStats,
                                              train_epoch)

__all__ = ["IGNORE_INDEX", "MicroBatch", "LossFn", "count_tokens", "token_loss_sum",
           "micro_batch_groups", "GroupStats",
           "accumulate_gradients", "AccumulationStep", "accumulation_step",
           "make_grad_scaler", "EpochStats", "train_epoch"]
