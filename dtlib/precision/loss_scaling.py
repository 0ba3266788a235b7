"""Dynamic loss scaling from scratch, and its comparison with ``torch.amp.GradScaler``.

fp16 has 5 exponent bits: gradients below 2**-24 become 0. Multiplying the loss by a
scale S moves every gradient up by S (backward is linear), into fp16's range; the
optimizer sees the gradients divided by S again, in fp32. Too large an S overflows to
inf: the step is skipped and S shrinks; after ``growth_interval`` clean steps S grows
again {cite:p}`micikevicius2018mixed`.

Taught in: Chapter 7, "Loss scaling".
"""

from __future__ import annotations

from typing import Iterable

import torch


def _as_fp32(x: float) -> float:
    # GradScaler keeps its scale in an fp32 tensor; ours rounds the same way.
    return torch.tensor(x, dtype=torch.float32).item()


class DynamicLossScaler:
    """The dynamic loss scaler of mixed-precision training, written out.

    Call order per step, as with GradScaler: ``scale(loss).backward()``, optionally
    ``unscale_(opt)`` then clip, ``step(opt)``, ``update()``.

    Args:
        init_scale: first S (a power of two keeps scaling exact).
        growth_factor: S *= growth_factor after ``growth_interval`` clean steps (> 1).
        backoff_factor: S *= backoff_factor after an overflow (in (0, 1)).
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
        self.scale_value = _as_fp32(init_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.growth_tracker = 0  # clean steps since the last growth or overflow
        self._found_inf: bool | None = None  # None: not unscaled yet this step

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * S``: backward then yields S times the true gradients."""
        return loss * torch.tensor(self.scale_value, dtype=torch.float32,
                                   device=loss.device)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> bool:
        """Divide every gradient by S in place; return True if any is inf or NaN.

        Call before clipping: a clip threshold is meant for true gradients, not S-times
        larger ones. Calling twice in one step would divide twice: it raises.
        """
        if self._found_inf is not None:
            raise RuntimeError("unscale_() already called since the last update()")
        # 1/S computed in fp64 then rounded to fp32, as GradScaler does.
        inv = torch.tensor(1.0 / self.scale_value, dtype=torch.float32)
        found = False
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                found = found or not bool(torch.isfinite(p.grad).all())
                p.grad.mul_(inv.to(p.grad.device))
        self._found_inf = found
        return found

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Unscale if not done yet; step the optimizer unless a gradient overflowed.

        Returns:
            True if the optimizer stepped, False if the step was skipped.
        """
        if self._found_inf is None:
            self.unscale_(optimizer)
        if self._found_inf:
            return False
        optimizer.step()
        return True

    def update(self) -> None:
        """Back off after an overflow; grow after ``growth_interval`` clean steps."""
        if self._found_inf is None:
            raise RuntimeError("update() called before unscale_()/step() this step")
        if self._found_inf:
            self.scale_value = _as_fp32(self.scale_value * self.backoff_factor)
            self.growth_tracker = 0
        else:
            self.growth_tracker += 1
            if self.growth_tracker == self.growth_interval:
                grown = _as_fp32(self.scale_value * self.growth_factor)
                if grown != float("inf"):  # never grow into overflow
                    self.scale_value = grown
                self.growth_tracker = 0
        self._found_inf = None

    def get_scale(self) -> float:
        """The current S."""
        return self.scale_value


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
        s._found_inf = bool(inf)
        s.update()
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
