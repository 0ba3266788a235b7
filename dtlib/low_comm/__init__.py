"""Low-communication training (Chapter 15): replicas that talk less, less often.

- :mod:`~dtlib.low_comm.diloco`: local SGD and DiLoCo (Douillard et al., 2023). Each
  data-parallel replica takes ``H`` inner steps on its own rows, then the replicas
  average their pseudo-gradients (anchor minus parameters) in one all-reduce and an
  outer optimizer (Nesterov SGD) moves the shared anchor: one all-reduce of the
  parameters every ``H`` steps instead of one of the gradients every step.
- :mod:`~dtlib.low_comm.powersgd`: gradient compression as a DDP communication hook
  (one hook for torch's DDP and Chapter 3's): PowerSGD (Vogels et al., 2019), each
  gradient matrix sent as rank-``r`` factors with error feedback and warm start;
  :mod:`~dtlib.low_comm.low_precision`: 16-bit gradients (bfloat16 or float16 on
  the wire).
- :mod:`~dtlib.low_comm.link`: what each method puts on a slow link, the time that
  costs, and which method a reader's cluster should use;
  :mod:`~dtlib.low_comm.timing`: the methods trained and timed on a token file.

Taught in: Chapter 15, "When the network is slow".
"""

from __future__ import annotations

from dtlib.low_comm.diloco import DiLoCo, OuterStepping, simulate_diloco
from dtlib.low_comm.low_precision import LowPrecisionState, low_precision_hook
from dtlib.low_comm.powersgd import (PowerSGDState, powersgd_bytes, powersgd_elements,
                                     powersgd_hook, should_compress)

__all__ = ["DiLoCo", "OuterStepping", "simulate_diloco", "PowerSGDState",
           "powersgd_hook", "powersgd_elements", "powersgd_bytes", "should_compress",
           "LowPrecisionState", "low_precision_hook"]
