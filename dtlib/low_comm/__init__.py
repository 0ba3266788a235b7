"""Low-communication training (Chapter 15): replicas that talk less, less often.

- :mod:`~dtlib.low_comm.diloco`: local SGD and DiLoCo (Douillard et al., 2023). Each
  data-parallel replica takes ``H`` inner steps on its own rows, then the replicas
  average their pseudo-gradients (anchor minus parameters) in one all-reduce and an
  outer optimizer (Nesterov SGD) moves the shared anchor: one all-reduce of the
  parameters every ``H`` steps instead of one of the gradients every step.
- :mod:`~dtlib.low_comm.powersgd`: gradient compression as a DDP communication hook
  (one hook for torch's DDP and Chapter 3's): PowerSGD (Vogels et al., 2019), each
  gradient matrix sent as rank-``r`` factors with error feedback and warm start,
  and 16-bit gradients (bfloat16 or float16 on the wire).

Taught in: Chapter 15, "When the network is slow" (being written: the technique and
its proofs come first).
"""

from __future__ import annotations

from dtlib.low_comm.diloco import DiLoCo, OuterStepping, simulate_diloco
from dtlib.low_comm.powersgd import (LowPrecisionState, PowerSGDState,
                                     low_precision_hook, powersgd_bytes,
                                     powersgd_elements, powersgd_hook,
                                     should_compress)

__all__ = ["DiLoCo", "OuterStepping", "simulate_diloco", "PowerSGDState",
           "powersgd_hook", "powersgd_elements", "powersgd_bytes", "should_compress",
           "LowPrecisionState", "low_precision_hook"]
