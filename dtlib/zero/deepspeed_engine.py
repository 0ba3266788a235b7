"""DeepSpeed's engine behind the one loop: ``deepspeed.initialize`` as a Parallelism.

:class:`DeepSpeedParallelism` is ZeRO stage 1-3 done by DeepSpeed: ``apply`` returns
the engine (:func:`initialize_engine`), backward is ``engine.backward(loss)``, the
optimizer's step is ``engine.step()`` (:class:`EngineStep`), and ``full_state``
gathers ZeRO-3's partitions (:func:`full_engine_state`). The engine accumulates
gradients by its config's ``gradient_accumulation_steps``, so Chapter 8's
accumulation is refused here, naming both. :func:`deepspeed_state_bytes` counts
the model states a rank holds, by role; with the optimizer offloaded (ZeRO-3),
:func:`offload_host_bytes` counts what DeepSpeed keeps for it in host memory.

DeepSpeed on CPU: it picks its CPU accelerator and gloo by itself; we hand it a torch
optimizer (``zero_allow_untested_optimizer``) instead of its ``FusedAdam``, and tell
it that no compiled op is available, so nothing is JIT-compiled (its CPU shared-memory
all-reduce would be: it falls back to torch.distributed).

Taught in: Chapter 4, "DeepSpeed, run".
"""

from __future__ import annotations

import os
from typing import Any, Iterable

import torch
import torch.distributed as dist
import torch.nn as nn

from dtlib.data_parallel.parallelism import rows_of_rank
from dtlib.models.run import Batch, Parallelism
from dtlib.zero.shards import storage_bytes

__all__ = ["DeepSpeedParallelism", "EngineStep", "deepspeed_ds_config",
           "deepspeed_state_bytes", "offload_host_bytes", "initialize_engine",
           "full_engine_state"]

#: Gradient clipping of the runs (the config's ``gradient_clipping``).
CLIP = 1.0


def deepspeed_ds_config(stage: int, micro_batch: int, clip: float = CLIP,
                        offload_optimizer: bool = False, bf16: bool = False
                        ) -> dict[str, Any]:
    """The DeepSpeed config of these runs: fp32 (or ``bf16``), ZeRO ``stage``,
    clipping the gradient norm to ``clip``, a torch optimizer; with
    ``offload_optimizer``, the optimizer's partitions in host memory, stepped there
    by that torch optimizer (DeepSpeed would ask for its compiled ``DeepSpeedCPUAdam``).

    Taught in: Chapter 4, "DeepSpeed, run".
    """
    zero: dict[str, Any] = {"stage": stage}
    cfg = {"train_micro_batch_size_per_gpu": micro_batch,
           "gradient_accumulation_steps": 1,
           "gradient_clipping": clip,
           "zero_optimization": zero,
           "zero_allow_untested_optimizer": True,  # a torch optimizer, not FusedAdam
           "steps_per_print": 10 ** 6, "wall_clock_breakdown": False}
    if offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu"}
        cfg["zero_force_ds_cpu_optimizer"] = False  # the torch optimizer, on the host
    if bf16:
        cfg["bf16"] = {"enabled": True}  # bf16 parameters and gradients, fp32 master
    return cfg


def _tensors(obj: Any, depth: int = 2) -> Iterable[torch.Tensor]:
    """Tensors in ``obj`` (a tensor, or lists/dicts of them, ``depth`` levels deep)."""
    if torch.is_tensor(obj):
        yield obj
    elif depth and isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v, depth - 1)
    elif depth and isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v, depth - 1)


def deepspeed_state_bytes(engine: Any, grads: Iterable[torch.Tensor]
                          ) -> dict[str, int]:
    """Bytes of model states one DeepSpeed rank holds, by role (unique storages).

    params: the module's parameters (ZeRO-3: each one's partition ``ds_tensor``) plus
    the fp32 partition the optimizer updates (a second copy, even in fp32 training);
    grads: the gradient buffers passed in (collected after ``backward``);
    optimizer: AdamW's ``exp_avg`` and ``exp_avg_sq``.

    Taught in: Chapter 4, "DeepSpeed, run".
    """
    seen: set[int] = set()
    module = [getattr(p, "ds_tensor", p) for p in engine.module.parameters()]
    inner = engine.optimizer.optimizer  # the torch AdamW inside DeepSpeed's ZeRO
    master = [p for g in inner.param_groups for p in g["params"]]
    p = storage_bytes(module, seen)
    master_bytes = storage_bytes(master, seen)
    o = storage_bytes((v for st in inner.state.values() for k, v in st.items()
                        if k != "step"), seen)
    g = storage_bytes(grads, seen)
    return {"params": p + master_bytes, "master": master_bytes, "grads": g,
            "optimizer": o, "total": p + master_bytes + g + o}


def offload_host_bytes(engine: Any) -> dict[str, int]:
    """Host bytes DeepSpeed's ZeRO-3 holds for an offloaded optimizer on this rank,
    by tensor (unique storages; after a step, once the moments exist).

    master: the fp32 partition the optimizer updates; optimizer: AdamW's ``exp_avg``
    and ``exp_avg_sq`` of it; fp32_grads: its ``.grad``, the gradient partition in
    fp32 that the optimizer reads; grad_buffer: the gradient partitions in the
    gradient-accumulation dtype (the model's), where reduce-scatters accumulate;
    total: their sum. The 16-bit parameter partitions and the reduce bucket stay on
    the accelerator, and are not counted.

    Raises:
        ValueError: the engine is not ZeRO-3 with ``offload_optimizer``.
        RuntimeError: one of these tensors is not on the host.

    Taught in: Chapter 4, "DeepSpeed, run".
    """
    zero = engine.optimizer
    if engine.zero_optimization_stage() != 3 or not getattr(
            zero, "offload_optimizer", False):
        raise ValueError(f"stage {engine.zero_optimization_stage()} without "
                         "offload_optimizer; allowed: ZeRO-3 with offload_optimizer")
    masters = list(zero.fp32_partitioned_groups_flat)
    roles = {"master": masters,
             "optimizer": [v for st in zero.optimizer.state.values()
                           for k, v in st.items() if k != "step"],
             "fp32_grads": [m.grad for m in masters],
             "grad_buffer": [zero.grad_partitions_flat_buffer]}
    elsewhere = [r for r, ts in roles.items() for t in ts
                 if t is not None and t.device.type != "cpu"]
    if elsewhere:
        raise RuntimeError(f"offloaded tensors off the host: {sorted(set(elsewhere))}")
    seen: set[int] = set()
    out = {role: storage_bytes(ts, seen) for role, ts in roles.items()}
    return {**out, "total": sum(out.values())}


def _deepspeed_grads(engine: Any) -> list[torch.Tensor]:
    """Gradient buffers a DeepSpeed rank holds between backward and step."""
    out = [p.grad for p in engine.module.parameters() if p.grad is not None]
    opt = engine.optimizer
    for name, value in vars(opt).items():  # stage 2/3 keep partitions in buffers
        if "grad" in name and "norm" not in name and "acc" not in name:
            out += list(_tensors(value))
    return out


def _cpu_accelerator_unless_cuda() -> None:
    """Tell DeepSpeed it runs on the CPU (it would guess so, with a warning)."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


def initialize_engine(model: nn.Module, stage: int, micro_batch: int,
                      optimizer: torch.optim.Optimizer, **config: bool) -> Any:
    """``deepspeed.initialize`` of ``model`` at ZeRO ``stage`` with a torch
    ``optimizer``, no compiled op (the group torch.distributed already has);
    ``config``: ``offload_optimizer``, ``bf16`` (:func:`deepspeed_ds_config`).

    Taught in: Chapter 4, "DeepSpeed, run".
    """
    _cpu_accelerator_unless_cuda()
    import deepspeed
    import deepspeed.ops

    # No compiled op: DeepSpeed would JIT-build its CPU shared-memory all-reduce
    # (minutes on a laptop) before the first step; without it, torch.distributed.
    deepspeed.ops.__compatible_ops__ = {}
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer,
                                      config=deepspeed_ds_config(stage, micro_batch,
                                                                 **config),
                                      dist_init_required=False)
    return engine


def full_engine_state(engine: Any, stage: int) -> dict[str, torch.Tensor]:
    """Every parameter of the engine's module, full, by name (ZeRO-3: its
    partitions all-gathered: a collective on every rank).

    Taught in: Chapter 4, "DeepSpeed, run".
    """
    if stage < 3:
        return {n: p.detach().cpu().clone()
                for n, p in engine.module.named_parameters()}
    import deepspeed

    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params):  # all-gathers each partition
        return {n: p.detach().cpu().clone()
                for n, p in engine.module.named_parameters()}


class EngineStep:
    """The optimizer ``run_steps`` sees for DeepSpeed: ``step`` is ``engine.step()``
    (which clips, steps and zeroes the gradients), so ``zero_grad`` has nothing
    left to do."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def step(self) -> None:
        self.engine.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass  # engine.step() did


class DeepSpeedParallelism(Parallelism):
    """``deepspeed.initialize`` behind the one loop: ``apply`` returns the engine,
    backward is ``engine.backward(loss)``, the optimizer's step is ``engine.step()``.

    Args:
        stage: ZeRO stage 1-3 (the config's ``zero_optimization.stage``).
        micro_batch: rows per rank (the config's micro-batch).
        optimizer_class, optimizer_kwargs: the torch optimizer handed to DeepSpeed.
        config: ``offload_optimizer``, ``bf16`` (:func:`deepspeed_ds_config`).

    Taught in: Chapter 4, "DeepSpeed, run".
    """

    def __init__(self, stage: int, micro_batch: int, optimizer_class: type,
                 optimizer_kwargs: dict[str, Any], **config: bool) -> None:
        self.stage, self.micro_batch, self.config = stage, micro_batch, config
        self.optimizer_class, self.optimizer_kwargs = optimizer_class, optimizer_kwargs
        self.dp_size, self.dp_rank = dist.get_world_size(), dist.get_rank()
        self.name = f"deepspeed-{stage}"

    def apply(self, model: nn.Module) -> Any:
        opt = self.optimizer_class(model.parameters(), **self.optimizer_kwargs)
        return initialize_engine(model, self.stage, self.micro_batch, opt,
                                 **self.config)

    def make_optimizer(self, wrapped: Any, optimizer_class: type,
                       **kwargs: Any) -> Any:
        return EngineStep(wrapped)

    def gradients_held(self, wrapped: Any) -> list[torch.Tensor]:
        """The gradient buffers the engine holds between backward and its step
        (``engine.step()`` frees them; ``StateAfterStep`` notes them before)."""
        return _deepspeed_grads(wrapped)

    def state_bytes(self, wrapped: Any, optimizer: Any,
                    grads: Iterable[torch.Tensor] = ()) -> dict[str, int]:
        """Bytes of model states this rank holds, with ``grads`` the gradients
        held before the step (:func:`deepspeed_state_bytes`)."""
        return deepspeed_state_bytes(wrapped, grads)

    def local_batch(self, batch: Batch) -> Batch:
        return rows_of_rank(batch, self.dp_rank, self.dp_size)

    def check_accumulation(self, micro_batches: int) -> None:
        """DeepSpeed's engine accumulates itself: ``gradient_accumulation_steps``
        in its config decides when its ``step`` reduces and steps."""
        raise ValueError(
            f"gradient accumulation over {micro_batches} micro-batch(es) with "
            f"{self.name}: the DeepSpeed engine accumulates by its own config; "
            "allowed: the default step, with gradient_accumulation_steps in the "
            "engine's config")

    def forward_backward(self, wrapped: Any, batch: Batch, loss_fn: Any,
                         scale: float = 1.0, scaler: Any = None) -> torch.Tensor:
        loss = loss_fn(wrapped, *batch)
        wrapped.backward(loss * scale if scale != 1.0 else loss)
        return loss.detach()

    def full_state(self, wrapped: Any, grads: bool = False
                   ) -> dict[str, torch.Tensor]:
        if grads:
            raise ValueError("grads=True is not supported for DeepSpeed (its "
                             "partitions are its own); allowed: grads=False")
        return full_engine_state(wrapped, self.stage)
