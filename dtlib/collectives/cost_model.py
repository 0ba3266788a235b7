"""The alpha-beta(-gamma) cost model of collectives, and nccl-tests' bus bandwidth.

A message of N bytes between two ranks costs ``alpha + N * beta``: alpha is the
latency (seconds per message), beta the inverse bandwidth (seconds per byte); gamma is
the time to reduce one byte. Thakur, Rabenseifner and Gropp (2005) give, for n ranks:

=====================  ============================  =====================  ===========
algorithm              alpha term                    beta term              gamma term
=====================  ============================  =====================  ===========
ring reduce-scatter    (n-1)                         (n-1)/n N              (n-1)/n N
ring all-gather        (n-1)                         (n-1)/n N              0
ring all-reduce        2(n-1)                        2(n-1)/n N             (n-1)/n N
tree broadcast         ceil(log2 n)                  ceil(log2 n) N         0
naive all-reduce       2(n-1)                        2(n-1) N               (n-1) N
=====================  ============================  =====================  ===========

N is the message size as nccl-tests defines it: the all-reduced tensor, the gathered
(output) tensor of an all-gather, the unreduced (input) tensor of a reduce-scatter.

Taught in: Chapter 2, "The cost model".
"""

from __future__ import annotations

import math
from typing import Sequence

from dtlib.runtime.i18n import _

#: (alpha coefficient, beta coefficient, gamma coefficient) as functions of n.
_TERMS = {
    ("ring", "reduce_scatter"): lambda n: (n - 1, (n - 1) / n, (n - 1) / n),
    ("ring", "all_gather"): lambda n: (n - 1, (n - 1) / n, 0.0),
    ("ring", "all_reduce"): lambda n: (2 * (n - 1), 2 * (n - 1) / n, (n - 1) / n),
    ("tree", "broadcast"): lambda n: (math.ceil(math.log2(n)) if n > 1 else 0,
                                      math.ceil(math.log2(n)) if n > 1 else 0, 0.0),
    ("naive", "all_reduce"): lambda n: (2 * (n - 1), 2 * (n - 1), n - 1),
}

_BUS_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
}


def _check_n(world_size: int) -> None:
    if (not isinstance(world_size, int) or isinstance(world_size, bool)
            or world_size < 1):
        raise ValueError(f"world_size={world_size!r} must be a positive integer")


def cost_terms(algorithm: str, op: str, world_size: int) -> tuple[float, float, float]:
    """Coefficients (a, b, c) such that time = a*alpha + b*N*beta + c*N*gamma.

    Args:
        algorithm: "ring", "tree" or "naive".
        op: "all_reduce", "reduce_scatter", "all_gather" or "broadcast".
        world_size: n.
    Returns:
        The three coefficients from the table in the module docstring.

    Taught in: Chapter 2, "The cost model".
    """
    _check_n(world_size)
    if (algorithm, op) not in _TERMS:
        raise ValueError(f"algorithm={algorithm!r}, op={op!r} is not modelled; "
                         "allowed: "
                         f"{sorted(_TERMS)}")
    a, b, c = _TERMS[(algorithm, op)](world_size)
    return float(a), float(b), float(c)


def collective_time(algorithm: str, op: str, nbytes: float, world_size: int,
                    alpha: float, beta: float, gamma: float = 0.0) -> float:
    """Predicted seconds for one collective of ``nbytes`` (alpha-beta-gamma model).

    Args:
        algorithm, op, world_size: see :func:`cost_terms`.
        nbytes: message size N in bytes (nccl-tests' definition).
        alpha: seconds per message; beta: seconds per byte; gamma: seconds per byte
            reduced.
    Returns:
        a*alpha + b*N*beta + c*N*gamma.

    Taught in: Chapter 2, "The cost model".
    """
    if nbytes < 0:
        raise ValueError(f"nbytes={nbytes} must be >= 0")
    a, b, c = cost_terms(algorithm, op, world_size)
    return a * alpha + b * nbytes * beta + c * nbytes * gamma


def bus_bandwidth_factor(op: str, world_size: int) -> float:
    """nccl-tests' factor from algorithm bandwidth (N / time) to bus bandwidth.

    all_reduce 2(n-1)/n; reduce_scatter and all_gather (n-1)/n; broadcast and reduce 1.
    Bus bandwidth is comparable with the link's speed whatever n is.

    Taught in: Chapter 2, "The cost model".
    """
    _check_n(world_size)
    if op not in _BUS_FACTOR:
        raise ValueError(f"op={op!r} has no bus-bandwidth factor; allowed: "
                         f"{sorted(_BUS_FACTOR)}")
    return float(_BUS_FACTOR[op](world_size))


def bytes_sent_per_rank(op: str, nbytes: float, world_size: int,
                        algorithm: str = "ring") -> float:
    """Bytes one rank sends (the beta coefficient times N; for "naive", rank 0's).

    Taught in: Chapter 2, exercise ch2-ex-bytes.
    """
    _, b, _ = cost_terms(algorithm, op, world_size)
    if algorithm == "naive":
        return (world_size - 1) * nbytes  # the root sends n-1 whole tensors back
    if algorithm == "tree":
        return nbytes  # an inner node forwards once per round; any rank at most log n
    return b * nbytes


def fit_alpha_beta(nbytes: Sequence[float], times: Sequence[float], op: str,
                   world_size: int, algorithm: str = "ring") -> tuple[float, float]:
    """Least-squares alpha and beta from measured times (gamma folded into beta).

    Fits time = a*alpha + b*N*beta with a, b from :func:`cost_terms`, i.e. a straight
    line time = intercept + slope*N, weighting each point by 1/time so small messages
    (where alpha shows) count as much as large ones.

    Returns:
        (alpha in seconds, beta in seconds per byte), each clipped at 0.

    Taught in: Chapter 2, "The cost model against measurement".
    """
    if len(nbytes) != len(times) or len(nbytes) < 2:
        raise ValueError(f"need >= 2 (nbytes, time) pairs of equal length, got "
                         f"{len(nbytes)} and {len(times)}")
    a, b, _ = cost_terms(algorithm, op, world_size)
    if a == 0 or b == 0:
        raise ValueError(f"world_size={world_size}: nothing is communicated, no fit")
    w = [1.0 / t for t in times]  # relative error: fit log-spread points evenly
    sw = sum(wi * wi for wi in w)
    sx = sum(wi * wi * x for wi, x in zip(w, nbytes))
    sy = sum(wi * wi * y for wi, y in zip(w, times))
    sxx = sum(wi * wi * x * x for wi, x in zip(w, nbytes))
    sxy = sum(wi * wi * x * y for wi, x, y in zip(w, nbytes, times))
    det = sw * sxx - sx * sx
    slope = (sw * sxy - sx * sy) / det
    intercept = (sy - slope * sx) / sw
    return max(intercept, 0.0) / a, max(slope, 0.0) / b


def latency_bandwidth_crossover(op: str, world_size: int, alpha: float, beta: float,
                                algorithm: str = "ring") -> float:
    """Message size (bytes) at which the alpha term equals the beta term.

    Below it latency dominates (busbw grows with size); above it bandwidth does.

    Taught in: Chapter 2, "The cost model against measurement".
    """
    a, b, _ = cost_terms(algorithm, op, world_size)
    if beta <= 0 or b == 0:
        return math.inf
    return a * alpha / (b * beta)


def fit_distrust(records: list[dict], op: str, world_size: int, alpha: float,
                 beta: float, max_error: float = 0.5) -> str | None:
    """Why an alpha-beta fit should not be quoted, or None when it can be.

    A fit is trusted when both terms are positive, the line follows the measured times
    (median relative error below ``max_error``) and the largest message is at least
    twice the crossover size, so the bandwidth-bound regime was actually measured.

    Args:
        records: the timed records of one (op, variant): ``bytes`` and ``time_s``.
        op, world_size: the collective and the number of ranks it ran on.
        alpha, beta: the fitted latency (s) and time per byte (s/B).
    Returns:
        A sentence a reader can be shown, or None.

    Taught in: Chapter 2, "The cost model against measurement".
    """
    if beta <= 0:
        return _("the time did not grow with the message size, so no bandwidth term "
                 "could be fitted")
    if alpha <= 0:
        return _("the smallest messages showed no latency term")
    errors = sorted(abs(collective_time("ring", op, r["bytes"], world_size,
                                                  alpha, beta) - r["time_s"])
                    / r["time_s"] for r in records)
    median = errors[len(errors) // 2]
    if median > max_error:
        return _("the line misses the measured times by {median:.0%} (median): the "
                 "machine was too noisy for a fit").format(median=median)
    cross = latency_bandwidth_crossover(op, world_size, alpha, beta)
    largest = max(r["bytes"] for r in records)
    if largest < 2 * cross:
        return _("the largest message ({largest:.0f} MiB) is below twice the fitted "
                 "crossover ({cross:.1f} MiB): the bandwidth-bound regime was not "
                 "reached").format(largest=largest / 2**20, cross=cross / 2**20)
    return None


# op -> (algorithm, op) of the cost model; the rest are priced below.
_PRICED_AS = {"all_reduce": ("ring", "all_reduce"),
              "reduce_scatter": ("ring", "reduce_scatter"),
              "all_gather": ("ring", "all_gather"),
              "gather": ("ring", "all_gather"), "scatter": ("ring", "all_gather"),
              "all_to_all": ("ring", "all_gather"),
              "broadcast": ("tree", "broadcast"), "reduce": ("tree", "broadcast")}


def check_link(alpha: float, beta: float) -> None:
    """Raise, naming the argument, unless ``alpha`` and ``beta`` are finite and
    >= 0."""
    for name, value, unit in (("alpha", alpha, "seconds per message"),
                              ("beta", beta, "seconds per byte")):
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not math.isfinite(value) or value < 0:
            raise ValueError(f"{name}={value!r} must be a finite number >= 0 "
                             f"({unit})")


def link_seconds(op: str, nbytes: float, group_size: int, alpha: float,
                 beta: float) -> float:
    """Seconds one collective holds a link of latency ``alpha`` and ``beta`` s/byte.

    Args:
        op: a :data:`~dtlib.collectives.comm_log.OPS` name.
        nbytes: the message size as the observer records it (nccl-tests' N).
        group_size: ranks in the collective's group (1: nothing travels).
    Returns:
        all-reduce, reduce-scatter, all-gather: the ring's alpha-beta time (gather,
        scatter and all-to-all priced as an all-gather: each rank sends (n-1)/n N);
        broadcast and reduce: the tree's; send and recv: alpha + N beta; a barrier:
        a ring all-reduce of nothing.

    Taught in: Chapter 15, "A slow link you can measure".
    """
    check_link(alpha, beta)
    if group_size <= 1 and op not in ("send", "recv"):
        return 0.0
    if op in ("send", "recv"):
        return alpha + nbytes * beta
    if op == "barrier":
        return collective_time("ring", "all_reduce", 0, group_size, alpha, beta)
    if op not in _PRICED_AS:
        raise ValueError(f"op={op!r} is not a collective the link can price; "
                         f"allowed: {sorted([*_PRICED_AS, 'send', 'recv', 'barrier'])}")
    algorithm, priced = _PRICED_AS[op]
    return collective_time(algorithm, priced, nbytes, group_size, alpha, beta)
