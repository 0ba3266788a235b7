"""What ZeRO's three stages share: a model's units, sharded, and their gradients.

:class:`ShardedUnits` cuts a model's trainable parameters into units (one per
transformer block plus a root unit, :mod:`dtlib.zero.flat_params`), lays each unit in a
padded flat buffer and gives rank ``r`` shard ``r`` of every unit (:class:`Unit`). It
owns the collectives all three stages use and the gradient side of stages 2 and 3:

- a post-accumulate-grad hook per parameter notes that it got a gradient on this rank;
  from stage 2 on, a unit whose gradients are complete is reduce-scattered at once (in
  one fixed order, the same on every rank) and its full gradients are dropped;
- at the end of backward, units some of whose parameters got no gradient here are
  reduce-scattered with zeros for them (every rank issues the same collectives);
- one all-reduce of one flag per parameter says which parameters got a gradient on
  *any* rank: the others are skipped by the optimizer, as ``torch.optim`` skips a
  parameter whose ``.grad`` is None on one process.

The stages are thin layers over it: :class:`dtlib.zero.optimizer.ShardedOptimizer`
(stages 1 and 2, the shape of torch's ``ZeroRedundancyOptimizer``) and
:class:`dtlib.zero.stage3.FullyShardedModule` (stage 3, the shape of FSDP2).

Taught in: Chapter 4, "The three stages".
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
import torch.nn as nn

from dtlib.collectives.algorithms import all_gather_into, reduce_scatter_into
from dtlib.zero.flat_params import assign_units, default_unit_modules
from dtlib.zero.units import Unit, free_flat

__all__ = ["ShardedUnits", "storage_bytes"]


def storage_bytes(tensors: Iterable[torch.Tensor | None], seen: set[int]) -> int:
    """Bytes of the distinct, non-empty storages behind ``tensors`` not in ``seen``.

    Adds the storages it counts to ``seen``, so that one call per role (parameters,
    gradients, optimizer state) counts a shared buffer once.

    Taught in: Chapter 4, "Memory, measured".
    """
    total = 0
    for t in tensors:
        if t is None or not torch.is_tensor(t):
            continue
        s = t.untyped_storage()
        if s.data_ptr() in seen or s.nbytes() == 0:
            continue
        seen.add(s.data_ptr())
        total += s.nbytes()
    return total


class ShardedUnits:
    """A model's trainable parameters as units sharded over ``group`` (ZeRO 1-3).

    Args:
        module: the model (built identically on every rank; rank 0's values are
            broadcast).
        stage: 1 (a full gradient buffer, reduced before the step), 2 (gradients
            reduce-scattered unit by unit in backward) or 3 (parameters sharded too).
        group: the process group (default: the world).
        unit_modules: submodules sharded as separate units (default: the elements of
            each outermost ``nn.ModuleList``).
        params: shard only these parameters of ``module`` (default: all of them).
        param_dtype: stage 3: the dtype parameters are all-gathered and computed in
            (None: the master dtype; the shards stay in it, Chapter 7).
        reduce_dtype: stage 3: the dtype gradients are reduce-scattered in (None:
            the dtype backward produced them in).

    Taught in: Chapter 4, "The three stages"; the dtypes: Chapter 7, "Mixed
    precision across ranks".
    """

    def __init__(self, module: nn.Module, stage: int, group: Any = None,
                 unit_modules: list[nn.Module] | None = None,
                 params: Iterable[nn.Parameter] | None = None,
                 param_dtype: torch.dtype | None = None,
                 reduce_dtype: torch.dtype | None = None) -> None:
        if stage not in (1, 2, 3):
            raise ValueError(f"stage={stage!r} is not supported; allowed: 1, 2, 3")
        if stage != 3 and (param_dtype, reduce_dtype) != (None, None):
            raise ValueError(f"param_dtype and reduce_dtype need stage=3, got "
                             f"stage={stage!r}")
        self.module, self.stage, self.group = module, stage, group
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype
        distributed = dist.is_available() and dist.is_initialized()
        self.world_size = dist.get_world_size(group) if distributed else 1
        self.rank = dist.get_rank(group) if distributed else 0
        if unit_modules is None:
            unit_modules = default_unit_modules(module)
        chosen = None if params is None else {id(p) for p in params}
        self.units = []
        for owner, names, ps in assign_units(module, unit_modules):
            keep = [i for i, p in enumerate(ps) if chosen is None or id(p) in chosen]
            if keep:
                self.units.append(Unit(len(self.units), owner,
                                       [names[i] for i in keep], [ps[i] for i in keep],
                                       self.world_size, self.rank))
        if not self.units:
            raise ValueError("module has no parameter with requires_grad=True to shard")
        # Frozen parameters stay whole on every rank (rank 0's values), unsharded.
        self.frozen = {n: p for n, p in module.named_parameters()
                       if not p.requires_grad and (chosen is None or id(p) in chosen)}
        for p in self.frozen.values():
            self.broadcast(p.data)
        for unit in self.units:
            self._build(unit)
        self._callback_queued = False
        self._next = len(self.units) - 1  # next unit to reduce-scatter (stages 2-3)
        self.hook_order: list[int] = []  # units as their gradients completed here
        self.reduce_order: list[int] = []  # units as reduce-scattered (every rank)
        #: called at the start of every backward, before any gradient arrives
        self.on_backward_start: Callable[[], None] = lambda: None
        #: called at the end of every backward, after the last reduce-scatter
        self.on_backward_end: Callable[[], None] = lambda: None
        for unit in self.units:
            for i, p in enumerate(unit.params):
                p.register_post_accumulate_grad_hook(self._grad_ready_hook(unit, i))

    # ---- construction ------------------------------------------------------------
    def _build(self, unit: Unit) -> None:
        flat = unit.layout.flatten([p.detach() for p in unit.params])
        self.broadcast(flat)  # every rank starts from rank 0's values
        unit.flat_param = flat
        shard = flat[unit.lo:unit.hi]
        # stage 3: the shard owns its storage, the full buffer goes
        unit.shard = shard.clone() if self.stage == 3 else shard
        if self.param_dtype not in (None, flat.dtype):
            # the master shard keeps its dtype; only the gathered buffer is 16-bit
            unit.flat_param = flat.to(self.param_dtype)
        unit.make_pieces()
        unit.point_at_full()  # the module now reads its parameters from the buffer
        if self.stage == 1:
            unit.flat_grad = torch.zeros_like(flat)
            unit.grad_shard = unit.flat_grad[unit.lo:unit.hi]
            self.attach_grad_views(unit)
        else:
            unit.grad_shard = torch.zeros_like(unit.shard)
        if self.stage == 3:
            free_flat(unit)
            unit.point_at_shard()

    def piece_groups(self, param_groups: list[dict[str, Any]]
                     ) -> list[dict[str, Any]]:
        """The user's parameter groups with each parameter replaced by its pieces.

        A frozen parameter, or one whose elements all sit on other ranks, has none.
        """
        pieces = {id(u.params[pc.index]): pc.param for u in self.units
                  for pc in u.pieces}
        known = {id(p) for p in self.module.parameters()}
        groups, seen = [], set()
        for i, g in enumerate(param_groups):
            if not isinstance(g, dict) or "params" not in g:
                raise ValueError(f"param_groups[{i}] must be a dict with a 'params' "
                                 "list")
            params = [g["params"]] if torch.is_tensor(g["params"]) \
                else list(g["params"])
            for p in params:
                if id(p) not in known:
                    raise ValueError(f"param_groups[{i}] has a parameter that is not "
                                     "in module")
                if id(p) in seen:
                    raise ValueError(f"param_groups[{i}] repeats a parameter of an "
                                     "earlier group; each may appear once")
                seen.add(id(p))
            groups.append({**g, "params": [pieces[id(p)] for p in params
                                           if id(p) in pieces]})
        return groups

    def attach_grad_views(self, unit: Unit) -> None:
        """Stage 1: point each ``.grad`` at the unit's flat gradient buffer, so that
        autograd accumulates in place into it (a ``.grad`` set elsewhere is copied)."""
        for p, view in zip(unit.params, unit.layout.views(unit.flat_grad)):
            if p.grad is None:
                p.grad = view
            elif p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad)
                p.grad = view

    # ---- collectives (through torch.distributed.X, so accounting can see them) -----
    def broadcast(self, t: torch.Tensor) -> None:
        """Rank 0's ``t`` on every rank of the group."""
        if self.world_size > 1:
            src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
            dist.broadcast(t, src=src, group=self.group)

    def reduce_scatter_mean(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's shard of the average over ranks of ``flat`` (padded, 1-D).

        In fp16 (largest value 65504) the sum of N gradients can overflow where
        their mean would not: as FSDP2 does, ``flat`` is divided by about sqrt(N)
        (a power of two, exact) before the sum and by the rest after it.
        """
        if self.world_size == 1:
            return flat.clone()
        out = torch.empty(flat.numel() // self.world_size, dtype=flat.dtype,
                          device=flat.device)
        pre = 1
        while flat.dtype == torch.float16 and self.world_size % (2 * pre) == 0 \
                and self.world_size / pre > pre:
            pre *= 2
        if pre > 1:
            flat = flat / pre
        reduce_scatter_into(out, flat, group=self.group)
        return out.div_(self.world_size // pre)

    def all_gather(self, out: torch.Tensor, shard: torch.Tensor) -> None:
        """Every rank's ``shard``, in rank order, into ``out``."""
        if self.world_size == 1:
            out.copy_(shard)
        else:
            all_gather_into(out, shard, group=self.group)

    def check_same_collective(self, op: str, unit: Unit) -> None:
        """Stage 3: raise on every rank, naming the units, if the ranks are about to
        run different collectives (a unit used on some ranks only)."""
        if self.world_size == 1:
            return
        codes = ("all-gather", "reduce-scatter")
        mine = torch.tensor([codes.index(op), unit.index], device=unit.shard.device)
        every = torch.empty(2 * self.world_size, dtype=mine.dtype, device=mine.device)
        all_gather_into(every, mine, group=self.group)
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

    # ---- backward -------------------------------------------------------------------
    def _grad_ready_hook(self, unit: Unit, index: int):
        def hook(param: torch.Tensor) -> None:
            self.queue_end_of_backward()
            unit.used[index] = True
            if self.stage == 1:
                return
            unit.ready += 1
            if unit.ready == len(unit.params):
                self.hook_order.append(unit.index)
                self._reduce_ready_units()
        return hook

    def queue_end_of_backward(self) -> None:
        """At a backward's first hook: start it, and queue its end-of-backward."""
        if not self._callback_queued:
            self._callback_queued = True
            self.hook_order, self.reduce_order = [], []
            self.on_backward_start()
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
            self.check_same_collective("reduce-scatter", unit)
        grads = [p.grad for p in unit.params]
        # in reduce_dtype, else in the dtype backward produced (param_dtype)
        dtype = self.reduce_dtype or next((g.dtype for g in grads if g is not None),
                                          None)
        flat = unit.layout.flatten(grads, dtype=dtype)
        for p in unit.params:
            p.grad = None  # the full gradient of this bucket is freed here
        unit.grad_shard.add_(self.reduce_scatter_mean(flat))
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
        self.on_backward_end()

    # ---- after backward --------------------------------------------------------------
    def reduce_stage1(self) -> None:
        """Stage 1: reduce-scatter each unit's full gradient buffer into its shard."""
        for unit in self.units:
            self.attach_grad_views(unit)
            unit.grad_shard.copy_(self.reduce_scatter_mean(unit.flat_grad))

    def used_anywhere(self) -> list[list[bool]]:
        """Per unit, per parameter: did any rank give it a gradient since the flags
        were last cleared? One all-reduce (max) of one flag per parameter tensor."""
        used = torch.tensor([u for unit in self.units for u in unit.used],
                            dtype=torch.int32, device=self.units[0].shard.device)
        if self.world_size > 1:
            dist.all_reduce(used, op=dist.ReduceOp.MAX, group=self.group)
        flags = iter(bool(u) for u in used.tolist())
        return [[next(flags) for _ in unit.params] for unit in self.units]

    def clear_grads(self) -> None:
        """Zero the gradient buffers (they stay allocated) and the usage flags."""
        for unit in self.units:
            if unit.flat_grad is not None:
                unit.flat_grad.zero_()
            unit.grad_shard.zero_()
            unit.used = [False] * len(unit.params)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale the gradient shards so their global L2 norm is at most ``max_norm``.

        Each rank holds a disjoint shard, so the squared norm is the all-reduced sum
        of the shards' squared norms (padding contributes zero).

        Returns:
            The total norm before clipping (the same on every rank).
        """
        if not max_norm > 0:
            raise ValueError(f"max_norm={max_norm!r} must be positive")
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

    # ---- full tensors, by name (collectives: every rank calls them) ------------------
    def _gather_by_name(self, shard_of: Callable[[Unit], torch.Tensor],
                        keep: Callable[[Unit, int], bool]) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for unit in self.units:
            shard = shard_of(unit).detach()
            flat = torch.empty(unit.layout.padded_numel, dtype=shard.dtype,
                               device=shard.device)
            self.all_gather(flat, shard)
            for i, (name, view) in enumerate(zip(unit.layout.names,
                                                 unit.layout.views(flat))):
                if keep(unit, i):
                    out[name] = view.clone()
        return out

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter, full size, by name (frozen ones included)."""
        out = self._gather_by_name(lambda u: u.shard, lambda u, i: True)
        out.update({n: p.detach().clone() for n, p in self.frozen.items()})
        return out

    def full_gradients(self) -> dict[str, torch.Tensor]:
        """The averaged gradient of every parameter that got one on some rank, full
        size, by name (stage 1: the gradients must be reduced first)."""
        used = self.used_anywhere()
        return self._gather_by_name(lambda u: u.grad_shard,
                                    lambda u, i: used[u.index][i])

    # ---- inspection -----------------------------------------------------------------
    @property
    def n_params(self) -> int:
        """Psi: unique trainable parameters, without padding."""
        return sum(u.layout.numel for u in self.units)

    @property
    def padded_numel(self) -> int:
        """Psi rounded up unit by unit to multiples of the world size."""
        return sum(u.layout.padded_numel for u in self.units)

    def state_bytes(self, optimizer: Any = None) -> dict[str, int]:
        """Bytes of model states this rank holds now, counted by unique storage.

        Args:
            optimizer: whose state to count (its step counters, a few bytes, are
                left out, as in the ZeRO paper's formula); None: no optimizer.
        Returns:
            ``{"params", "grads", "optimizer", "total"}``.
        """
        seen: set[int] = set()
        params = storage_bytes([u.flat_param for u in self.units] +
                               [u.shard for u in self.units] +
                               list(self.frozen.values()), seen)
        grads = storage_bytes([u.grad_shard for u in self.units] +
                              [u.flat_grad for u in self.units] +
                              [p.grad for u in self.units for p in u.params] +
                              [pc.param.grad for u in self.units for pc in u.pieces],
                              seen)
        state = optimizer.state.values() if optimizer is not None else []
        optim = storage_bytes((t for st in state for k, t in st.items()
                               if k != "step"), seen)
        return {"params": params, "grads": grads, "optimizer": optim,
                "total": params + grads + optim}
