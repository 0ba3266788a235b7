"""The machine the step-time model prices a step on: measured or quoted inputs.

A :class:`Machine` is one rank's FLOP/s, the optimizer's seconds per parameter, the
alpha-beta of the collectives and whether the ranks share CPU cores with their
communication (``cores``) or each own a device whose communication runs beside its
compute (``cores=None``). :func:`gpu_machine` builds the second kind from the
planner's datasheet presets; Chapter 13's page measures the first.

Taught in: Chapter 13, "Measuring the machine".
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from dtlib.collectives.cost_model import cost_terms

from dtlib.planner.specs import PRESETS

__all__ = ["Machine", "curve_s", "monotone", "gpu_machine", "rank_flops",
           "H100_HBM_BYTES_PER_S", "ADAMW_BYTES_PER_PARAM"]

#: H100/H200 SXM HBM bandwidth, 3.35 TB/s (NVIDIA H100 datasheet; H200: 4.8 TB/s).
H100_HBM_BYTES_PER_S = 3.35e12
#: fp32 AdamW reads parameter, gradient, two moments (16 B), writes three (12 B).
ADAMW_BYTES_PER_PARAM = 28


@dataclass(frozen=True)
class Machine:
    """The measured (or quoted) inputs of the model.

    name: a label ("this CPU", "H100-80GB").
    flops_per_s: FLOP/s of one rank computing alone (one core, one GPU): the
        layers' own forward and backward where measured, else a matmul's.
    alpha_s, beta_s_per_byte: the alpha-beta of any collective (Chapter 2).
    optimizer_s_per_param: seconds the optimizer step takes per parameter stepped.
    cores: CPU cores the ranks and gloo share; None: each rank owns a device whose
        communication runs beside its compute.
    fits: per ``(op, world_size)`` a measured ``(alpha_s, beta_s_per_byte)`` that
        overrides the default pair (ops: all_reduce, reduce_scatter, all_gather,
        send).
    copy_s_per_byte: seconds per byte a device-memory copy writes (FSDP2 copies
        each unit into and out of its collective buffers); 0: copies are free.
    shared: per busy-rank count, the measured fraction of ``flops_per_s`` each
        rank reaches while that many compute at once (the slowest rank's matmul
        over one rank's alone); it overrides the sharing rule of
        :func:`rank_flops` for that count.
    curves: per ``(op, world_size)`` whose alpha-beta line Chapter 2's guard
        rejected, the measured ``(bytes, seconds)`` of one call at each timed size:
        a message is priced by :func:`curve_s` between them (no line describes a
        collective whose time does not grow with its size, as when ranks outnumber
        cores and each hop waits for a rank to be scheduled). A fit of the same key
        wins.
    overhead_s: per strategy, the seconds its machinery adds to one rank's step
        where no byte moves (hooks, the tensors it builds, its Python): measured
        on a one-rank world as the strategy's step minus the plain step, and
        charged as compute at those seconds (it runs between collectives, while
        other ranks wait in them, not queued behind their layers); for a pipeline
        whose backward is split (zb-h1, zb-v), what the split adds to 1F1B's step
        on one stage, each of the n stages charged its 1/n. Absent: 0.
    """

    name: str
    flops_per_s: float
    alpha_s: float
    beta_s_per_byte: float
    optimizer_s_per_param: float
    cores: int | None = None
    fits: dict[tuple[str, int], tuple[float, float]] = field(default_factory=dict)
    copy_s_per_byte: float = 0.0
    shared: dict[int, float] = field(default_factory=dict)
    curves: dict[tuple[str, int], tuple[tuple[float, float], ...]] = field(
        default_factory=dict)
    overhead_s: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("flops_per_s", "alpha_s", "beta_s_per_byte",
                     "optimizer_s_per_param", "copy_s_per_byte"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (
                    math.isfinite(v) and v >= 0) or (name == "flops_per_s" and v == 0):
                raise ValueError(f"{name}={v!r} must be a finite number >= 0 "
                                 "(flops_per_s > 0)")
        if self.cores is not None and (isinstance(self.cores, bool) or not
                                       isinstance(self.cores, int) or self.cores < 1):
            raise ValueError(f"cores={self.cores!r} must be None or an integer >= 1")
        for ranks, frac in self.shared.items():
            if isinstance(frac, bool) or not isinstance(frac, (int, float)) or not (
                    math.isfinite(frac) and frac > 0) or isinstance(ranks, bool) \
                    or not isinstance(ranks, int) or ranks < 1:
                raise ValueError(f"shared={self.shared!r}: each entry must map a "
                                 "rank count >= 1 to a measured fraction > 0")
        for strategy, seconds in self.overhead_s.items():
            if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) \
                    or not (math.isfinite(seconds) and seconds >= 0):
                raise ValueError(f"overhead_s[{strategy!r}]={seconds!r} must be a "
                                 "finite number of seconds >= 0")
        for key, points in self.curves.items():
            if not points or any(not (math.isfinite(b) and math.isfinite(t)
                                       and b > 0 and t > 0) for b, t in points) \
                    or len({b for b, _ in points}) != len(points):
                raise ValueError(f"curves[{key!r}]={points!r} must be (bytes, seconds) "
                                 "pairs, each > 0, one per message size")

    def shares_cores(self, world_size: int) -> bool:
        """Whether compute and communication share the cores (no second stream)."""
        return self.cores is not None and world_size >= self.cores

    def collective_s(self, op: str, nbytes: float, world_size: int,
                     messages: int = 1) -> float:
        """Seconds of ``messages`` ring collectives moving ``nbytes`` in all.

        ``op="send"`` is one point-to-point message (alpha + N beta).
        """
        if world_size == 1 or messages == 0:
            return 0.0
        key = (op, world_size)
        if key not in self.fits and key in self.curves:
            return messages * curve_s(self.curves[key], nbytes / messages)
        alpha, beta = self.fits.get((op, world_size),
                                    (self.alpha_s, self.beta_s_per_byte))
        if op == "send":
            return messages * alpha + nbytes * beta
        a, b, _ = cost_terms("ring", op, world_size)
        return messages * a * alpha + b * nbytes * beta


def curve_s(points: tuple[tuple[float, float], ...], nbytes: float) -> float:
    """Seconds of one call of ``nbytes`` read off measured ``(bytes, seconds)``
    points: the smallest size's time below it (a call costs at least its latency),
    straight lines between sizes, and past the largest the last segment's slope (at
    least flat).

    Taught in: Chapter 13, "Measuring the machine".
    """
    pts = sorted(points)
    if nbytes <= pts[0][0] or len(pts) == 1:  # one point: flat
        return pts[0][1]
    for (b0, t0), (b1, t1) in zip(pts, pts[1:]):
        if nbytes <= b1:
            return t0 + (t1 - t0) * (nbytes - b0) / (b1 - b0)
    (b0, t0), (b1, t1) = pts[-2], pts[-1]
    return t1 + max(0.0, (t1 - t0) / (b1 - b0)) * (nbytes - b1)


def monotone(points: tuple[tuple[float, float], ...]
             ) -> tuple[tuple[float, float], ...]:
    """Measured ``(bytes, seconds)`` made non-decreasing in bytes, by pooling
    adjacent sizes that run backwards into their mean (pool-adjacent-violators):
    a larger message never costs less, so a size whose call waited on a late rank
    does not make the sizes after it look cheaper.

    Taught in: Chapter 13, "Measuring the machine".
    """
    pts = sorted(points)
    blocks: list[list[float]] = []  # [sum of seconds, count]
    for _, t in pts:
        blocks.append([t, 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > \
                blocks[-1][0] / blocks[-1][1]:
            t_sum, count = blocks.pop()
            blocks[-1][0] += t_sum
            blocks[-1][1] += count
    times = [t_sum / count for t_sum, count in blocks for _ in range(int(count))]
    return tuple((b, t) for (b, _), t in zip(pts, times))


def gpu_machine(name: str = "H100-80GB", efficiency: float = 0.5) -> Machine:
    """A GPU per rank from the planner's datasheet presets (``specs.PRESETS``).

    Args:
        name: a preset ("H100-80GB": 989 TFLOP/s bf16 dense, NVLink 4 at 450 GB/s a
            direction; the H200 has the same compute and links).
        efficiency: the fraction of the peak a small GPT's layers reach.
    Returns:
        A :class:`Machine` with ``cores=None``: NCCL runs beside the compute.

    Taught in: Chapter 13, "The same model on a GPU".
    """
    if name not in PRESETS:
        raise ValueError(f"name={name!r} is not one of {sorted(PRESETS)}")
    if not 0 < efficiency <= 1:
        raise ValueError(f"efficiency={efficiency!r} must be in (0, 1]")
    p = PRESETS[name]
    return Machine(name, p["peak_flops"] * efficiency, alpha_s=5e-6,
                   beta_s_per_byte=1 / p["intra_node_bw"],
                   optimizer_s_per_param=ADAMW_BYTES_PER_PARAM / H100_HBM_BYTES_PER_S,
                   copy_s_per_byte=2 / H100_HBM_BYTES_PER_S)  # read + write


def rank_flops(machine: Machine, busy_ranks: int) -> float:
    """FLOP/s of one rank while ``busy_ranks`` ranks compute at once: the measured
    share where ``machine.shared`` has that count, else the cores' FLOP/s shared
    by the rule ``flops_per_s * min(1, cores / busy_ranks)``.

    Taught in: Chapter 13, "When ranks outnumber cores".
    """
    if busy_ranks in machine.shared:
        return machine.flops_per_s * machine.shared[busy_ranks]
    if machine.cores is None:
        return machine.flops_per_s
    return machine.flops_per_s * min(1.0, machine.cores / busy_ranks)
