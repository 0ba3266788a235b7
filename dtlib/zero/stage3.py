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

Mixed precision (``mp_policy``, the fields of FSDP2's ``MixedPrecisionPolicy``): the
shards, ``.grad`` and the optimizer stay in the master dtype; each rank casts its
shard to ``param_dtype`` and all-gathers that (half the bytes in 16 bits), forward
and backward run in it, and the gradients are cast to ``reduce_dtype`` for the
reduce-scatter, then added to the master-dtype gradient shard.

Taught in: Chapter 4, ZeRO-3; mixed precision: Chapter 7, "Mixed precision across
ranks".
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.nn as nn

from dtlib.zero.fsdp import MixedPrecisionPolicy
from dtlib.zero.shards import ShardedUnits
from dtlib.zero.units import Unit, free_flat

#: What ``param_dtype``, ``reduce_dtype`` and ``output_dtype`` may be (None: as is).
POLICY_DTYPES = (None, torch.float32, torch.bfloat16, torch.float16)

__all__ = ["FullyShardedModule", "gather_flat", "install_stage3_hooks",
           "POLICY_DTYPES", "cast_floats"]


def gather_flat(units: ShardedUnits, unit: Unit) -> None:
    """Refill the unit's full buffer from every rank's shard (all-gather) and point
    the module parameters at it."""
    if not unit.gathered:
        units.check_same_collective("all-gather", unit)
        flat = unit.flat_param
        flat.untyped_storage().resize_(flat.numel() * flat.element_size())
        # mixed precision: the fp32 master shard is cast down, then gathered
        units.all_gather(flat, unit.shard.detach().to(flat.dtype))
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


def cast_floats(x: Any, dtype: torch.dtype | None) -> Any:
    """``x`` with every floating-point tensor in it (lists, tuples, dicts) cast to
    ``dtype`` (None: unchanged); what FSDP2 does to inputs and outputs."""
    if dtype is None:
        return x
    if torch.is_tensor(x):
        return x.to(dtype) if x.is_floating_point() else x
    if isinstance(x, (list, tuple)):
        return type(x)(cast_floats(item, dtype) for item in x)
    if isinstance(x, dict):
        return {k: cast_floats(v, dtype) for k, v in x.items()}
    return x


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
        mp_policy: FSDP2's ``MixedPrecisionPolicy`` (the same object works for
            both): ``param_dtype`` (all-gather and compute), ``reduce_dtype``
            (reduce-scatter; None: ``param_dtype``), ``output_dtype`` (the
            forward's floating outputs), ``cast_forward_inputs`` (floating inputs
            to ``param_dtype``). None, or every dtype None: fp32 throughout, the
            bytes and collectives of Chapter 4.

    Taught in: Chapter 4, ZeRO-3; ``mp_policy``: Chapter 7, "Mixed precision across
    ranks".
    """

    def __init__(self, module: nn.Module, group: Any = None,
                 unit_modules: list[nn.Module] | None = None,
                 mp_policy: MixedPrecisionPolicy | None = None) -> None:
        super().__init__()
        self.module = module
        self.mp_policy = mp_policy or MixedPrecisionPolicy()
        for field in ("param_dtype", "reduce_dtype", "output_dtype"):
            value = getattr(self.mp_policy, field, None)
            if value not in POLICY_DTYPES:
                raise ValueError(f"mp_policy.{field}={value!r} not allowed; allowed: "
                                 f"{POLICY_DTYPES}")
        self.units = ShardedUnits(module, 3, group, unit_modules,
                                  param_dtype=self.mp_policy.param_dtype,
                                  reduce_dtype=self.mp_policy.reduce_dtype)
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
        policy = self.mp_policy
        if policy.cast_forward_inputs and policy.param_dtype is not None:
            args, kwargs = cast_floats((args, kwargs), policy.param_dtype)
        return cast_floats(self.module(*args, **kwargs), policy.output_dtype)

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
        # the master values, not the 16-bit compute copy (mixed precision)
        full = {u.index: self._gather_master(u) for u in self.units.units
                if u.flat_param.dtype != u.shard.dtype}
        for unit in self.units.units:
            if unit.index in full:
                for p, v in zip(unit.params, unit.layout.views(full[unit.index])):
                    p.data = v
            else:
                gather_flat(self.units, unit)
        try:
            yield
        finally:
            for unit in self.units.units:
                flat = full.get(unit.index, unit.flat_param)
                if writeback:
                    unit.shard.copy_(flat[unit.lo:unit.hi])
                if unit.index not in full:
                    free_flat(unit)
                unit.point_at_shard()

    def _gather_master(self, unit: Unit) -> torch.Tensor:
        """The unit's full parameters in the master dtype (a new buffer)."""
        flat = torch.empty(unit.layout.padded_numel, dtype=unit.shard.dtype,
                           device=unit.shard.device)
        self.units.all_gather(flat, unit.shard.detach())
        return flat

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
