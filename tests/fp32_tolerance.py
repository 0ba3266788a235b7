"""Tolerances derived from what a float32 computation can differ by (Chapters 5, 12).

A parallel run and one process compute the same sums in another order (a row layer's
partial products all-reduced, a kernel blocked for another shape, a softmax folded
block by block). Reordering a sum of ``n`` float32 terms changes it by at most about
``n * u`` times the sum of the terms' magnitudes (Higham, *Accuracy and Stability of
Numerical Algorithms*, §4.2), ``u = 2**-24`` the unit roundoff. That bound is on the
*magnitudes*, not on the result, so a comparison is made relative to the largest
element of the reference tensor (``max|got - want| <= rel * max|want|``), never
element by element: an element that is a near-zero cancellation carries an error of
the size of its terms, not of itself. No CPU's numbers enter these formulas.
"""

from __future__ import annotations

import math
from typing import Mapping

import torch

#: float32 unit roundoff (half an ulp of 1.0).
U32 = 2.0 ** -24


def reorder_rel(n_terms: int, sums_on_path: int, summands: int = 1) -> float:
    """Scale-relative bound of reordered float32 reductions.

    Args:
        n_terms: the longest reduction that may be reordered (terms summed at once).
        sums_on_path: how many such reductions an output passes through (each adds
            its own error; gains of O(1) between them, as in a LayerNorm'd network).
        summands: how many terms of mixed sign make up one element (a gradient summed
            over ``b * s`` tokens): their magnitudes add up to about
            ``sqrt(summands)`` times the element's size.
    Returns:
        ``n_terms * u * sums_on_path * sqrt(summands)``.
    """
    return n_terms * U32 * sums_on_path * math.sqrt(summands)


def momentum_gain(steps: int, momentum: float) -> float:
    """How much SGD-with-momentum parameters move per unit of gradient difference.

    After ``T`` steps, ``p_T = p_0 - lr * sum_k (1 - m^(T-k)) / (1 - m) * g_k``: the
    update is linear in the gradients, so a difference of ``d`` in every gradient
    moves the parameters by at most ``lr * momentum_gain(T, m) * d``.
    """
    return sum((1 - momentum ** (steps - k)) / (1 - momentum) for k in range(steps))


def max_abs(tensors: Mapping[str, torch.Tensor]) -> float:
    """The largest magnitude over a dict of tensors."""
    return max(t.abs().max().item() for t in tensors.values())


def assert_scaled(got: torch.Tensor, want: torch.Tensor, rel: float,
                  msg: str = "", scale: float | None = None) -> None:
    """``max|got - want| <= rel * scale`` (``scale``: ``max|want|`` by default)."""
    assert got.shape == want.shape, f"{msg}: shape {got.shape} != {want.shape}"
    scale = want.abs().max().item() if scale is None else scale
    err = (got.double() - want.double()).abs().max().item()
    assert err <= rel * scale, f"{msg}: max |diff| {err:.3e} > {rel:.1e} * {scale:.3e}"


def assert_all_scaled(got: Mapping[str, torch.Tensor],
                      want: Mapping[str, torch.Tensor], rel: float,
                      msg: str = "") -> None:
    """:func:`assert_scaled` for every name of ``want`` (same names required)."""
    assert set(got) == set(want), f"{msg}: names differ: {set(got) ^ set(want)}"
    for name, w in want.items():
        assert_scaled(got[name], w, rel, f"{msg} {name}")


def sgd_param_scale(rel: float, grads: Mapping[str, torch.Tensor],
                    params: Mapping[str, torch.Tensor], lr: float, steps: int,
                    momentum: float) -> float:
    """Absolute tolerance on parameters after ``steps`` of SGD with momentum.

    Every gradient agrees to ``rel * max|g|``; the update is linear in it, so the
    parameters agree to ``lr * momentum_gain * rel * max|g|``, doubled for the
    feedback of slightly different parameters into later gradients (a few small
    steps), plus one rounding of each update (``steps * u * max|p|``).
    """
    return (2 * lr * momentum_gain(steps, momentum) * rel * max_abs(grads)
            + steps * U32 * max_abs(params))


#: float64 unit roundoff.
U64 = 2.0 ** -53
