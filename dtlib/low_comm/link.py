"""The step-time model on a slow link: DDP, PowerSGD and DiLoCo, and which one wins.

Chapter 13's model prices a step as compute plus the communication nothing hides.
On a slow link the communication is the step, so this module prices each method's
messages with Chapter 2's alpha-beta ring model
(:func:`~dtlib.collectives.cost_model.link_seconds`, what the slow link charges)
and adds them to the step measured on the fast link:

=========================  ============================================================
method                     what one step puts on the link (ring all-reduces)
=========================  ============================================================
ddp                        the gradients, 4 Psi bytes
powersgd (rank r)          up to ``start_iter``: DDP's; then the uncompressed
                           tensors, every compressed matrix's P (r n) and Q (r m)
diloco (H)                 every H-th step the parameters, 4 Psi bytes; else nothing
=========================  ============================================================

torch DDP (under DDP and PowerSGD) also broadcasts the module's buffers from rank 0
before every forward (``broadcast_buffers=True``, its default; the GPT's causal
mask), and on its second step, once, what it needs to rebuild its buckets. The
logged loss's all-reduce comes after the step's work, outside the slow link
(:class:`~dtlib.collectives.slow_link.SlowLinkSteps`), and is part of the step
measured on the fast link.

:func:`link_step_seconds` is the link time of one step, :func:`predict_on_link` adds
it to a measured fast step, and :func:`cluster_step` answers a reader's question for
a real cluster: for a model of Psi parameters, this many replicas and this bandwidth
per node, what does each method's step cost, and which is fastest? There the compute
is ``6 Psi T`` over the FLOP/s reached, and DDP's and PowerSGD's messages hide
behind the backward (two thirds of the compute) as far as they fit, DiLoCo's outer
step behind nothing.

Taught in: Chapter 15, "When it pays".
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from dtlib.collectives.cost_model import link_seconds
from dtlib.low_comm.powersgd import powersgd_elements

__all__ = ["METHODS", "Method", "messages_of_step", "link_step_seconds",
           "predict_on_link", "cluster_step"]

#: The methods the link model prices.
METHODS = ("ddp", "powersgd", "diloco")


@dataclass(frozen=True)
class Method:
    """One way to train data-parallel replicas.

    kind: one of :data:`METHODS`.
    inner_steps: DiLoCo's H (1 otherwise).
    rank: PowerSGD's rank r (0 otherwise).
    start_iter: PowerSGD's plain all-reduce steps before compressing.
    min_compression_rate: PowerSGD sends a matrix uncompressed unless
        ``n m > rate * r (n + m)`` (:func:`~dtlib.low_comm.powersgd.should_compress`).
    library: run the library's implementation (torch's ``powerSGD_hook``) rather
        than the book's; priced the same.
    """

    kind: str
    inner_steps: int = 1
    rank: int = 0
    start_iter: int = 0
    min_compression_rate: float = 2.0
    library: bool = False

    def __post_init__(self) -> None:
        if self.kind not in METHODS:
            raise ValueError(f"kind={self.kind!r} is not allowed; allowed: {METHODS}")
        if isinstance(self.inner_steps, bool) or not isinstance(self.inner_steps, int) \
                or self.inner_steps < 1:
            raise ValueError(f"inner_steps={self.inner_steps!r} must be an integer "
                             ">= 1")
        if self.kind == "powersgd" and (isinstance(self.rank, bool) or not isinstance(
                self.rank, int) or self.rank < 1):
            raise ValueError(f"rank={self.rank!r} must be an integer >= 1 for "
                             "PowerSGD")

    @property
    def label(self) -> str:
        """"ddp", "powersgd r4", "diloco H10"."""
        label = {"ddp": "ddp", "powersgd": f"powersgd r{self.rank}",
                 "diloco": f"diloco H{self.inner_steps}"}[self.kind]
        return label + (" (torch)" if self.library else "")


def messages_of_step(method: Method, shapes: Sequence[tuple[int, ...]], step: int,
                     buffer_bytes: int = 0, bytes_per_element: int = 4
                     ) -> list[tuple[str, int]]:
    """``(op, bytes)`` of each collective ``method`` puts on the link at optimizer
    step ``step`` (from 1) on a model of parameter ``shapes``, in order; with
    ``buffer_bytes`` > 0, torch DDP's broadcast of the buffers first.

    Taught in: Chapter 15, "When it pays"."""
    total = sum(math.prod(s) for s in shapes) * bytes_per_element
    if method.kind == "diloco":
        return [("all_reduce", total)] if step % method.inner_steps == 0 else []
    sent = [("broadcast", buffer_bytes)] if buffer_bytes else []
    if method.kind == "ddp" or step <= method.start_iter:
        return sent + [("all_reduce", total)]
    return sent + [("all_reduce", k * bytes_per_element) for k in powersgd_elements(
        shapes, method.rank, method.min_compression_rate) if k]


def link_step_seconds(method: Method, shapes: Sequence[tuple[int, ...]], step: int,
                      world_size: int, alpha: float, beta: float,
                      buffer_bytes: int = 0) -> float:
    """Seconds step ``step`` of ``method`` holds a link of ``alpha`` (s) and ``beta``
    (s/byte): its collectives one after another (:func:`messages_of_step`).

    Taught in: Chapter 15, "When it pays"."""
    return math.fsum(link_seconds(op, b, world_size, alpha, beta)
                     for op, b in messages_of_step(method, shapes, step, buffer_bytes))


def predict_on_link(method: Method, shapes: Sequence[tuple[int, ...]],
                    steps: Sequence[int], fast_step_s: float, world_size: int,
                    alpha: float, beta: float, buffer_bytes: int = 0) -> float:
    """Predicted seconds of ``steps`` on the slow link: each the step measured on
    the fast link plus its link time (nothing hides it: the chapter's GPT fills one
    DDP bucket, sent after the backward).

    Taught in: Chapter 15, "When it pays"."""
    return math.fsum(fast_step_s + link_step_seconds(
        method, shapes, s, world_size, alpha, beta, buffer_bytes) for s in steps)


def cluster_step(method: Method, shapes: Sequence[tuple[int, ...]], tokens: int,
                 flops_per_s: float, replicas: int, bandwidth_bytes_per_s: float,
                 latency_s: float) -> dict[str, float]:
    """One replica's step on a real cluster, averaged over an outer round.

    Args:
        method: what to price.
        shapes: the model's parameter shapes (a model built on the meta device
            holds them at no memory cost: ``dtlib.models.gpt.meta_gpt``).
        tokens: tokens each replica computes per step.
        flops_per_s: FLOP/s a replica reaches (its peak times its MFU).
        replicas: data-parallel replicas (one per node: the link is the node's).
        bandwidth_bytes_per_s, latency_s: the link between nodes.
    Returns:
        ``{"compute_s", "comm_s", "exposed_s", "step_s"}``: the compute is
        ``6 Psi tokens / flops_per_s``; DDP's and PowerSGD's all-reduces hide behind
        the backward (two thirds of it) as far as they fit; DiLoCo's outer step,
        once per H steps, hides behind nothing. No buffer broadcast (a model whose
        buffers are constants wraps with ``broadcast_buffers=False``) and one
        latency for the logged loss each step.

    Taught in: Chapter 15, "When it pays".
    """
    if not bandwidth_bytes_per_s > 0:
        raise ValueError(f"bandwidth_bytes_per_s={bandwidth_bytes_per_s!r} must be > 0")
    psi = sum(math.prod(s) for s in shapes)
    compute = 6 * psi * tokens / flops_per_s
    beta = 1 / bandwidth_bytes_per_s
    h = method.inner_steps
    # a steady step (PowerSGD after its start), averaged over one outer round
    late = max(method.start_iter, h) + 1
    comm = math.fsum(link_step_seconds(method, shapes, s, replicas, latency_s, beta)
                     for s in range(late, late + h)) / h \
        + link_seconds("all_reduce", 4, replicas, latency_s, beta)
    hidden = 0.0 if method.kind == "diloco" else 2 / 3 * compute
    exposed = max(comm - hidden, 0.0)
    return {"compute_s": compute, "comm_s": comm, "exposed_s": exposed,
            "step_s": compute + exposed}
