"""Chapter 8: gradient accumulation normalised by the global token count.

- :mod:`~dtlib.accumulation.micro_batches`: micro-batch groups, token counts, the
  accumulation loop (with ``no_sync`` under DDP).
"""

from __future__ import annotations

from dtlib.accumulation.micro_batches import (IGNORE_INDEX, MicroBatch, LossFn,
                                              count_tokens, token_loss_sum,
                                              micro_batch_groups, global_token_count,
                                              GroupStats, accumulate_gradients,
                                              make_grad_scaler, EpochStats, train_epoch)

__all__ = ["IGNORE_INDEX", "MicroBatch", "LossFn", "count_tokens", "token_loss_sum",
           "micro_batch_groups", "global_token_count", "GroupStats",
           "accumulate_gradients", "make_grad_scaler", "EpochStats", "train_epoch"]
