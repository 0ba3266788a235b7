"""Chapter 7: mixed precision.

- :mod:`~dtlib.precision.formats`: fp32/fp16/bf16 bit layouts and what autocast does.
- :mod:`~dtlib.precision.loss_scaling`: a dynamic loss scaler (GradScaler's algorithm).
- :mod:`~dtlib.precision.mixed_precision`: fp32 master weights by hand, and
  ``parallelism(dtype)``: the same as the one loop's Parallelism.
- :mod:`~dtlib.precision.sharded`: mixed precision across ranks, the one-process
  reference with the ranks' casts and the loss scaler whose flag the ranks share.
- :mod:`~dtlib.precision.reduction`: reduce in what dtype? bf16 vs fp32 sums across
  ranks and micro-batches, measured.
"""

from __future__ import annotations

from dtlib.precision.formats import (FORMAT_BITS, CUDA_LOW_PRECISION_OPS, CUDA_FP32_OPS,
                                     CUDA_PROMOTE_OPS, CPU_PROMOTE_OPS,
                                     widest_input_demo, fp32_matmul_precision,
                                     torch_dtype, FormatInfo, format_info,
                                     subnormal_from_bits, format_table, round_trip,
                                     autocast_op_table, op_output_dtypes,
                                     deprecated_amp_warnings)
from dtlib.precision.loss_scaling import (DynamicLossScaler, simulate_scale,
                                          grad_scaler_available)
from dtlib.precision.sharded import ShardedLossScaler, SimulatedRanks
from dtlib.precision.reduction import reduction_errors, accumulation_errors
from dtlib.precision.mixed_precision import (LOW_DTYPES, MODES, ManualMixedPrecision,
                                             ManualPrecision, parallelism,
                                             state_bytes_per_param, flushed_fraction)

__all__ = ["FORMAT_BITS", "CUDA_LOW_PRECISION_OPS", "CUDA_FP32_OPS", "CUDA_PROMOTE_OPS",
           "CPU_PROMOTE_OPS", "widest_input_demo", "fp32_matmul_precision",
           "torch_dtype",
           "FormatInfo", "format_info", "subnormal_from_bits", "format_table",
           "round_trip", "autocast_op_table", "op_output_dtypes",
           "deprecated_amp_warnings", "DynamicLossScaler", "simulate_scale",
           "grad_scaler_available", "LOW_DTYPES", "MODES", "ManualMixedPrecision",
           "ManualPrecision", "parallelism", "state_bytes_per_param",
           "flushed_fraction", "ShardedLossScaler", "SimulatedRanks",
           "reduction_errors", "accumulation_errors"]
