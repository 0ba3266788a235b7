"""How long one training step takes, per strategy: compute, optimizer, exposed comms.

A step costs its compute (model FLOPs, Narayanan et al. 2021's count of
``counts.flops_per_iteration``: ``6 Psi T`` plus attention plus recomputation, over
the FLOP/s one rank reaches), the optimizer's pass over the parameters the rank steps,
and the communication nothing hides. The communication is what each chapter counts,
priced by Chapter 2's alpha-beta ring model; what hides is one rule per strategy,
played out on two streams (:func:`dtlib.planner.overlap.two_streams`):

==============  ==========================================  ========================
strategy        communication per step, per rank            overlap rule
==============  ==========================================  ========================
ddp/naive       one all-reduce per parameter tensor         none (after backward)
ddp/bucketed    one all-reduce per bucket                   none (after backward)
ddp/overlapped  the same buckets                            bucket k behind the
                                                            backward of the layers
                                                            before it; the last one
                                                            exposed
zero-1, zero-2  reduce-scatter + all-gather per unit        none (ours block)
zero-3          all-gather forward, all-gather + reduce-    none (ours block)
                scatter backward, per unit
fsdp (FSDP2)    the same as zero-3, and copies into and     unit i+1's all-gather
                out of the buffers (3 + 2/N copies of each  behind unit i; unit i's
                unit's bytes, on the compute stream)        reduce-scatter behind
                                                            unit i-1's backward
tp              2 all-reduces forward, 2 backward a layer   none: critical path
gpipe, 1f1b     one activation and one gradient send per    the bubble: (p - 1)
                micro-batch and stage boundary              idle slots of m + p - 1
zb-h1           the same sends                              ZB-H1's ideal clock
                                                            (zb_h1_step): W, a third
                                                            of the compute, fills
                                                            the drain
zb-v            twice as many: each rank's two chunks       ZB-V's ideal clock
                send (the model cut into 2p chunks)         (zb_v_step): half of
                                                            ZB-H1's fill
==============  ==========================================  ========================

When ranks outnumber cores (``Machine.cores``: a CPU where gloo reduces and copies on
the cores the layers use) there is no second stream: every collective adds
(:func:`dtlib.planner.overlap.serial`), and the ranks share the cores' FLOP/s (at
the share measured with that many ranks busy, ``Machine.shared``, else by the rule
``min(1, cores / N)``). A GPU
machine (``cores=None``) applies the rules; ``planner.machine.gpu_machine`` builds
one from the planner's datasheet presets (re-exported here with ``Machine``).

Taught in: Chapter 13, "Where the time goes".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dtlib.planner.counts import flops_per_iteration, param_count
from dtlib.planner.machine import (ADAMW_BYTES_PER_PARAM, H100_HBM_BYTES_PER_S,
                                   Machine, gpu_machine, rank_flops)
from dtlib.planner.overlap import Comm, Timeline, serial, two_streams
from dtlib.planner.specs import RECOMPUTE, ModelSpec

__all__ = ["MODELLED", "Machine", "Workload", "StepTime", "predict", "zb_h1_step",
           "zb_v_step",
           "mfu", "gpu_machine", "rank_flops", "unit_params", "bucket_bytes",
           "H100_HBM_BYTES_PER_S", "ADAMW_BYTES_PER_PARAM"]

#: The strategies the model prices, by their names in the book's one strategy table
#: (:data:`dtlib.planner.strategies.STRATEGIES`, which builds each).
MODELLED = ("ddp/naive", "ddp/bucketed", "ddp/overlapped", "zero-1", "zero-2",
              "zero-3", "fsdp", "tp", "gpipe", "1f1b", "zb-h1", "zb-v")
@dataclass(frozen=True)
class Workload:
    """One training step's shape.

    model: the GPT (a ``planner.ModelSpec``; GPT-style for ``unit_params``).
    global_batch: sequences per step, over all ranks.
    n_params: parameters (default ``param_count(model)``; pass the built model's).
    n_tensors: parameter tensors (naive DDP's messages); default a tied GPT's
        ``12 l + 4``.
    bucket_cap_bytes: DDP's bucket cap (25 MiB, torch's default).
    n_micro: micro-batches per step of the pipelines (m).
    bytes_per_element: 4 (fp32 gradients and activations).
    recompute: "none", "selective" or "full" (adds FLOPs, Chapter 12).
    control_collectives: also count the small collectives the book's own loop and
        techniques issue besides the gradient and activation traffic, each priced as
        a message of its few bytes (its latency): the logged loss's all-reduce of
        every data-parallel step (``Parallelism.global_loss``); ZeRO's usage flags,
        one all-reduce a step (stages 1-3, ours); ZeRO-3's agreement check, an
        all-gather of two integers before each unit's collective (ours); the
        pipelines' barrier and loss broadcast. False (the planner's published runs):
        gradient and activation traffic only.
    """

    model: ModelSpec
    global_batch: int
    n_params: int | None = None
    n_tensors: int | None = None
    bucket_cap_bytes: float = 25 * 2**20
    n_micro: int = 4
    bytes_per_element: int = 4
    recompute: str = "none"
    control_collectives: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.model, ModelSpec):
            raise ValueError(f"model={self.model!r} must be a planner ModelSpec")
        for name in ("global_batch", "n_micro", "bytes_per_element"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r} must be an integer >= 1")
        if not self.bucket_cap_bytes > 0:
            raise ValueError(f"bucket_cap_bytes={self.bucket_cap_bytes!r} must be > 0")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"recompute={self.recompute!r} is not one of {RECOMPUTE}")

    @property
    def psi(self) -> int:
        """Parameters (Psi)."""
        return self.n_params if self.n_params is not None else param_count(self.model)

    @property
    def tensors(self) -> int:
        """Parameter tensors."""
        return self.n_tensors if self.n_tensors is not None else \
            12 * self.model.n_layers + 4

    def flops(self) -> int:
        """FLOPs of the whole step, all ranks (recomputation included)."""
        return flops_per_iteration(self.model, self.global_batch, self.recompute)

    def model_flops(self) -> int:
        """FLOPs of the step without recomputation (MFU's numerator)."""
        return flops_per_iteration(self.model, self.global_batch, "none")


@dataclass(frozen=True)
class StepTime:
    """A predicted step, in seconds.

    compute_s: forward and backward (the pipelines: the busiest stage, bubble
        excluded; FSDP2: with the copies into and out of its collective buffers),
        and the strategy's machinery where measured (``Machine.overhead_s``);
    optimizer_s: the optimizer step; comm_s: every collective's time;
    exposed_s: the communication (and waiting) that adds to the step; bubble_s: the
        pipeline's idle slots; total_s: the step.
    """

    strategy: str
    world_size: int
    compute_s: float
    optimizer_s: float
    comm_s: float
    exposed_s: float
    bubble_s: float
    total_s: float
    overlapped: bool

    @property
    def exposed_fraction(self) -> float:
        """Exposed communication as a fraction of the step."""
        return self.exposed_s / self.total_s if self.total_s else 0.0


def _share(m: Machine, busy_ranks: int) -> float:
    """The fraction of a core (or device) each of ``busy_ranks`` ranks gets."""
    return rank_flops(m, busy_ranks) / m.flops_per_s


def unit_params(w: Workload) -> list[int]:
    """Parameters per sharding unit, in forward order: the root (embeddings, final
    norm) first, then each block (``12 h^2 + 13 h``), as Chapter 4 wraps them."""
    h, layers = w.model.hidden, w.model.n_layers
    block = 12 * h * h + 13 * h
    return [max(w.psi - layers * block, 0)] + [block] * layers


def bucket_bytes(w: Workload) -> list[float]:
    """Gradient bytes per DDP bucket in the order they fill (the last layers first)."""
    total = w.psi * w.bytes_per_element
    full, rest = divmod(total, w.bucket_cap_bytes)
    return [w.bucket_cap_bytes] * int(full) + ([rest] if rest else [])


def _check(strategy: str, world_size: int) -> None:
    if strategy not in MODELLED:
        raise ValueError(f"strategy={strategy!r} not allowed; allowed: {MODELLED}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) \
            or world_size < 1:
        raise ValueError(f"world_size={world_size!r} must be an integer >= 1")


def _data_parallel(strategy: str, w: Workload, m: Machine, n: int
                   ) -> tuple[list[float], list[Comm], float]:
    """Compute chunks, collectives and optimizer seconds of DDP, ZeRO, FSDP2."""
    flops = w.flops() / n / rank_flops(m, n)
    fwd = flops / (4 if w.recompute == "full" else 3)  # full: forward twice
    bwd = flops - fwd  # backward (and the recomputed forward) is the rest
    e = w.bytes_per_element
    opt_params = w.psi if strategy.startswith("ddp") else w.psi / n
    opt = opt_params * m.optimizer_s_per_param / _share(m, n)
    # the strategy's own machinery (measured on one rank, where no byte moves), on
    # the compute stream with the optimizer: the last chunk, counted as compute. Not
    # slowed by the share: it runs between collectives, while other ranks wait in
    # them (charged on the share, our ZeRO-1/2/3 on 4 ranks of 2 cores came out
    # 0.70-0.75 of their predictions in the benchmark)
    machinery = m.overhead_s.get(strategy, 0.0)
    if strategy.startswith("ddp"):
        buckets = [w.psi * e] if strategy == "ddp/naive" else bucket_bytes(w)
        msgs = [w.tensors] if strategy == "ddp/naive" else [1] * len(buckets)
        total = sum(buckets)
        chunks = [fwd] + [bwd * b / total for b in buckets] + [opt + machinery]
        comms = [Comm(m.collective_s("all_reduce", b, n, k),
                      ready_after=(i + 1 if strategy == "ddp/overlapped"
                                   else len(buckets)),
                      needed_by=len(chunks) - 1, name=f"bucket {i}")
                 for i, (b, k) in enumerate(zip(buckets, msgs))]
        return chunks, comms + _logged_loss(w, m, n, len(chunks)), opt
    units = unit_params(w)
    share = [u / sum(units) for u in units]
    if strategy in ("zero-1", "zero-2"):
        chunks = [fwd] + [bwd * s for s in reversed(share)] + [opt + machinery]
        # zero-1 reduce-scatters in step(); zero-2 in the hook, which waits for it
        # before the backward goes on (ours block: the next chunk needs it)
        k = len(units)
        comms = [Comm(m.collective_s("reduce_scatter", u * e, n),
                      k if strategy == "zero-1" else i + 1,
                      k + 1 if strategy == "zero-1" else i + 2,
                      f"reduce-scatter unit {k - 1 - i}")
                 for i, u in enumerate(reversed(units))]
        comms += _usage_flags(w, m, n, ready_after=k)
        comms += [Comm(m.collective_s("all_gather", u * e, n), k + 1, None,
                       f"all-gather unit {j}") for j, u in enumerate(units)]
        return chunks, comms + _logged_loss(w, m, n, len(chunks)), opt
    # zero-3 and fsdp2: forward per unit, backward per unit in reverse, optimizer
    k = len(units)
    chunks = [fwd * s for s in share] + [bwd * s for s in reversed(share)] + [opt]
    prefetch = strategy == "fsdp"
    if prefetch:  # FSDP2's copies, on the compute stream (a unit of u elements):
        # each all-gather copies the shard in (u / n) and the gathered unit out to
        # its parameters (u); the reduce-scatter copies the gradients in (u)
        copy = [u * e * m.copy_s_per_byte / _share(m, n) for u in units]
        chunks = ([c + (1 + 1 / n) * cp for c, cp in zip(chunks[:k], copy)]
                  + [c + (2 + 1 / n) * cp for c, cp in zip(chunks[k:2 * k],
                                                           reversed(copy))]
                  + [opt])
    chunks[-1] += machinery
    comms = []
    for u in range(k):  # forward: gather unit u before its chunk u
        ready = u - 2 if prefetch and u >= 1 else u - 1  # fsdp2: as unit u-1 starts
        comms.append(Comm(m.collective_s("all_gather", units[u] * e, n), ready, u,
                          f"all-gather unit {u}"))
    for j in range(k):  # backward chunk k + j is unit k-1-j
        u = k - 1 - j
        ready = k + j - 2 if prefetch and j >= 1 else k + j - 1
        comms.append(Comm(m.collective_s("all_gather", units[u] * e, n), ready,
                          k + j, f"all-gather unit {u} (backward)"))
        if j >= 1:  # the previous unit's gradients, ready as its backward ends
            comms.append(Comm(m.collective_s("reduce_scatter", units[u + 1] * e, n),
                              k + j - 1, 2 * k if prefetch else k + j,
                              f"reduce-scatter unit {u + 1}"))  # ours: blocking
    comms.append(Comm(m.collective_s("reduce_scatter", units[0] * e, n), 2 * k - 1,
                      2 * k, "reduce-scatter unit 0"))
    if not prefetch:  # ours: each unit's collective follows the ranks' agreement
        comms = [c for comm in comms for c in _agreement(w, m, n, comm) + [comm]]
        comms += _usage_flags(w, m, n, ready_after=2 * k - 1)
    return chunks, comms + _logged_loss(w, m, n, len(chunks)), opt


def _small(m: Machine, n: int, nbytes: int) -> float:
    """Seconds of one control collective: a message of ``nbytes``, its latency."""
    return m.collective_s("all_reduce", nbytes, n)


def _logged_loss(w: Workload, m: Machine, n: int, n_chunks: int) -> list[Comm]:
    """The logged loss's all-reduce after the optimizer (a float32), if counted."""
    return [Comm(_small(m, n, 4), n_chunks - 1, None, "loss all-reduce")] \
        if w.control_collectives else []


def _usage_flags(w: Workload, m: Machine, n: int, ready_after: int) -> list[Comm]:
    """ZeRO's usage flags (an int32 per tensor), all-reduced before the optimizer."""
    return [Comm(_small(m, n, 4 * w.tensors), ready_after, ready_after + 1,
                 "usage flags")] if w.control_collectives else []


def _agreement(w: Workload, m: Machine, n: int, comm: Comm) -> list[Comm]:
    """ZeRO-3's check that every rank runs ``comm`` next: two int64 per rank."""
    return [Comm(m.collective_s("all_gather", 16 * n, n), comm.ready_after,
                 comm.needed_by, "agreement")] if w.control_collectives else []


def zb_h1_step(n_stages: int, n_microbatches: int, t_fwd: float, t_bwd: float,
               t_w: float) -> float:
    """ZB-H1's step on the ideal clock when ``t_w <= min(t_fwd, t_bwd)``, in closed
    form (this module runs without torch): ``m (t_F + t_B + t_W) + (p - 1)(t_F + t_B
    - t_W)`` (Qi et al., 2024) when ``m >= p``; with fewer micro-batches than stages
    the drain has no W's to fill it: ``(m + p - 1)(t_F + t_B) + t_W``. Equal to
    Chapter 6's ``simulate("zb-h1", ...)`` (``tests/test_zero_bubble.py``).

    Taught in: Chapter 13, "Where the time goes".
    """
    p, m = n_stages, n_microbatches
    if not t_w <= min(t_fwd, t_bwd):
        raise ValueError(f"t_w={t_w!r} must be at most min(t_fwd, t_bwd) = "
                         f"{min(t_fwd, t_bwd)!r}")
    if m >= p:
        return m * (t_fwd + t_bwd + t_w) + (p - 1) * (t_fwd + t_bwd - t_w)
    return (m + p - 1) * (t_fwd + t_bwd) + t_w


def zb_v_step(n_ranks: int, n_microbatches: int, t_fwd: float, t_bwd: float,
              t_w: float) -> float:
    """ZB-V's step on the ideal clock (Chapter 6's ``play_v`` of ``zbv_orders``), in
    closed form where it has one; ``t_*`` are a whole stage's, a chunk takes half.

    - ``t_fwd == t_bwd >= t_w`` and ``m >= 2p - 1`` (the V fills):
      ``m (t_F + t_B + t_W) + (p - 1) max(t_F / 2, t_F - t_W)``; with equal times
      the idle is ``(p - 1)/2`` of a slot, half of ZB-H1's ``p - 1``;
    - ``t_fwd == t_bwd >= t_w`` and ``m <= p``: ``m (t_F + t_B + t_W) + (2p - 1 -
      m) t_F``;
    - equal times, any ``m``: ``3 m t + max((p - 1)/2, 2p - 1 - m) t``.

    Equal to ``play_v`` over a grid of depths, micro-batch counts and times
    (``tests/test_zero_bubble_v.py``); this module runs without torch.

    Raises:
        ValueError: outside those cases (``play_v`` plays any), naming why.

    Taught in: Chapter 13, "Where the time goes"; Chapter 6, "The V".
    """
    p, m = n_ranks, n_microbatches
    for name, v in (("n_ranks", p), ("n_microbatches", m)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}={v!r} must be a positive integer")
    if not (t_fwd == t_bwd >= t_w > 0):
        raise ValueError(f"t_fwd={t_fwd!r}, t_bwd={t_bwd!r}, t_w={t_w!r}: the closed "
                         "form needs t_fwd == t_bwd >= t_w > 0")
    if t_w == t_fwd:
        return 3 * m * t_fwd + max((p - 1) / 2, 2 * p - 1 - m) * t_fwd
    if m >= 2 * p - 1:
        return m * (t_fwd + t_bwd + t_w) + (p - 1) * max(t_fwd / 2, t_fwd - t_w)
    if m <= p:
        return m * (t_fwd + t_bwd + t_w) + (2 * p - 1 - m) * t_fwd
    raise ValueError(f"n_microbatches={m} between n_ranks={p} and 2 * n_ranks - 1 = "
                     f"{2 * p - 1} with t_w < t_fwd has no closed form here")


def predict(strategy: str, w: Workload, m: Machine, world_size: int) -> StepTime:
    """The predicted step of ``strategy`` on ``world_size`` ranks of ``m``.

    Args:
        strategy: one of :data:`MODELLED`.
        w: the :class:`Workload` (its global batch is split over the data-parallel
            ranks; TP ranks each see all of it; pipeline stages each see all of it,
            in ``w.n_micro`` micro-batches).
        m: the :class:`Machine`.
        world_size: ranks (the dp, tp or pp size: one dimension at a time).
    Returns:
        A :class:`StepTime`.

    Taught in: Chapter 13, "Where the time goes".
    """
    _check(strategy, world_size)
    n, e, shared = world_size, w.bytes_per_element, m.shares_cores(world_size)
    tokens = w.global_batch * w.model.seq_len
    if strategy in ("gpipe", "1f1b", "zb-h1", "zb-v"):
        mb = w.flops() / n / w.n_micro / m.flops_per_s  # one stage, one micro-batch
        send = m.collective_s("send", tokens / w.n_micro * w.model.hidden * e, n)
        slots = w.n_micro + n - 1  # the same for GPipe and 1F1B (Chapter 6)
        sends = 4 if strategy == "zb-v" else 2  # per stage and micro-batch
        if strategy == "zb-h1":
            # F, B and W a third of the compute each, each send charged to the
            # action that waits for it: ZB-H1's step on the ideal clock
            critical = zb_h1_step(n, w.n_micro, mb / 3 + send, mb / 3 + send, mb / 3)
            exposed = 2 * slots * send  # the sends on the critical path
        elif strategy == "zb-v":
            # the same thirds; a stage's F (and B) is two chunks', each with its send
            critical = zb_v_step(n, w.n_micro, mb / 3 + 2 * send, mb / 3 + 2 * send,
                                 mb / 3)
            exposed = critical - zb_v_step(n, w.n_micro, mb / 3, mb / 3, mb / 3)
        else:
            critical = slots * (mb + 2 * send)
            exposed = 2 * slots * send  # the sends on the critical path
        if m.cores is not None:  # every stage's work through the shared cores
            critical = max(critical, (w.n_micro * mb + sends * (n - 1) / n
                                      * w.n_micro * send) / _share(m, n))
        # the split backward's machinery (a B and a W call per module, measured on
        # one rank against 1F1B there): each stage runs its share of the modules
        machinery = m.overhead_s.get(strategy, 0.0) / n
        critical += machinery
        opt = w.psi / n * m.optimizer_s_per_param / _share(m, n)
        compute, comm = w.n_micro * mb + machinery, sends * w.n_micro * send
        if w.control_collectives:  # the barrier before, the loss broadcast after
            control = 2 * _small(m, n, 4)
            critical, comm, exposed = (x + control for x in (critical, comm, exposed))
        bubble = critical - compute - exposed  # idle slots (or the cores' queue)
        return StepTime(strategy, n, compute, opt, comm, exposed, max(bubble, 0.0),
                        critical + opt, overlapped=False)
    if strategy == "tp":
        compute = w.flops() / n / rank_flops(m, n)
        act = tokens * w.model.hidden * e
        comm = m.collective_s("all_reduce", 4 * w.model.n_layers * act, n,
                              messages=4 * w.model.n_layers)
        opt = w.psi / n * m.optimizer_s_per_param / _share(m, n)
        return StepTime(strategy, n, compute, opt, comm, comm, 0.0,
                        compute + comm + opt, overlapped=False)
    chunks, comms, opt = _data_parallel(strategy, w, m, n)
    timeline: Timeline = (serial if shared else two_streams)(chunks, comms)
    compute = timeline.compute_s - opt
    comm = sum(c.seconds for c in comms)
    overlapped = not shared and strategy in ("ddp/overlapped", "fsdp")
    return StepTime(strategy, n, compute, opt, comm, timeline.exposed_s, 0.0,
                    timeline.end_s, overlapped)


def mfu(model_flops: float, step_time_s: float, peak_flops_per_s: float,
        n_devices: int = 1) -> float:
    """Model FLOPs utilisation: ``model_flops / (step_time_s * peak * n_devices)``.

    Args:
        model_flops: FLOPs of one step's model, all devices, recomputation excluded
            (``Workload.model_flops()``; PaLM's definition, Chowdhery et al. 2022).
        step_time_s: measured seconds per step (start-up and checkpoints excluded).
        peak_flops_per_s: one device's peak (a datasheet, or the measured matmul
            roof of Chapter 13).
        n_devices: devices the step ran on.
    Returns:
        A fraction in (0, 1] for an honest peak.

    Taught in: Chapter 13, "MFU".
    """
    for name, v in (("model_flops", model_flops), ("step_time_s", step_time_s),
                    ("peak_flops_per_s", peak_flops_per_s)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not (
                math.isfinite(v) and v > 0):
            raise ValueError(f"{name}={v!r} must be a finite number > 0")
    if isinstance(n_devices, bool) or not isinstance(n_devices, int) or n_devices < 1:
        raise ValueError(f"n_devices={n_devices!r} must be an integer >= 1")
    return model_flops / (step_time_s * peak_flops_per_s * n_devices)
