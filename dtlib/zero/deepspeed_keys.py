"""The keys DeepSpeed reads: from the installed DeepSpeed, or a stored snapshot.

DeepSpeed's JSON config has ~60 top-level keys and ~50 under ``zero_optimization``,
and they change between releases (0.19 removed ``amp``, ``mics_shard_size`` and a
dozen more). A hand-written list goes stale, so :func:`deepspeed_keys` reads them
from the installed DeepSpeed when there is one:

- top level: the keys ``DeepSpeedConfig`` looks up while it parses a config (recorded
  by handing it a dict that notes every lookup), without the removed ones;
- ``zero_optimization`` and its ``offload_param`` / ``offload_optimizer``: the fields
  and aliases of its pydantic models (which reject anything else);
- removed keys: DeepSpeed's own tables of removed features and their messages.

Without DeepSpeed, :data:`SNAPSHOT` holds the same lists taken from DeepSpeed
|SNAPSHOT_VERSION|. :func:`deepspeed_accepts` asks the installed DeepSpeed for its
verdict on a config (the tests compare it with :mod:`dtlib.zero.deepspeed_config`).

Taught in: Chapter 4, "The seed's DeepSpeed config".
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import os
from dataclasses import dataclass
from typing import Any

__all__ = ["KeyLists", "SNAPSHOT", "SNAPSHOT_VERSION", "deepspeed_keys",
           "installed_keys", "deepspeed_accepts"]

SNAPSHOT_VERSION = "0.19.8"


@dataclass(frozen=True)
class KeyLists:
    """The config keys one DeepSpeed version reads.

    version: where the lists come from ("0.19.8 (installed)", "0.19.8 (snapshot)").
    top: top-level keys; zero: keys of ``zero_optimization`` (names and aliases).
    offload_param, offload_optimizer: keys of the two offload sections.
    removed: removed key (``"amp"``, ``"zero_optimization.mics_shard_size"``) -> why.
    """

    version: str
    top: frozenset[str]
    zero: frozenset[str]
    offload_param: frozenset[str]
    offload_optimizer: frozenset[str]
    removed: dict[str, str]


_REMOVED_WHY = ("removed in DeepSpeed 0.19 "
                "(github.com/deepspeedai/DeepSpeed/issues/8489)")

#: DeepSpeed 0.19.8's lists, read by :func:`installed_keys` and stored here.
SNAPSHOT = KeyLists(
    version=f"{SNAPSHOT_VERSION} (snapshot)",
    top=frozenset({
        "activation_checkpointing", "aio", "autotuning", "bf16", "bfloat16",
        "checkpoint", "comet", "comms_logger", "communication_data_type", "compile",
        "csv_monitor", "data_efficiency", "data_types", "dataloader_drop_last",
        "datastates_ckpt", "disable_allgather", "disable_python_gc", "dump_state",
        "expert_parallel", "flops_profiler", "fp16", "gradient_accumulation_steps",
        "gradient_allreduce_op", "gradient_clipping", "gradient_predivide_factor",
        "hybrid_engine", "log_level", "managed_gradient_accumulation",
        "memory_breakdown", "optimizer", "pipeline", "prescale_gradients",
        "scheduler", "seq_parallel_communication_data_type", "steps_per_print",
        "tensor_parallel", "tensorboard", "timers", "torch_autocast",
        "train_batch_size", "train_micro_batch_size_per_gpu",
        "use_data_before_expert_parallelism", "vocabulary_size",
        "wall_clock_breakdown", "wandb", "weight_quantization",
        "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer",
        "zero_optimization"}),
    zero=frozenset({
        "allgather_bucket_size", "allgather_partitions", "allgather_sequential",
        "compute_grad_norm", "contiguous_gradients", "cpu_offload",
        "cpu_offload_param", "cpu_offload_use_pin_memory", "elastic_checkpoint",
        "enable_sanity_checks", "gather_16bit_weights_on_model_save",
        "ignore_unused_parameters", "leaf_module", "legacy_stage1",
        "load_from_fp32_weights", "log_trace_cache_warnings", "max_live_parameters",
        "max_reuse_distance", "memory_efficient_linear", "model_persistence_threshold",
        "module_granularity_threshold", "offload_optimizer", "offload_param",
        "overlap_comm", "override_module_apply", "param_persistence_threshold",
        "parameter_alignment", "pipeline_loading_checkpoint", "prefetch_bucket_size",
        "reduce_bucket_size", "reduce_scatter", "round_robin_gradients",
        "save_muon_momentum_buffer_in_memory", "stage", "stage3_allgather_sequential",
        "stage3_gather_16bit_weights_on_model_save",
        "stage3_gather_fp16_weights_on_model_save", "stage3_max_live_parameters",
        "stage3_max_reuse_distance", "stage3_model_persistence_threshold",
        "stage3_module_granularity_threshold", "stage3_param_persistence_threshold",
        "stage3_prefetch_bucket_size", "stage3_use_all_reduce_for_fetch_params",
        "sub_group_size", "use_all_reduce_for_fetch_params",
        "use_multi_rank_bucket_allreduce", "zenflow", "zero_hpz_partition_size",
        "zero_quantized_gradients", "zero_quantized_nontrainable_weights",
        "zero_quantized_weights"}),
    offload_param=frozenset({"buffer_count", "buffer_size", "device", "max_in_cpu",
                             "nvme_path", "pin_memory"}),
    offload_optimizer=frozenset({"buffer_count", "cpuadam_cores_perc", "device",
                                 "fast_init", "nvme_path", "pin_memory",
                                 "pipeline_read", "pipeline_write", "ratio",
                                 "super_offload"}),
    removed={k: _REMOVED_WHY for k in (
        "amp", "compression_training", "curriculum_learning", "eigenvalue",
        "elasticity", "graph_harvesting", "nebula", "progressive_layer_drop",
        "quantize_training", "sparse_attention", "sparse_gradients",
        "zero_optimization.mics_hierarchical_params_gather",
        "zero_optimization.mics_shard_size", "zero_optimization.zeropp_loco_param")},
)


class _Lookups(set):
    """A dict's key view that notes every ``key in view`` test."""

    def __init__(self, keys: Any, seen: set[str]) -> None:
        super().__init__(keys)
        self.seen = seen

    def __contains__(self, key: object) -> bool:
        self.seen.add(str(key))
        return super().__contains__(key)


class _Recording(dict):
    """A dict that notes every key looked up in it (``get``, ``[]``, ``in``)."""

    def __init__(self, data: dict, seen: set[str]) -> None:
        super().__init__(data)
        self.seen = seen

    def get(self, key: Any, default: Any = None) -> Any:
        self.seen.add(key)
        return super().get(key, default)

    def __getitem__(self, key: Any) -> Any:
        self.seen.add(key)
        return super().__getitem__(key)

    def __contains__(self, key: object) -> bool:
        self.seen.add(str(key))
        return super().__contains__(key)

    def keys(self) -> Any:  # DeepSpeed often tests `key in param_dict.keys()`
        return _Lookups(super().keys(), self.seen)

    def __copy__(self) -> "_Recording":
        return _Recording(self, self.seen)


def _fields(model: Any) -> frozenset[str]:
    names = set()
    for name, info in model.model_fields.items():
        names.add(name)
        if info.alias:
            names.add(info.alias)
    return frozenset(names)


@functools.lru_cache(maxsize=1)
def installed_keys() -> KeyLists | None:
    """The key lists of the installed DeepSpeed, or None when it is not installed.

    Taught in: Chapter 4, "The seed's DeepSpeed config".
    """
    if importlib.util.find_spec("deepspeed") is None:
        return None
    import torch

    if not torch.cuda.is_available():  # say so: DeepSpeed would guess, with a warning
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    from deepspeed.runtime import config as ds_config
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.runtime.zero.offload_config import (
        DeepSpeedZeroOffloadOptimizerConfig, DeepSpeedZeroOffloadParamConfig)

    removed = {k: v for k, v in getattr(
        ds_config, "_REMOVED_TOP_LEVEL_CONFIG_KEYS", {}).items()}
    removed.update({f"zero_optimization.{k}": v for k, v in getattr(
        ds_config, "_REMOVED_ZERO_CONFIG_KEYS", {}).items()})
    seen: set[str] = set()
    ds_config.DeepSpeedConfig(_Recording({"train_batch_size": 1}, seen))
    return KeyLists(version=f"{deepspeed.__version__} (installed)",
                    top=frozenset(seen - set(removed)),
                    zero=_fields(DeepSpeedZeroConfig),
                    offload_param=_fields(DeepSpeedZeroOffloadParamConfig),
                    offload_optimizer=_fields(DeepSpeedZeroOffloadOptimizerConfig),
                    removed=removed)


def deepspeed_keys(source: str = "auto") -> KeyLists:
    """The key lists the validator checks against.

    Args:
        source: ``"auto"`` (the installed DeepSpeed if any, else the snapshot),
            ``"installed"`` or ``"snapshot"``.
    Returns:
        The :class:`KeyLists`.
    Raises:
        ValueError: ``source`` unknown, or ``"installed"`` without DeepSpeed.

    Taught in: Chapter 4, "The seed's DeepSpeed config".
    """
    if source not in ("auto", "installed", "snapshot"):
        raise ValueError(f"source={source!r} not allowed; allowed: 'auto', "
                         "'installed', 'snapshot'")
    if source == "snapshot":
        return SNAPSHOT
    found = installed_keys()
    if found is None and source == "installed":
        raise ValueError("source='installed' but DeepSpeed is not installed; "
                         "allowed here: 'auto', 'snapshot'")
    return found or SNAPSHOT


class _DataParallel:
    """The one method of a Megatron-style ``mpu`` that DeepSpeedConfig asks."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size

    def get_data_parallel_world_size(self) -> int:
        return self.world_size


def deepspeed_accepts(cfg: dict[str, Any], world_size: int) -> str | None:
    """DeepSpeed's own verdict: None if ``DeepSpeedConfig`` accepts ``cfg``, else why.

    Runs in one process, without a process group: DeepSpeedConfig's rank lookup is
    answered with 0 and its data-parallel size with ``world_size``.

    Args:
        cfg: the config dict (not modified).
        world_size: data-parallel ranks the config is checked for.
    Returns:
        None, or ``"ErrorType: message"``.

    Taught in: Chapter 4, "The seed's DeepSpeed config".
    """
    from deepspeed.runtime import config as ds_config

    get_rank = ds_config.dist.get_rank
    ds_config.dist.get_rank = lambda *a, **k: 0  # no process group in this process
    try:
        ds_config.DeepSpeedConfig(copy.deepcopy(cfg), mpu=_DataParallel(world_size))
    except Exception as err:  # noqa: BLE001 - every rejection counts as a verdict
        return f"{type(err).__name__}: {err}"
    finally:
        ds_config.dist.get_rank = get_rank
    return None
