"""Chapter 1: how many bytes a training run needs, from the papers' formulas and measured.

- :mod:`~dtlib.memory.formulas`: model states (ZeRO Table 1), parameter counts
  (Megatron), activations (Korthikanti et al. 2022), the whole estimate.
- :mod:`~dtlib.memory.measure`: the same quantities measured on a real model.
"""

from __future__ import annotations

from dtlib.memory.formulas import (GB, ModelStates, MemoryEstimate, TrainingConfig,
                                   ActivationMeasurement, ModelStateMeasurement,
                                   activation_bytes, bytes_per_param, estimate,
                                   PAPER_OMITS, gpt_layer_activation_terms,
                                   measure_activations, measure_gpt_layer,
                                   measure_model_states, model_state_bytes,
                                   transformer_params)

__all__ = ["GB", "ModelStates", "MemoryEstimate", "TrainingConfig",
           "ActivationMeasurement", "ModelStateMeasurement", "activation_bytes",
           "bytes_per_param", "estimate", "PAPER_OMITS", "gpt_layer_activation_terms",
           "measure_activations", "measure_gpt_layer", "measure_model_states",
           "model_state_bytes", "transformer_params"]
