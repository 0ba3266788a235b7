"""The small model family every chapter reuses, its named sizes, and the
single-process reference run every parallel proof compares against.

- :mod:`~dtlib.models.gpt`: a GPT (pre-LN, causal) and an MLP.
- :mod:`~dtlib.models.sizes`: named configurations (``size("tiny")``).
- :mod:`~dtlib.models.reference`: one process trains on the global batch: the truth.
"""

from __future__ import annotations

from dtlib.models.gpt import (GPTConfig, CausalSelfAttention, Block, GPT, MLP,
                              build_gpt, token_batch)
from dtlib.models.sizes import (SIZES, size)
from dtlib.models.reference import (grads_of, params_of, gpt_loss, train_reference,
                                    reference_gpt_run)

__all__ = ["GPTConfig", "CausalSelfAttention", "Block", "GPT", "MLP", "build_gpt",
           "token_batch", "SIZES", "size", "grads_of", "params_of", "gpt_loss",
           "train_reference", "reference_gpt_run"]
