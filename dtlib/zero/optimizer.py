"""ZeRO stages 1 and 2: a sharded optimizer over any ``torch.optim`` class.

Every rank runs the same model on its own slice of the batch (data parallelism); what
ZeRO changes is what each rank *keeps*. :class:`ShardedOptimizer` has the shape of
torch's ``ZeroRedundancyOptimizer(params, optimizer_class, **kwargs)``: the model
stays a plain module with full parameters, and the optimizer shards itself. The
parameters are split into units (:class:`dtlib.zero.shards.ShardedUnits`); rank ``r``
owns shard ``r`` of every unit, and the wrapped ``optimizer_class`` (AdamW, SGD, ...)
exists for the parameters' *pieces* inside that shard only:

- stage 1: the optimizer states exist for the own shard only. The full gradient is
  still materialised on every rank; ``step()`` reduce-scatters it, so each rank gets
  the averaged gradient of its shard, updates it, and all-gathers the updated shards
  back into the full parameters.
- stage 2: gradients are sharded too. A hook fires as each parameter's gradient is
  accumulated; when a unit (a bucket) is complete it is reduce-scattered at once and
  the full gradients of that unit are dropped.

Stage 3 shards the parameters too and is a module wrapper instead
(:class:`dtlib.zero.stage3.FullyShardedModule`). Per step, in the ZeRO paper's
convention (:func:`zero_comm_elements`): stages 1-2 move 2 Psi elements (reduce-scatter
+ all-gather, the same as DDP's all-reduce), stage 3 3 Psi.

Taught in: Chapter 4, "ZeRO and FSDP".
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.nn as nn

from dtlib.zero.shards import ShardedUnits

__all__ = ["ShardedOptimizer", "zero_comm_elements", "no_decay_groups"]


def _as_groups(params: Iterable[Any]) -> list[dict[str, Any]]:
    """torch's two spellings (parameters, or groups of them) as a list of groups."""
    params = list(params)
    if not params:
        raise ValueError("params is empty; pass the model's parameters or groups")
    if all(isinstance(p, dict) for p in params):
        return params
    if any(isinstance(p, dict) for p in params):
        raise ValueError("params mixes parameters and parameter groups; pass one kind")
    return [{"params": params}]


class ShardedOptimizer(torch.optim.Optimizer):
    """``optimizer_class`` on this rank's shard of every unit: ZeRO stage 1 or 2.

    Used like ``torch.distributed.optim.ZeroRedundancyOptimizer``::

        opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=2,
                               module=model, lr=1e-3, weight_decay=0.1)
        loss_fn(model(x), y).backward()   # x: this rank's rows; stage 2: hooks
        opt.clip_grad_norm_(1.0)          # the global norm across the shards
        opt.step()                        # the own pieces, then all-gather
        opt.zero_grad()

    Every rank must build the model identically; rank 0's initial values are
    broadcast. Gradients are averaged over the ranks, so the result equals one process
    on the concatenated batch, with torch's semantics: a parameter that got no
    gradient on any rank this step is not updated, frozen parameters
    (``requires_grad=False``) are neither sharded nor optimized, and parameter groups
    work as in ``optimizer_class(param_groups)``.

    Args:
        params: the model's parameters, or parameter groups
            (``[{"params": [...], "weight_decay": 0.0}, ...]``, see
            :func:`no_decay_groups`).
        optimizer_class: any ``torch.optim.Optimizer`` class; it runs on the pieces.
        stage: 1 (optimizer states) or 2 (+ gradients).
        group: the process group to shard over (default: the world).
        module: the model the parameters belong to: gives the units (one per block)
            and the names; default: all of ``params`` as one unit.
        unit_modules: submodules of ``module`` sharded as separate units (default:
            the elements of each outermost ``nn.ModuleList``).
        **kwargs: ``optimizer_class``'s defaults (``lr``, ``weight_decay``, ...).

    Taught in: Chapter 4, "The three stages".
    """

    def __init__(self, params: Iterable[Any], optimizer_class: type, *,
                 stage: int = 1, group: Any = None, module: nn.Module | None = None,
                 unit_modules: list[nn.Module] | None = None, **kwargs: Any) -> None:
        if stage not in (1, 2):
            raise ValueError(f"stage={stage!r} is not supported here; allowed: 1, 2 "
                             "(stage 3 is FullyShardedModule)")
        if not (isinstance(optimizer_class, type)
                and issubclass(optimizer_class, torch.optim.Optimizer)):
            raise ValueError(f"optimizer_class={optimizer_class!r} must be a "
                             "torch.optim.Optimizer class, e.g. torch.optim.AdamW")
        groups = _as_groups(params)
        listed = [p for g in groups for p in
                  ([g["params"]] if torch.is_tensor(g["params"]) else g["params"])]
        if module is None:  # one unit of every listed parameter, named by position
            module, unit_modules = nn.ParameterList(listed), []
        self.units = ShardedUnits(module, stage, group, unit_modules, params=listed)
        self.stage = stage
        self.optim = optimizer_class(self.units.piece_groups(groups), **kwargs)
        super().__init__([pc.param for u in self.units.units for pc in u.pieces]
                         or [torch.zeros(0, requires_grad=True)], self.optim.defaults)
        # One set of groups and state: the inner optimizer's (schedulers change lr).
        self.param_groups = self.optim.param_groups
        self.state = self.optim.state
        self._grads_reduced = False

    def _reduce(self) -> None:
        if self.stage == 1 and not self._grads_reduced:
            self.units.reduce_stage1()
        self._grads_reduced = True

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale the gradients so their global L2 norm is at most ``max_norm``.

        Returns:
            The total norm before clipping (the same on every rank).
        """
        self._reduce()
        return self.units.clip_grad_norm_(max_norm)

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        """Update this rank's pieces, then all-gather the full parameters.

        A piece whose parameter got no gradient on any rank keeps ``.grad = None``,
        so the optimizer skips it (no weight decay, no moment update).
        """
        if closure is not None:
            raise ValueError("closure is not supported; allowed: None")
        self._reduce()
        used = self.units.used_anywhere()
        for unit in self.units.units:
            for pc in unit.pieces:
                pc.param.grad = unit.grad_shard[pc.lo:pc.hi] \
                    if used[unit.index][pc.index] else None
        self.optim.step()
        for unit in self.units.units:
            for pc in unit.pieces:
                pc.param.grad = None
            # the all-gather writes into the buffer the shard lives in: send a copy
            self.units.all_gather(unit.flat_param, unit.shard.clone())

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradient buffers (they stay allocated: stage 1 accumulates into
        its flat buffer, stage 2 into its shards), whatever ``set_to_none`` says."""
        self.units.clear_grads()
        self._grads_reduced = False

    def full_gradients(self) -> dict[str, torch.Tensor]:
        """The averaged gradients, full size, by name (collective: every rank)."""
        self._reduce()
        return self.units.full_gradients()

    def state_dict(self) -> dict[str, Any]:
        """This rank's optimizer state (its pieces' state): save one per rank."""
        return self.optim.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load what :meth:`state_dict` saved on this rank (same world size)."""
        self.optim.load_state_dict(state_dict)
        self.param_groups, self.state = self.optim.param_groups, self.optim.state

    def state_bytes(self) -> dict[str, int]:
        """Bytes of model states this rank holds (parameters, gradients, optimizer).

        Returns:
            ``{"params", "grads", "optimizer", "total"}``, unique storages.
        """
        return self.units.state_bytes(self.optim)


def no_decay_groups(module: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Parameter groups without weight decay on biases and norms (1-D parameters).

    The usual transformer recipe: matrices and embeddings decay, biases and
    LayerNorm/RMSNorm weights do not. Frozen parameters are left out. On a
    :class:`~dtlib.zero.stage3.FullyShardedModule` the pieces are judged by their
    full parameter's shape.

    Args:
        module: the model (or a stage-3 wrapper).
        weight_decay: the decay of the matrices' group.
    Returns:
        ``[{"params": matrices, "weight_decay": weight_decay},
        {"params": vectors, "weight_decay": 0.0}]``, for any torch optimizer or
        :class:`ShardedOptimizer`.

    Taught in: Chapter 4, "Parameter groups".
    """
    trainable = [p for p in module.parameters() if p.requires_grad]

    def ndim(p: torch.Tensor) -> int:
        return len(getattr(p, "full_shape", p.shape))

    return [{"params": [p for p in trainable if ndim(p) >= 2],
             "weight_decay": weight_decay},
            {"params": [p for p in trainable if ndim(p) < 2], "weight_decay": 0.0}]


ZERO_FACTORS = {"all_reduce": 2, "reduce_scatter": 1, "all_gather": 1}


def zero_comm_elements(log: Any, ops: Iterable[str] = tuple(ZERO_FACTORS)) -> int:
    """Communication volume in the ZeRO paper's convention, in elements.

    An all-reduce of Psi elements counts 2 Psi (it is a reduce-scatter plus an
    all-gather), a reduce-scatter of Psi (input) counts Psi, an all-gather producing Psi
    counts Psi. Other operations (broadcasts at start-up, barriers) are not counted.

    Args:
        log: a :func:`dtlib.collectives.accounting.count_comms` log, or its list of
            records.
        ops: which operations to count.
    Returns:
        The volume in elements.

    Taught in: Chapter 4, "Communication per step".
    """
    records = getattr(log, "records", log)
    return sum(ZERO_FACTORS[r.op] * r.numel for r in records
               if r.op in ZERO_FACTORS and r.op in ops)
