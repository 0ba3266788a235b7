"""Dynamic loss scaling from scratch, and its comparison with ``torch.amp.GradScaler``.

fp16 has 5 exponent bits: gradients below 2**-24 become 0. Multiplying the loss by a
scale S moves every gradient up by S (backward is linear), into fp16's range; the
optimizer sees the gradients divided by S again, in fp32. Too large an S overflows to
inf: the step is skipped and S shrinks; after ``growth_interval`` clean steps S grows
again {cite:p}`micikevicius2018mixed`.

Taught in: Chapter 7, "Loss scaling".
"""

from __future__ import annotations

from typing import Any, Iterable

import torch


def _as_fp32(x: float) -> float:
    # GradScaler keeps its scale in an fp32 tensor; ours rounds the same way.
    return torch.tensor(x, dtype=torch.float32).item()


#: The smallest scale: fp32's smallest normal number. GradScaler has no floor (its
#: scale can reach 0 after ~150 overflows in a row, then 1/S is inf and every later
#: step is skipped); here S stops at this floor, where 1/S is still finite.
MIN_SCALE = torch.finfo(torch.float32).tiny

READY, UNSCALED, STEPPED = "ready", "unscaled", "stepped"


def _unscale_grads(grads: list[torch.Tensor], inv: torch.Tensor) -> torch.Tensor:
    """Multiply ``grads`` (one device) by ``inv`` in place; return a 1-element tensor,
    non-zero if any gradient was inf or NaN. No host synchronisation."""
    found = torch.zeros(1, dtype=torch.float32, device=inv.device)
    fused = getattr(torch, "_amp_foreach_non_finite_check_and_unscale_", None)
    if fused is not None:  # GradScaler's own kernel: one launch, no sync
        fused(grads, found, inv)
    else:  # one stacked check, then one foreach multiply
        found += torch.stack([g.isfinite().all() for g in grads]).logical_not().any()
        torch._foreach_mul_(grads, inv)
    return found


class DynamicLossScaler:
    """The dynamic loss scaler of mixed-precision training, written out.

    Call order per step, as with GradScaler: ``scale(loss).backward()``, optionally
    ``unscale_(opt)`` then clip, ``step(opt)`` for each optimizer, ``update()``.
    Each optimizer is unscaled once and stepped once per step (a second call raises);
    an optimizer steps unless *its own* gradients overflowed, and ``update`` backs off
    if any optimizer's did.

    Args:
        init_scale: first S (a power of two keeps scaling exact).
        growth_factor: S *= growth_factor after ``growth_interval`` clean steps (> 1).
        backoff_factor: S *= backoff_factor after an overflow (in (0, 1)); S never
            falls below :data:`MIN_SCALE`.
        growth_interval: clean steps before S grows (>= 1).

    Taught in: Chapter 7, "Loss scaling".
    """

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000) -> None:
        if not init_scale > 0 or init_scale == float("inf"):
            raise ValueError(f"init_scale={init_scale!r} must be finite and > 0")
        if not growth_factor > 1.0:
            raise ValueError(f"growth_factor={growth_factor!r} must be > 1")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"backoff_factor={backoff_factor!r} must be in (0, 1)")
        if not isinstance(growth_interval, int) or growth_interval < 1:
            raise ValueError(f"growth_interval={growth_interval!r} must be an int >= 1")
        self.scale_value = max(_as_fp32(init_scale), MIN_SCALE)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.growth_tracker = 0  # clean steps since the last growth or overflow
        # per optimizer (by id) this step: {"stage", "found_inf": tensor, "inf": bool}
        self._per_optimizer: dict[int, dict[str, Any]] = {}

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * S``: backward then yields S times the true gradients."""
        return loss * torch.tensor(self.scale_value, dtype=torch.float32,
                                   device=loss.device)

    def _state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return self._per_optimizer.setdefault(
            id(optimizer), {"stage": READY, "found_inf": None, "inf": None})

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide ``optimizer``'s gradients by S in place and record any inf or NaN.

        Call before clipping: a clip threshold is meant for true gradients, not S-times
        larger ones. No host synchronisation (the check stays on the device). Calling
        it twice for one optimizer in one step would divide twice: it raises.
        """
        st = self._state(optimizer)
        if st["stage"] == UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer "
                               "since the last update()")
        if st["stage"] == STEPPED:
            raise RuntimeError("unscale_() is being called after step()")
        # 1/S computed in fp64 then rounded to fp32, as GradScaler does.
        inv = torch.tensor(1.0 / self.scale_value, dtype=torch.float32)
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    by_device.setdefault(p.grad.device, []).append(p.grad)
        st["found_inf"] = [_unscale_grads(grads, inv.to(device))  # 1 per device
                           for device, grads in by_device.items()]
        st["stage"] = UNSCALED

    def _found_inf(self, st: dict[str, Any]) -> bool:
        if st["inf"] is None:  # the step's one host synchronisation
            st["inf"] = any(bool(f.item()) for f in st["found_inf"])
        return st["inf"]

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Unscale if not done yet; step ``optimizer`` unless its gradients overflowed.

        Returns:
            True if the optimizer stepped, False if the step was skipped.
        """
        st = self._state(optimizer)
        if st["stage"] == STEPPED:
            raise RuntimeError("step() has already been called on this optimizer "
                               "since the last update()")
        if st["stage"] == READY:
            self.unscale_(optimizer)
        st["stage"] = STEPPED
        if self._found_inf(st):
            return False
        optimizer.step()
        return True

    def update(self) -> None:
        """Back off after an overflow in any optimizer; grow after
        ``growth_interval`` clean steps."""
        if not self._per_optimizer:
            raise RuntimeError("update() called before unscale_()/step() this step")
        found = any([self._found_inf(st) for st in self._per_optimizer.values()])
        self._per_optimizer = {}
        self._update_scale(found)

    def _update_scale(self, found_inf: bool) -> None:
        """The rule: halve on overflow (not below MIN_SCALE), double when clean."""
        if found_inf:
            self.scale_value = max(_as_fp32(self.scale_value * self.backoff_factor),
                                   MIN_SCALE)
            self.growth_tracker = 0
        else:
            self.growth_tracker += 1
            if self.growth_tracker == self.growth_interval:
                grown = _as_fp32(self.scale_value * self.growth_factor)
                if grown != float("inf"):  # never grow into overflow
                    self.scale_value = grown
                self.growth_tracker = 0

    def get_scale(self) -> float:
        """The current S."""
        return self.scale_value

    def state_dict(self) -> dict[str, Any]:
        """GradScaler's keys: ``scale``, ``growth_factor``, ``backoff_factor``,
        ``growth_interval``, ``_growth_tracker`` (plain numbers: ``weights_only``)."""
        return {"scale": self.scale_value, "growth_factor": self.growth_factor,
                "backoff_factor": self.backoff_factor,
                "growth_interval": self.growth_interval,
                "_growth_tracker": self.growth_tracker}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict` (ours or a GradScaler's)."""
        missing = {"scale", "growth_factor", "backoff_factor", "growth_interval",
                   "_growth_tracker"} - set(state)
        if missing:
            raise ValueError(f"state is missing {sorted(missing)}")
        if not 0 < state["scale"] < float("inf"):
            raise ValueError(f"state scale={state['scale']!r} must be finite and > 0")
        self.scale_value = max(_as_fp32(state["scale"]), MIN_SCALE)
        self.growth_factor = float(state["growth_factor"])
        self.backoff_factor = float(state["backoff_factor"])
        self.growth_interval = int(state["growth_interval"])
        self.growth_tracker = int(state["_growth_tracker"])
        self._per_optimizer = {}


def simulate_scale(flags: Iterable[bool], init_scale: float = 2.0 ** 16,
                   growth_factor: float = 2.0, backoff_factor: float = 0.5,
                   growth_interval: int = 2000) -> list[float]:
    """The scale after each step, given which steps overflowed (no model needed).

    Returns:
        ``[S after step 0, S after step 1, ...]``.

    Taught in: Chapter 7, "Loss scaling" (and its exercise).
    """
    s = DynamicLossScaler(init_scale, growth_factor, backoff_factor, growth_interval)
    out = []
    for inf in flags:
        s._update_scale(bool(inf))
        out.append(s.get_scale())
    return out


def grad_scaler_available(device_type: str) -> tuple[bool, str]:
    """Whether ``torch.amp.GradScaler(device_type)`` works here, and why not if not.

    Taught in: Chapter 7, "Loss scaling".
    """
    amp = getattr(torch, "amp", None)
    if amp is None or not hasattr(amp, "GradScaler"):
        return False, f"torch {torch.__version__} has no torch.amp.GradScaler"
    try:
        scaler = amp.GradScaler(device_type)
        p = torch.zeros(1, device=device_type, requires_grad=True)
        opt = torch.optim.SGD([p], lr=0.1)
        scaler.scale(p.sum()).backward()
        scaler.step(opt)
        scaler.update()
    except Exception as exc:  # an old torch without the device's unscale kernel
        return False, f"GradScaler({device_type!r}) failed: {exc}"
    if not scaler.is_enabled():
        return False, f"GradScaler({device_type!r}) disabled itself on this machine"
    return True, "ok"
