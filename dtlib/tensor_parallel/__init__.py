"""Chapter 5: tensor parallelism as in Megatron-LM.

- :mod:`~dtlib.tensor_parallel.mappings`: the operators f and g (autograd functions).
- :mod:`~dtlib.tensor_parallel.layers`: column- and row-parallel linear layers.
- :mod:`~dtlib.tensor_parallel.gpt`: the book's GPT made tensor parallel, ours and
  DTensor's.
- :mod:`~dtlib.tensor_parallel.parallelism`: :func:`parallelism`, the technique for
  the one loop (``run_steps``).
"""

from __future__ import annotations

from dtlib.tensor_parallel.mappings import (tp_size, tp_rank, copy_to_tp,
                                            reduce_from_tp, gather_from_tp,
                                            scatter_to_tp, CopyToParallelRegion,
                                            ReduceFromParallelRegion,
                                            GatherFromParallelRegion,
                                            ScatterToParallelRegion)
from dtlib.tensor_parallel.layers import (full_linear, gather_shards,
                                          ColumnParallelLinear, RowParallelLinear)
from dtlib.tensor_parallel.gpt import (ParallelSelfAttention, interleave_qkv,
                                       deinterleave_qkv, tensor_parallelize,
                                       dtensor_parallelize, full_tensors,
                                       parallel_param_count, block_tp_numbers)
from dtlib.tensor_parallel.parallelism import VARIANTS, TensorParallel, parallelism

__all__ = ["tp_size", "tp_rank", "copy_to_tp", "reduce_from_tp", "gather_from_tp",
           "scatter_to_tp", "CopyToParallelRegion", "ReduceFromParallelRegion",
           "GatherFromParallelRegion", "ScatterToParallelRegion", "full_linear",
           "gather_shards", "ColumnParallelLinear", "RowParallelLinear",
           "ParallelSelfAttention", "interleave_qkv", "deinterleave_qkv",
           "tensor_parallelize", "dtensor_parallelize", "full_tensors",
           "parallel_param_count", "block_tp_numbers", "VARIANTS", "TensorParallel",
           "parallelism"]
