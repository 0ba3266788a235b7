"""The optimizers the book trains with, by name: one table for the pages, the
benchmarks and the capstone's ``--optimizer``.

AdamW is the optimizer whose two moments the memory formulas count; SGD with
momentum is the one whose step is smooth in the gradient, so trajectory proofs over
several steps stay within float rounding (AdamW's ``g / (|g| + eps)`` turns noise in
a near-zero gradient into a step of up to ``lr``).

Taught in: Chapter 4, "Does it train the same model?"; Chapter 10, the capstone.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["OPTIMIZERS", "optimizer_of"]

#: name -> (class, arguments besides ``lr`` and ``weight_decay``).
OPTIMIZERS: dict[str, tuple[type, dict[str, Any]]] = {
    "adamw": (torch.optim.AdamW, {}),
    "sgd": (torch.optim.SGD, {"momentum": 0.9}),
}


def optimizer_of(optimizer: str, lr: float, weight_decay: float = 0.0
                 ) -> tuple[type, dict[str, Any]]:
    """The optimizer class and its keyword arguments, by name.

    Args:
        optimizer: a key of :data:`OPTIMIZERS` (``"adamw"`` or ``"sgd"``).
        lr: the learning rate.
        weight_decay: decoupled (AdamW) or L2 (SGD) weight decay.
    Returns:
        ``(optimizer_class, kwargs)`` with ``kwargs["lr"] == lr``, ready for
        :class:`~dtlib.models.run.RunConfig`'s ``optimizer_class`` and
        ``optimizer_kwargs``.

    Taught in: Chapter 4, "Does it train the same model?".
    """
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer={optimizer!r} not allowed; allowed: "
                         f"{sorted(OPTIMIZERS)}")
    cls, kwargs = OPTIMIZERS[optimizer]
    return cls, {"lr": lr, "weight_decay": weight_decay, **kwargs}
