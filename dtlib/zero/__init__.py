"""Chapter 4: ZeRO stages 1-3 from scratch, FSDP2, and DeepSpeed's configuration.

- :mod:`~dtlib.zero.flat_params` and :mod:`~dtlib.zero.units`: parameters flattened into
  units, each split evenly across ranks.
- :mod:`~dtlib.zero.shards`: what the three stages share (the units of a model, their
  collectives, the gradient hooks of backward).
- :mod:`~dtlib.zero.optimizer`: stages 1 and 2, :class:`ShardedOptimizer` over any
  ``torch.optim`` class (the shape of ``ZeroRedundancyOptimizer``).
- :mod:`~dtlib.zero.stage3`: stage 3, :class:`FullyShardedModule` whose parameters are
  this rank's shards (the shape of FSDP2), and its gather/free hooks.
- :mod:`~dtlib.zero.fsdp`: torch's FSDP2 (``fully_shard``) as the chapter uses it.
- :mod:`~dtlib.zero.parallelism`: :func:`parallelism`, all of them for ``run_steps``.
- :mod:`~dtlib.zero.deepspeed_config`: writing and checking a DeepSpeed config.
- :mod:`~dtlib.zero.deepspeed_engine`: DeepSpeed's engine as a Parallelism for
  ``run_steps`` (imports deepspeed only when a run initialises it).
"""

from __future__ import annotations

from dtlib.zero.optimizer import ShardedOptimizer, zero_comm_elements, no_decay_groups
from dtlib.zero.stage3 import FullyShardedModule, gather_flat, install_stage3_hooks
from dtlib.zero.shards import ShardedUnits
from dtlib.zero.units import Unit, free_flat
from dtlib.zero.flat_params import FlatLayout, assign_units, default_unit_modules
from dtlib.zero.fsdp import (fully_shard, MixedPrecisionPolicy, shard_fsdp2,
                             bf16_policy, fsdp_state_bytes, full_parameters,
                             DEEPSPEED_TO_FSDP)
from dtlib.zero.parallelism import StateAfterStep, parallelism
from dtlib.zero.deepspeed_config import (TOP_LEVEL_KEYS, ZERO_KEYS, OFFLOAD_KEYS,
                                         PRECISIONS, DeepSpeedCheck, deepspeed_config,
                                         validate_deepspeed_config,
                                         consistent_world_sizes)

__all__ = ["ShardedOptimizer", "FullyShardedModule", "ShardedUnits", "parallelism",
           "StateAfterStep",
           "zero_comm_elements", "no_decay_groups", "Unit", "free_flat",
           "gather_flat", "install_stage3_hooks", "FlatLayout", "assign_units",
           "default_unit_modules", "fully_shard", "MixedPrecisionPolicy",
           "shard_fsdp2", "bf16_policy", "fsdp_state_bytes", "full_parameters",
           "DEEPSPEED_TO_FSDP", "TOP_LEVEL_KEYS", "ZERO_KEYS", "OFFLOAD_KEYS",
           "PRECISIONS", "DeepSpeedCheck", "deepspeed_config",
           "validate_deepspeed_config", "consistent_world_sizes"]
