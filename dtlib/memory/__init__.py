"""Chapter 1: the bytes a training run needs, from the papers' formulas and measured.

- :mod:`~dtlib.memory.formulas`: model states (ZeRO Table 1), parameter counts
  (Megatron), activations (Korthikanti et al. 2022), the whole estimate.
- :mod:`~dtlib.memory.measure`: the same quantities measured on a real model.
"""

from __future__ import annotations

from dtlib.memory.formulas import (GB, ModelStates, MemoryEstimate, TrainingConfig,
                                   activation_bytes, bytes_per_param, estimate,
                                   model_state_bytes, transformer_params)
# The measured quantities (dtlib.memory.measure, torch) load on first use, so that
# the formulas and the pure-Python planner built on them never import torch.
from dtlib.memory.formulas import __getattr__  # noqa: E402,F401

__all__ = ["GB", "ModelStates", "MemoryEstimate", "TrainingConfig",
           "ActivationMeasurement", "ModelStateMeasurement", "activation_bytes",
           "bytes_per_param", "estimate", "PAPER_OMITS", "gpt_layer_activation_terms",
           "measure_activations", "measure_gpt_layer", "measure_model_states",
           "model_state_bytes", "transformer_params"]
