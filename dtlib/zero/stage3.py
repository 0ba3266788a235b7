"""ZeRO stage 3: a module whose parameters are this rank's shards (the shape of FSDP2).

:class:`FullyShardedModule` wraps a model. Between steps each rank holds
``1 / world_size`` of every unit's parameters, and ``parameters()`` yields exactly
those shards (one piece per parameter that overlaps this rank's shard), so any torch
optimizer built on ``model.parameters()`` steps them. After backward each piece's
``.grad`` holds its averaged gradient shard. Hooks make the full parameters exist
exactly when they are needed:

- before a unit's forward (module pre-forward hook): all-gather its flat buffer;
- after its forward (module forward hook): free the buffer, and hang a hook on the
  unit's outputs;
- when the gradient of those outputs arrives (the unit's backward is next): all-gather
  again;
- when all of the unit's parameter gradients are accumulated (post-accumulate-grad
  hooks, :class:`dtlib.zero.shards.ShardedUnits`): reduce-scatter them and free the
  buffer.

Freeing resizes the buffer's storage to zero bytes, so the parameter views (and the
tensors autograd saved for backward) keep their shapes and see the data again once the
storage is refilled. That is how FSDP1's flat parameters worked, and why stage 3 moves
3 Psi elements per step: two all-gathers of Psi and a reduce-scatter of Psi.

A view of zero bytes must never be read (printing it reads freed memory), so while a
unit is freed its module parameters point at this rank's pieces instead
(:meth:`Unit.point_at_shard`, FSDP1's ``use_orig_params`` did the same) and back at the
full views just before forward or backward needs them.

Every rank must issue the same collectives in the same order. A unit that runs on some
ranks only (a data-dependent branch, an MoE expert with no tokens) breaks that, so each
stage-3 collective is preceded by a tiny all-gather of (operation, unit) that turns a
mismatch into an error naming the units on every rank, instead of a hang.

Taught in: Chapter 4, ZeRO-3.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.nn as nn

from dtlib.zero.shards import ShardedUnits
from dtlib.zero.units import Unit, free_flat

__all__ = ["FullyShardedModule", "gather_flat", "install_stage3_hooks"]


def gather_flat(units: ShardedUnits, unit: Unit) -> None:
    """Refill the unit's full buffer from every rank's shard (all-gather) and point
    the module parameters at it."""
    if not unit.gathered:
        units.check_same_collective("all-gather", unit)
        flat = unit.flat_param
        flat.untyped_storage().resize_(flat.numel() * flat.element_size())
        units.all_gather(flat, unit.shard.detach())
        unit.gathered = True
    unit.point_at_full()


def _tensors(out: Any) -> list[torch.Tensor]:
    if torch.is_tensor(out):
        return [out]
    if isinstance(out, (list, tuple)):
        return [t for item in out for t in _tensors(item)]
    if isinstance(out, dict):
        return [t for item in out.values() for t in _tensors(item)]
    return []


def install_stage3_hooks(units: ShardedUnits) -> None:
    """Register the gather/free hooks of every unit of ``units`` (see module doc).

    Taught in: Chapter 4, ZeRO-3.
    """

    for unit in units.units:
        def pre_forward(module: Any, args: Any, unit: Unit = unit) -> None:
            gather_flat(units, unit)

        def post_forward(module: Any, args: Any, out: Any,
                         unit: Unit = unit) -> None:
            needs_grad = [t for t in _tensors(out) if t.requires_grad]
            if needs_grad and torch.is_grad_enabled():
                def pre_backward(grad: torch.Tensor) -> None:
                    units.queue_end_of_backward()
                    gather_flat(units, unit)

                for t in needs_grad:
                    t.register_hook(pre_backward)
            free_flat(unit)
            unit.point_at_shard()  # pre_backward points them back before use

        unit.owner.register_forward_pre_hook(pre_forward)
        unit.owner.register_forward_hook(post_forward)


class FullyShardedModule(nn.Module):
    """``module`` sharded over ``group``: ZeRO stage 3, used like FSDP2's
    ``fully_shard``::

        model = FullyShardedModule(model)            # each block a unit, then the root
        opt = torch.optim.AdamW(model.parameters())  # this rank's shards only
        loss_fn(model(x), y).backward()              # gather, free, reduce-scatter
        model.clip_grad_norm_(1.0)                   # global norm across the shards
        opt.step(); opt.zero_grad()

    ``named_parameters()`` yields ``(name, piece)``: the part of parameter ``name``
    inside this rank's shard, 1-D, with the full parameter's shape in
    ``piece.full_shape``; a parameter with no element on this rank is left out. After
    backward, ``piece.grad`` is the gradient averaged over the ranks; a parameter that
    got no gradient on any rank keeps ``.grad = None`` (the optimizer skips it, as on
    one process). Frozen parameters stay whole on every rank and are not yielded.

    Args:
        module: the model, built identically on every rank (rank 0's values win).
        group: the process group to shard over (default: the world).
        unit_modules: submodules gathered as separate units (default: the elements
            of each outermost ``nn.ModuleList``, e.g. transformer blocks).

    Taught in: Chapter 4, ZeRO-3.
    """

    def __init__(self, module: nn.Module, group: Any = None,
                 unit_modules: list[nn.Module] | None = None) -> None:
        super().__init__()
        self.module = module
        self.units = ShardedUnits(module, 3, group, unit_modules)
        self._pieces = [(name, pc.param) for u in self.units.units
                        for pc in u.pieces
                        for name in [u.layout.names[pc.index]]]
        for u in self.units.units:
            for pc in u.pieces:
                pc.param.full_shape = u.layout.shapes[pc.index]
        self.units.on_backward_start = self._backward_start
        self.units.on_backward_end = self._backward_end
        install_stage3_hooks(self.units)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True
                         ) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's pieces, by their full parameter's name."""
        for name, piece in self._pieces:
            yield (f"{prefix}.{name}" if prefix else name), piece

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        """This rank's pieces: what a torch optimizer should step."""
        for _, piece in self._pieces:
            yield piece

    # ---- gradients ------------------------------------------------------------------
    def _backward_start(self) -> None:
        # A new step (the optimizer's zero_grad set the pieces' grads to None):
        # start the gradient shards and usage flags from zero; otherwise accumulate.
        if all(p.grad is None for _, p in self._pieces):
            self.units.clear_grads()

    def _backward_end(self) -> None:
        used = self.units.used_anywhere()
        for unit in self.units.units:
            for pc in unit.pieces:
                pc.param.grad = unit.grad_shard[pc.lo:pc.hi] \
                    if used[unit.index][pc.index] else None

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale the gradients so their global L2 norm is at most ``max_norm``.

        Returns:
            The total norm before clipping (the same on every rank).
        """
        return self.units.clip_grad_norm_(max_norm)

    # ---- full parameters on demand ---------------------------------------------------
    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter, full size, by name (a collective: every rank calls it)."""
        return self.units.full_parameters()

    def full_gradients(self) -> dict[str, torch.Tensor]:
        """Every averaged gradient, full size, by name (a collective)."""
        return self.units.full_gradients()

    @contextlib.contextmanager
    def summon_full_params(self, writeback: bool = False) -> Iterator[None]:
        """Inside: every module parameter is full size (all-gathered, a collective
        every rank must enter). With ``writeback`` changes made inside are copied
        back into the shards.

        Taught in: Chapter 4, ZeRO-3.
        """
        for unit in self.units.units:
            gather_flat(self.units, unit)
        try:
            yield
        finally:
            for unit in self.units.units:
                if writeback:
                    unit.shard.copy_(unit.flat_param[unit.lo:unit.hi])
                free_flat(unit)
                unit.point_at_shard()

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The inner module's full state dict (gathered, on every rank)."""
        with torch.no_grad(), self.summon_full_params():
            sd = self.module.state_dict(*args, **kwargs)
            for k, v in sd.items():
                if torch.is_tensor(v):
                    sd[k] = v.detach().clone()  # the gathered buffers are freed next
        return sd

    def load_state_dict(self, state_dict: Any, strict: bool = True,
                        assign: bool = False) -> Any:
        """Load a full state dict of the inner module (each rank keeps its shard)."""
        if assign:
            raise ValueError("assign=True would replace the sharded parameters; "
                             "allowed: assign=False")
        with torch.no_grad(), self.summon_full_params(writeback=True):
            return self.module.load_state_dict(state_dict, strict=strict)

    def state_bytes(self, optimizer: Any = None) -> dict[str, int]:
        """Bytes of model states this rank holds, with ``optimizer``'s state.

        Returns:
            ``{"params", "grads", "optimizer", "total"}``, unique storages.
        """
        return self.units.state_bytes(optimizer)
