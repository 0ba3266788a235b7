"""FSDP2 (``fully_shard``) on the book's models, and what it keeps per rank.

FSDP2 is PyTorch's native ZeRO-3: ``fully_shard(module)`` turns each parameter into a
DTensor sharded on dim 0 across the ranks, all-gathers a module's parameters before its
forward and backward and reduce-scatters its gradients. Apply it to each block first,
then to the root; create the optimizer *after* sharding (it must see the DTensors).
FSDP1 (``FullyShardedDataParallel`` with flat parameters and ``auto_wrap_policy``) is
legacy.

Taught in: Chapter 4, "FSDP2".
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.nn as nn

try:  # torch >= 2.6 exports FSDP2 here
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
except ImportError:  # pragma: no cover - older torch
    from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard

from dtlib.models.run import full_tensor, local_tensor
from dtlib.zero.flat_params import default_unit_modules
from dtlib.zero.shards import storage_bytes

__all__ = ["fully_shard", "MixedPrecisionPolicy", "shard_fsdp2", "bf16_policy",
           "fsdp_state_bytes", "full_parameters", "DEEPSPEED_TO_FSDP", "gradient_sync"]


def bf16_policy() -> MixedPrecisionPolicy:
    """bf16 parameters for compute, fp32 gradient reduction (the usual choice).

    The sharded parameters and AdamW states stay fp32 (the master copy); only the
    all-gathered copies used in forward/backward are bf16. No loss scaler is needed:
    bf16 has fp32's exponent range (fp16 would need a ShardedGradScaler).
    """
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def shard_fsdp2(model: nn.Module, unit_modules: list[nn.Module] | None = None,
                mp_policy: MixedPrecisionPolicy | None = None,
                reshard_after_forward: bool = True, mesh: Any = None) -> nn.Module:
    """Apply ``fully_shard`` to each unit (default: each block), then to the root.

    Args:
        model: the model, identical on every rank.
        unit_modules: submodules sharded as separate groups (default: the elements of
            each outermost ``nn.ModuleList``, as in :mod:`dtlib.zero`).
        mp_policy: e.g. :func:`bf16_policy`; ``None`` keeps fp32 everywhere.
        reshard_after_forward: True frees gathered parameters after forward (ZeRO-3);
            False keeps them until backward (ZeRO-2-like: no second all-gather).
        mesh: the ``DeviceMesh`` to shard over (e.g. ``mesh["dp"]`` of a 2-D mesh
            whose "tp" dimension already holds DTensor TP weights); None: all ranks.
    Returns:
        ``model``, now sharded in place (its class becomes an FSDP subclass).

    Taught in: Chapter 4, "FSDP2".
    """
    kwargs: dict[str, Any] = {"reshard_after_forward": reshard_after_forward}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    if mesh is not None:
        kwargs["mesh"] = mesh
    units = default_unit_modules(model) if unit_modules is None else unit_modules
    for unit in units:
        fully_shard(unit, **kwargs)
    fully_shard(model, **kwargs)
    return model


def fsdp_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer
                     ) -> dict[str, int]:
    """Bytes of model states this rank holds (local shards, unique storages).

    Returns:
        ``{"params", "grads", "optimizer", "total"}`` without step counters.

    Taught in: Chapter 4, "FSDP2".
    """
    seen: set[int] = set()
    params = list(model.parameters())
    p = storage_bytes((local_tensor(q) for q in params), seen)
    g = storage_bytes((local_tensor(q.grad) for q in params if q.grad is not None),
                      seen)
    o = storage_bytes((local_tensor(v) for st in optimizer.state.values()
                       for k, v in st.items() if k != "step" and torch.is_tensor(v)),
                      seen)
    return {"params": p, "grads": g, "optimizer": o, "total": p + g + o}


def full_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter, full size, by name (a collective: call on all ranks).

    Taught in: Chapter 4, "FSDP2".
    """
    return {name: full_tensor(p).detach().clone()
            for name, p in model.named_parameters()}


#: DeepSpeed settings and their FSDP2 counterparts (Chapter 4's table).
DEEPSPEED_TO_FSDP: list[dict[str, str]] = [
    {"DeepSpeed": "zero_optimization.stage = 3",
     "FSDP2": "fully_shard(block) for each block, then fully_shard(model), with "
              "reshard_after_forward=True (the default, None, keeps the root "
              "gathered from forward to backward)"},
    {"DeepSpeed": "zero_optimization.stage = 2",
     "FSDP2": "closest: fully_shard(..., reshard_after_forward=False) (FSDP1: "
              "SHARD_GRAD_OP); parameters stay gathered from forward to backward, "
              "but FSDP2 still frees them after backward and all-gathers them again "
              "every step, while ZeRO-2 keeps full parameters on every rank"},
    {"DeepSpeed": "zero_optimization.stage = 1",
     "FSDP2": "no exact match; torch's ZeroRedundancyOptimizer shards optimizer "
              "states"},
    {"DeepSpeed": "stage 0 (plain data parallel)",
     "FSDP2": "DistributedDataParallel (or replicate())"},
    {"DeepSpeed": "bf16.enabled = true",
     "FSDP2": "mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, "
              "reduce_dtype=torch.float32)"},
    {"DeepSpeed": "fp16.enabled = true (dynamic loss scale)",
     "FSDP2": "param_dtype=torch.float16 plus torch.amp.GradScaler"},
    {"DeepSpeed": "offload_param / offload_optimizer: device cpu",
     "FSDP2": "offload_policy=CPUOffloadPolicy() (params, grads and optimizer step "
              "on CPU)"},
    {"DeepSpeed": "reduce_bucket_size, stage3_prefetch_bucket_size",
     "FSDP2": "the grouping itself: one all-gather / reduce-scatter per fully_shard "
              "unit; prefetch via set_modules_to_forward_prefetch"},
    {"DeepSpeed": "gradient_clipping",
     "FSDP2": "torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm) "
              "(works on DTensors)"},
    {"DeepSpeed": "gradient_accumulation_steps",
     "FSDP2": "set_requires_gradient_sync(False) on all but the last micro-batch"},
]


@contextlib.contextmanager
def gradient_sync(wrapped: nn.Module, on: bool) -> Iterator[None]:
    """FSDP2's gradient reduction switched ``on`` or off for the block
    (``set_requires_gradient_sync``), and back on after it: the one switch every
    FSDP2 layout's ``grad_sync`` uses (a module that is not FSDP2's: no switch).

    Taught in: Chapter 8, "Accumulation under DDP" (FSDP2's ``no_sync``).
    """
    setter = getattr(wrapped, "set_requires_gradient_sync", None)
    if setter is None:
        yield
        return
    setter(on)
    try:
        yield
    finally:
        setter(True)
