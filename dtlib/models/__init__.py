"""The small model family every chapter reuses, its named sizes, and the
single-process reference run every parallel proof compares against.

- :mod:`~dtlib.models.gpt`: a GPT (pre-LN, causal) and an MLP.
- :mod:`~dtlib.models.sizes`: named configurations (``size("tiny")``).
- :mod:`~dtlib.models.run`: the ``Parallelism`` seam and the one loop, ``run_steps``.
- :mod:`~dtlib.models.reference`: one process trains on the global batch: the truth.
"""

from __future__ import annotations

from dtlib.models.gpt import (GPTConfig, CausalSelfAttention, Block, GPT, MLP,
                              build_gpt, token_batch)
from dtlib.models.sizes import (SIZES, size)
from dtlib.models.run import (Parallelism, RunConfig, TrainState, Callback, Every,
                              StepEnd, RunResult, run_steps, gpt_loss,
                              tensors_by_name, unwrap, local_tensor, full_tensor)
from dtlib.models.reference import (grads_of, params_of, reference_run,
                                    reference_gpt_run, gpt_batches)

__all__ = ["GPTConfig", "CausalSelfAttention", "Block", "GPT", "MLP", "build_gpt",
           "token_batch", "SIZES", "size", "Parallelism", "RunConfig", "TrainState",
           "Callback", "Every", "StepEnd", "RunResult", "run_steps",
           "tensors_by_name", "unwrap", "local_tensor", "full_tensor", "grads_of",
           "params_of", "gpt_loss", "reference_run", "reference_gpt_run",
           "gpt_batches"]
