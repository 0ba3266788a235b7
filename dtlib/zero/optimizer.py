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

import contextlib
from typing import Any, Iterable, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn

from dtlib.zero.stage3 import gather_flat, install_stage3_hooks
from dtlib.zero.units import Unit, free_flat
from dtlib.zero.flat_params import FlatLayout, assign_units, default_unit_modules

__all__ = ["ZeRO", "zero_comm_elements", "OPTIMIZERS", "no_decay_groups"]

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
    single-process training on the concatenated batch, with torch's semantics: a
    parameter that got no gradient on any rank this step is not updated, frozen
    parameters (``requires_grad=False``) are neither sharded nor optimized, and
    ``param_groups`` work as in ``torch.optim.AdamW(param_groups)``.

    Args:
        module: the model (fp32 parameters).
        stage: 1 (optimizer states), 2 (+ gradients) or 3 (+ parameters).
        optimizer: ``"adamw"``, ``"adam"`` or ``"sgd"`` (torch's, run on the shard).
        group: the process group to shard over (default: the world).
        unit_modules: submodules sharded as separate units (default: the elements of
            each outermost ``nn.ModuleList``, e.g. transformer blocks).
        param_groups: ``[{"params": [...], "weight_decay": 0.0, ...}, ...]`` over
            ``module``'s parameters, as for a torch optimizer (default: one group of
            every trainable parameter); see :func:`no_decay_groups`.
        **optimizer_kwargs: defaults for every group (``lr``, ``weight_decay``, ...).

    Taught in: Chapter 4, "The three stages".
    """

    def __init__(self, module: nn.Module, stage: int, optimizer: str = "adamw",
                 group: Any = None, unit_modules: list[nn.Module] | None = None,
                 param_groups: list[dict[str, Any]] | None = None,
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
        self.units = [Unit(i, owner, names, params, self.world_size, self.rank)
                      for i, (owner, names, params)
                      in enumerate(assign_units(module, unit_modules))]
        if not self.units:
            raise ValueError("module has no parameter with requires_grad=True to shard")
        # Frozen parameters stay whole on every rank (rank 0's values), unsharded.
        self.frozen = {n: p for n, p in module.named_parameters() if not p.requires_grad}
        for p in self.frozen.values():
            self._broadcast(p.data)
        for unit in self.units:
            self._build(unit)
        self.optimizer = OPTIMIZERS[optimizer](self._piece_groups(param_groups),
                                               **optimizer_kwargs)
        self._grads_reduced = False
        self._callback_queued = False
        self._next = len(self.units) - 1  # next unit to reduce-scatter (stages 2-3)
        self.hook_order: list[int] = []  # units as their gradients completed here
        self.reduce_order: list[int] = []  # units as reduce-scattered (every rank)
        for unit in self.units:
            for i, p in enumerate(unit.params):
                p.register_post_accumulate_grad_hook(self._grad_ready_hook(unit, i))
        if stage == 3:
            install_stage3_hooks(self)

    # ---- construction ------------------------------------------------------------
    def _build(self, unit: Unit) -> None:
        flat = unit.layout.flatten([p.detach() for p in unit.params])
        self._broadcast(flat)  # every rank starts from rank 0's values
        unit.flat_param = flat
        shard = flat[unit.lo:unit.hi]
        # stage 3: the shard owns its storage, the full buffer goes
        unit.shard = shard.clone() if self.stage == 3 else shard
        unit.make_pieces()
        unit.point_at_full()  # the module now reads its parameters from the buffer
        if self.stage == 1:
            unit.flat_grad = torch.zeros_like(flat)
            unit.grad_shard = unit.flat_grad[unit.lo:unit.hi]
            self._attach_grad_views(unit)
        else:
            unit.grad_shard = torch.zeros_like(unit.shard)
        if self.stage == 3:
            free_flat(unit)
            unit.point_at_shard()

    def _piece_groups(self, param_groups: list[dict[str, Any]] | None
                      ) -> list[dict[str, Any]]:
        """The user's parameter groups with each parameter replaced by its pieces."""
        pieces = {id(u.params[pc.index]): pc.param for u in self.units for pc in u.pieces}
        known = {id(p) for p in self.module.parameters()}
        if param_groups is None:
            param_groups = [{"params": [p for u in self.units for p in u.params]}]
        groups, seen = [], set()
        for i, g in enumerate(param_groups):
            if not isinstance(g, dict) or "params" not in g:
                raise ValueError(f"param_groups[{i}] must be a dict with a 'params' "
                                 "list")
            params = [g["params"]] if torch.is_tensor(g["params"]) else list(g["params"])
            for p in params:
                if id(p) not in known:
                    raise ValueError(f"param_groups[{i}] has a parameter that is not "
                                     "in module")
                if id(p) in seen:
                    raise ValueError(f"param_groups[{i}] repeats a parameter of an "
                                     "earlier group; each may appear once")
                seen.add(id(p))
            # a frozen parameter, or one whose elements all sit on other ranks: none
            groups.append({**g, "params": [pieces[id(p)] for p in params
                                           if id(p) in pieces]})
        return groups

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

    def _check_same_collective(self, op: str, unit: Unit) -> None:
        """Stage 3: raise on every rank, naming the units, if the ranks are about to
        run different collectives (a unit used on some ranks only)."""
        if self.world_size == 1:
            return
        codes = ("all-gather", "reduce-scatter")
        mine = torch.tensor([codes.index(op), unit.index], device=unit.shard.device)
        every = torch.empty(2 * self.world_size, dtype=mine.dtype, device=mine.device)
        dist.all_gather_into_tensor(every, mine, group=self.group)
        pairs = every.view(self.world_size, 2).tolist()
        if any(pair != pairs[0] for pair in pairs):
            what = "; ".join(f"rank {r} would {codes[o]} {self.units[i].label}"
                             for r, (o, i) in enumerate(pairs))
            raise RuntimeError(
                f"ZeRO-3: the ranks disagree on the next collective: {what}. A unit "
                "used on some ranks only (a data-dependent branch, an MoE expert "
                "without tokens) cannot be gathered on demand: run it on every rank, "
                "leave it out of unit_modules (it joins the root unit, gathered for "
                "the whole forward), or use stage 1 or 2.")

    # ---- forward / backward ---------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.stage == 1:
            for unit in self.units:
                self._attach_grad_views(unit)
        return self.module(*args, **kwargs)

    def _grad_ready_hook(self, unit: Unit, index: int):
        def hook(param: torch.Tensor) -> None:
            self._queue_end_of_backward()
            unit.used[index] = True
            if self.stage == 1:
                return
            unit.ready += 1
            if unit.ready == len(unit.params):
                self.hook_order.append(unit.index)
                self._reduce_ready_units()
        return hook

    def _queue_end_of_backward(self) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            self.hook_order, self.reduce_order = [], []
            torch.autograd.Variable._execution_engine.queue_callback(
                self._end_of_backward)

    def _reduce_ready_units(self) -> None:
        """Reduce-scatter complete units in one fixed order, the same on every rank.

        The order is the unit index, descending (the order backward usually completes
        them). Completion order differs between ranks when a unit is unused on some
        of them; launching in completion order would then pair different units in one
        reduce-scatter, as DataParallel's overlapped buckets avoid too.
        """
        while self._next >= 0 and \
                self.units[self._next].ready == len(self.units[self._next].params):
            self._reduce_unit(self.units[self._next])
            self._next -= 1

    def _reduce_unit(self, unit: Unit) -> None:
        """Stages 2-3: reduce-scatter a complete bucket and drop its full gradients."""
        if self.stage == 3:
            self._check_same_collective("reduce-scatter", unit)
        flat = unit.layout.flatten([p.grad for p in unit.params])
        for p in unit.params:
            p.grad = None  # the full gradient of this bucket is freed here
        unit.grad_shard.add_(self._reduce_scatter_mean(flat))
        self.reduce_order.append(unit.index)
        if self.stage == 3:
            free_flat(unit)

    def _end_of_backward(self) -> None:
        # Units some of whose parameters got no gradient on this rank still take part
        # (every rank must issue the same collectives), with zeros for the missing
        # gradients, in the same fixed order.
        if self.stage >= 2:
            while self._next >= 0:
                self._reduce_unit(self.units[self._next])
                self._next -= 1
            self._next = len(self.units) - 1
        for unit in self.units:
            unit.ready = 0
            if self.stage == 3:
                unit.point_at_shard()
        self._callback_queued = False

    # ---- optimizer side -------------------------------------------------------------
    def _reduce_stage1(self) -> None:
        if self.stage == 1 and not self._grads_reduced:
            for unit in self.units:
                unit.grad_shard.copy_(self._reduce_scatter_mean(unit.flat_grad))
            self._grads_reduced = True

    def _used_anywhere(self) -> list[bool]:
        """Per parameter (units in order): did any rank give it a gradient this step?

        One all-reduce (max) of one flag per parameter tensor.
        """
        used = torch.tensor([u for unit in self.units for u in unit.used],
                            dtype=torch.int32, device=self.units[0].shard.device)
        if self.world_size > 1:
            dist.all_reduce(used, op=dist.ReduceOp.MAX, group=self.group)
        return [bool(u) for u in used.tolist()]

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
        """Update this rank's pieces; stages 1-2 then all-gather the full parameters.

        A piece whose parameter got no gradient on any rank keeps ``.grad = None``,
        so the optimizer skips it (no weight decay, no moment update).
        """
        self._reduce_stage1()
        used = iter(self._used_anywhere())
        for unit in self.units:
            flags = [next(used) for _ in unit.params]
            for pc in unit.pieces:
                pc.param.grad = unit.grad_shard[pc.lo:pc.hi] if flags[pc.index] else None
        self.optimizer.step()
        for unit in self.units:
            for pc in unit.pieces:
                pc.param.grad = None
            if self.stage < 3:
                # the all-gather writes into the buffer the shard lives in: send a copy
                self._all_gather(unit.flat_param, unit.shard.clone())

    def zero_grad(self) -> None:
        """Zero the gradient buffers this rank keeps (they stay allocated)."""
        for unit in self.units:
            if unit.flat_grad is not None:
                unit.flat_grad.zero_()
            unit.grad_shard.zero_()
            unit.used = [False] * len(unit.params)
        self._grads_reduced = False

    # ---- the module's own face: full parameters on demand (stage 3) ---------------
    @contextlib.contextmanager
    def summon_full_params(self, writeback: bool = False) -> Iterator[None]:
        """Inside: every module parameter is full size (stage 3: all-gathered, a
        collective every rank must enter). With ``writeback`` changes made inside
        are copied back into the shards.

        Taught in: Chapter 4, ZeRO-3.
        """
        if self.stage < 3:  # the parameters are always full views of the buffers
            yield
            return
        for unit in self.units:
            gather_flat(self, unit)
        try:
            yield
        finally:
            for unit in self.units:
                if writeback:
                    unit.shard.copy_(unit.flat_param[unit.lo:unit.hi])
                free_flat(unit)
                unit.point_at_shard()

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The module's full state dict (stage 3: gathered, on every rank)."""
        if self.stage < 3:
            return super().state_dict(*args, **kwargs)
        with torch.no_grad(), self.summon_full_params():
            sd = super().state_dict(*args, **kwargs)
            for k, v in sd.items():
                if torch.is_tensor(v):
                    sd[k] = v.detach().clone()  # the gathered buffers are freed next
        return sd

    def load_state_dict(self, state_dict: Any, strict: bool = True,
                        assign: bool = False) -> Any:
        """Load a full state dict (stage 3: each rank keeps its shard of it)."""
        if assign:
            raise ValueError("assign=True would replace the sharded parameters; "
                             "allowed: assign=False")
        with torch.no_grad(), self.summon_full_params(writeback=True):
            return super().load_state_dict(state_dict, strict=strict)

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
                      [u.shard for u in self.units] + list(self.frozen.values()))
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
        for name, p in self.frozen.items():
            out[name] = p.detach().clone()
        return out


def no_decay_groups(module: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Parameter groups without weight decay on biases and norms (1-D parameters).

    The usual transformer recipe: matrices and embeddings decay, biases and
    LayerNorm/RMSNorm weights do not. Frozen parameters are left out.

    Args:
        module: the model.
        weight_decay: the decay of the matrices' group.
    Returns:
        ``[{"params": matrices, "weight_decay": weight_decay},
        {"params": vectors, "weight_decay": 0.0}]``, for ``torch.optim.AdamW`` or
        :class:`ZeRO`'s ``param_groups``.

    Taught in: Chapter 4, "Parameter groups".
    """
    trainable = [p for p in module.parameters() if p.requires_grad]
    return [{"params": [p for p in trainable if p.dim() >= 2],
             "weight_decay": weight_decay},
            {"params": [p for p in trainable if p.dim() < 2], "weight_decay": 0.0}]


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
