"""Low-communication training (Chapter 15): replicas that talk less often.

- :mod:`~dtlib.low_comm.diloco`: local SGD and DiLoCo (Douillard et al., 2023). Each
  data-parallel replica takes ``H`` inner steps on its own rows, then the replicas
  average their pseudo-gradients (anchor minus parameters) in one all-reduce and an
  outer optimizer (Nesterov SGD) moves the shared anchor: one all-reduce of the
  parameters every ``H`` steps instead of one of the gradients every step.

Taught in: Chapter 15, "When the network is slow" (being written: the technique and
its proofs come first).
"""

from __future__ import annotations

from dtlib.low_comm.diloco import DiLoCo, OuterStepping, simulate_diloco

__all__ = ["DiLoCo", "OuterStepping", "simulate_diloco"]
