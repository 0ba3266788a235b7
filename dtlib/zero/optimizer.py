"""A teaching ZeRO: stages 1, 2 and 3 over a padded flat view of the parameters.

Every rank runs the same model on its own slice of the batch (data parallelism); what
ZeRO changes is what each rank *keeps*. The parameters are split into units (one per
transformer block plus a root unit for the rest, see :mod:`dtlib.zero.flat_params`); each
unit's padded flat buffer is cut into ``world_size`` equal shards and rank ``r`` owns
shard ``r`` of every unit:

- stage 1: the optimizer states (AdamW's m and v) exist for the own shard only. The full
  gradient is still materialised on every rank; before the step it is reduce-scattered,
  so each rank gets the averaged gradient of its shard, updates it, and the updated
  shards are all-gathered back into the full parameters.
- stage 2: gradients are sharded too. A hook fires as each parameter's gradient is
  accumulated; when a unit (a bucket) is complete it is reduce-scattered at once and
  the full gradients of that unit are dropped.
- stage 3: parameters are sharded too (:mod:`dtlib.zero.stage3`): a unit is all-gathered just
  before its forward, freed after it, gathered again for its backward and freed again.

Per step, in the ZeRO paper's convention (:func:`zero_comm_elements`): stages 1-2 move
2 Psi elements (reduce-scatter + all-gather, the same as DDP's all-reduce), stage 3
3 Psi (two all-gathers and a reduce-scatter).

Taught in: Chapter 4, "ZeRO and FSDP".
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.distributed as dist
import torch.nn as nn

from dtlib.zero.stage3 import install_stage3_hooks
from dtlib.zero.units import Unit, free_flat
from dtlib.zero.flat_params import FlatLayout, assign_units, default_unit_modules

__all__ = ["ZeRO", "zero_comm_elements", "OPTIMIZERS"]

OPTIMIZERS = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam,
              "sgd": torch.optim.SGD}


class ZeRO(nn.Module):
    """A model and its optimizer, sharded across the ranks of ``group`` (ZeRO 1-3).

    Use it like a model plus an optimizer::

        zmodel = ZeRO(model, stage=2, lr=1e-3, weight_decay=0.1)
        for x, y in batches:                     # each rank: its slice of the batch
            out = zmodel(x)
            loss = loss_fn(out, y)
            loss.backward()                      # stage 2/3: gradients reduce-scattered
            zmodel.clip_grad_norm_(1.0)          # global norm across the shards
            zmodel.step()                        # AdamW on the own shard, gather
            zmodel.zero_grad()

    Every rank must build ``module`` with the same architecture; rank 0's initial
    values are broadcast. Gradients are averaged over the ranks, so the result equals
    single-process training on the concatenated batch.

    Args:
        module: the model (fp32 parameters).
        stage: 1 (optimizer states), 2 (+ gradients) or 3 (+ parameters).
        optimizer: ``"adamw"``, ``"adam"`` or ``"sgd"`` (torch's, run on the shard).
        group: the process group to shard over (default: the world).
        unit_modules: submodules sharded as separate units (default: the elements of
            each outermost ``nn.ModuleList``, e.g. transformer blocks).
        **optimizer_kwargs: passed to the optimizer (``lr``, ``weight_decay``, ...).

    Taught in: Chapter 4, "The three stages".
    """

    def __init__(self, module: nn.Module, stage: int, optimizer: str = "adamw",
                 group: Any = None, unit_modules: list[nn.Module] | None = None,
                 **optimizer_kwargs: Any) -> None:
        super().__init__()
        if stage not in (1, 2, 3):
            raise ValueError(f"stage={stage!r} is not supported; allowed: 1, 2, 3")
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer={optimizer!r} is not supported; allowed: "
                             f"{sorted(OPTIMIZERS)}")
        self.module = module
        self.stage = stage
        self.group = group
        self.distributed = dist.is_available() and dist.is_initialized()
        self.world_size = dist.get_world_size(group) if self.distributed else 1
        self.rank = dist.get_rank(group) if self.distributed else 0
        if unit_modules is None:
            unit_modules = default_unit_modules(module)
        self.units = [Unit(owner, names, params, self.world_size, self.rank)
                      for owner, names, params in assign_units(module, unit_modules)]
        if not self.units:
            raise ValueError("module has no parameters to shard")
        for unit in self.units:
            self._build(unit)
        self.optimizer = OPTIMIZERS[optimizer]([u.shard for u in self.units],
                                               **optimizer_kwargs)
        self._grads_reduced = False
        self._callback_queued = False
        if stage >= 2:
            for unit in self.units:
                for p in unit.params:
                    p.register_post_accumulate_grad_hook(self._grad_ready_hook(unit))
        if stage == 3:

            install_stage3_hooks(self)

    # ---- construction ------------------------------------------------------------
    def _build(self, unit: Unit) -> None:
        flat = unit.layout.flatten([p.detach() for p in unit.params])
        self._broadcast(flat)  # every rank starts from rank 0's values
        unit.flat_param = flat
        for p, view in zip(unit.params, unit.layout.views(flat)):
            p.data = view  # the module now reads its parameters from the flat buffer
        shard = flat[unit.lo:unit.hi]
        if self.stage == 3:
            shard = shard.clone()  # the shard owns its storage; the full buffer goes
        unit.shard = nn.Parameter(shard)  # shares storage with ``shard``
        if self.stage == 1:
            unit.flat_grad = torch.zeros_like(flat)
            unit.grad_shard = unit.flat_grad[unit.lo:unit.hi]
            self._attach_grad_views(unit)
        else:
            unit.grad_shard = torch.zeros_like(unit.shard)
        if self.stage == 3:
            free_flat(unit)

    def _attach_grad_views(self, unit: Unit) -> None:
        # Stage 1: autograd accumulates in place into a .grad that already exists,
        # so the gradients land directly in the unit's flat buffer.
        for p, view in zip(unit.params, unit.layout.views(unit.flat_grad)):
            if p.grad is None or p.grad.data_ptr() != view.data_ptr():
                p.grad = view

    # ---- collectives (through torch.distributed.X, so accounting can see them) -----
    def _broadcast(self, t: torch.Tensor) -> None:
        if self.world_size > 1:
            src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
            dist.broadcast(t, src=src, group=self.group)

    def _reduce_scatter_mean(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's shard of the average over ranks of ``flat`` (padded, 1-D)."""
        if self.world_size == 1:
            return flat.clone()
        out = torch.empty(flat.numel() // self.world_size, dtype=flat.dtype,
                          device=flat.device)
        dist.reduce_scatter_tensor(out, flat, group=self.group)
        return out.div_(self.world_size)

    def _all_gather(self, out: torch.Tensor, shard: torch.Tensor) -> None:
        if self.world_size == 1:
            out.copy_(shard)
        else:
            dist.all_gather_into_tensor(out, shard, group=self.group)

    # ---- forward / backward ---------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.stage == 1:
            for unit in self.units:
                self._attach_grad_views(unit)
        return self.module(*args, **kwargs)

    def _grad_ready_hook(self, unit: Unit):
        def hook(param: torch.Tensor) -> None:
            self._queue_end_of_backward()
            unit.ready += 1
            if unit.ready == len(unit.params):
                self._reduce_unit(unit)
        return hook

    def _queue_end_of_backward(self) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(
                self._end_of_backward)

    def _reduce_unit(self, unit: Unit) -> None:
        """Stages 2-3: reduce-scatter a complete bucket and drop its full gradients."""
        flat = unit.layout.flatten([p.grad for p in unit.params])
        for p in unit.params:
            p.grad = None  # the full gradient of this bucket is freed here
        unit.grad_shard.add_(self._reduce_scatter_mean(flat))
        unit.reduced = True
        if self.stage == 3:
            free_flat(unit)

    def _end_of_backward(self) -> None:
        # Units some of whose parameters got no gradient still take part (every rank
        # must issue the same collectives), with zeros for the missing gradients.
        for unit in self.units:
            if not unit.reduced:
                self._reduce_unit(unit)
            unit.ready, unit.reduced = 0, False
        self._callback_queued = False

    # ---- optimizer side -------------------------------------------------------------
    def _reduce_stage1(self) -> None:
        if self.stage == 1 and not self._grads_reduced:
            for unit in self.units:
                unit.grad_shard.copy_(self._reduce_scatter_mean(unit.flat_grad))
            self._grads_reduced = True

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale the gradients so their global L2 norm is at most ``max_norm``.

        Each rank holds a disjoint shard, so the squared norm is the all-reduced sum
        of the shards' squared norms (padding contributes zero).

        Returns:
            The total norm before clipping (the same on every rank).
        """
        if not max_norm > 0:
            raise ValueError(f"max_norm={max_norm!r} must be positive")
        self._reduce_stage1()
        device = self.units[0].grad_shard.device
        sq = sum((u.grad_shard.double().pow(2).sum() for u in self.units),
                 torch.zeros((), dtype=torch.float64, device=device))
        if self.world_size > 1:
            dist.all_reduce(sq, group=self.group)
        norm = sq.sqrt().float()
        coef = float(max_norm) / (float(norm) + 1e-6)
        if coef < 1.0:
            for u in self.units:
                u.grad_shard.mul_(coef)
        return norm

    @torch.no_grad()
    def step(self) -> None:
        """Update this rank's shard; stages 1-2 then all-gather the full parameters."""
        self._reduce_stage1()
        for unit in self.units:
            unit.shard.grad = unit.grad_shard
        self.optimizer.step()
        if self.stage < 3:
            for unit in self.units:
                # the all-gather writes into the buffer the shard lives in: send a copy
                self._all_gather(unit.flat_param, unit.shard.detach().clone())

    def zero_grad(self) -> None:
        """Zero the gradient buffers this rank keeps (they stay allocated)."""
        for unit in self.units:
            if unit.flat_grad is not None:
                unit.flat_grad.zero_()
            unit.grad_shard.zero_()
        self._grads_reduced = False

    # ---- inspection -----------------------------------------------------------------
    @property
    def n_params(self) -> int:
        """Psi: unique parameters of the model, without padding."""
        return sum(u.layout.numel for u in self.units)

    @property
    def padded_numel(self) -> int:
        """Psi rounded up unit by unit to multiples of the world size."""
        return sum(u.layout.padded_numel for u in self.units)

    def state_bytes(self) -> dict[str, int]:
        """Bytes of model states this rank holds now, counted by unique storage.

        Returns:
            ``{"params", "grads", "optimizer", "total"}``; the optimizer's step
            counters (a few bytes) are left out, as in the ZeRO paper's formula.
        """
        seen: set[int] = set()

        def size(tensors: Iterable[torch.Tensor | None]) -> int:
            total = 0
            for t in tensors:
                if t is None:
                    continue
                s = t.untyped_storage()
                if s.data_ptr() in seen or s.nbytes() == 0:
                    continue
                seen.add(s.data_ptr())
                total += s.nbytes()
            return total

        params = size([u.flat_param for u in self.units] +
                      [u.shard for u in self.units])
        grads = size([u.grad_shard for u in self.units] +
                     [u.flat_grad for u in self.units] +
                     [p.grad for u in self.units for p in u.params])
        optim = size(t for st in self.optimizer.state.values()
                     for k, t in st.items() if k != "step" and torch.is_tensor(t))
        return {"params": params, "grads": grads, "optimizer": optim,
                "total": params + grads + optim}

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter, full size, by name (a collective in stage 3: all ranks)."""
        out: dict[str, torch.Tensor] = {}
        for unit in self.units:
            flat = torch.empty(unit.layout.padded_numel, dtype=unit.shard.dtype,
                               device=unit.shard.device)
            self._all_gather(flat, unit.shard.detach())
            for name, view in zip(unit.layout.names, unit.layout.views(flat)):
                out[name] = view.clone()
        return out


ZERO_FACTORS = {"all_reduce": 2, "reduce_scatter": 1, "all_gather": 1}


def zero_comm_elements(log: Any, ops: Iterable[str] = tuple(ZERO_FACTORS)) -> int:
    """Communication volume in the ZeRO paper's convention, in elements.

    An all-reduce of Psi elements counts 2 Psi (it is a reduce-scatter plus an
    all-gather), a reduce-scatter of Psi (input) counts Psi, an all-gather producing Psi
    counts Psi. Other operations (broadcasts at start-up, barriers) are not counted.

    Args:
        log: a :func:`dtlib.collectives.accounting.count_comms` log, or its list of records.
        ops: which operations to count.
    Returns:
        The volume in elements.

    Taught in: Chapter 4, "Communication per step".
    """
    records = getattr(log, "records", log)
    return sum(ZERO_FACTORS[r.op] * r.numel for r in records
               if r.op in ZERO_FACTORS and r.op in ops)
