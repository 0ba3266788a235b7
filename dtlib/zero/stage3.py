"""ZeRO stage 3: parameters live as shards and are gathered only while a unit runs.

Between steps each rank holds ``1 / world_size`` of every unit's parameters. Hooks make
the full parameters exist exactly when they are needed:

- before a unit's forward (module pre-forward hook): all-gather its flat buffer;
- after its forward (module forward hook): free the buffer, and hang a hook on the
  unit's outputs;
- when the gradient of those outputs arrives (the unit's backward is next): all-gather
  again;
- when all of the unit's parameter gradients are accumulated (post-accumulate-grad
  hooks in :class:`dtlib.zero.ZeRO`): reduce-scatter them and free the buffer.

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

from typing import Any

import torch

from dtlib.zero.units import Unit, free_flat


def gather_flat(zero: Any, unit: Unit) -> None:
    """Refill the unit's full buffer from every rank's shard (all-gather) and point
    the module parameters at it."""
    if not unit.gathered:
        zero._check_same_collective("all-gather", unit)
        flat = unit.flat_param
        flat.untyped_storage().resize_(flat.numel() * flat.element_size())
        zero._all_gather(flat, unit.shard.detach())
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


def install_stage3_hooks(zero: Any) -> None:
    """Register the gather/free hooks of every unit of ``zero`` (see module doc).

    Taught in: Chapter 4, ZeRO-3.
    """

    for unit in zero.units:
        def pre_forward(module: Any, args: Any, unit: Unit = unit) -> None:
            gather_flat(zero, unit)

        def post_forward(module: Any, args: Any, out: Any,
                         unit: Unit = unit) -> None:
            needs_grad = [t for t in _tensors(out) if t.requires_grad]
            if needs_grad and torch.is_grad_enabled():
                def pre_backward(grad: torch.Tensor) -> None:
                    zero._queue_end_of_backward()
                    gather_flat(zero, unit)

                for t in needs_grad:
                    t.register_hook(pre_backward)
            free_flat(unit)
            unit.point_at_shard()  # pre_backward points them back before use

        unit.owner.register_forward_pre_hook(pre_forward)
        unit.owner.register_forward_hook(post_forward)
