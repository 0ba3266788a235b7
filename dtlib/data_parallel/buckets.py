"""Gradient buckets: the three ways a data-parallel step can average gradients.

Data parallelism keeps one replica of the model per rank; after backward, every rank
must hold the same gradient, the mean over ranks. This module holds the two building
blocks of :class:`dtlib.data_parallel.DataParallel` that do not need autograd hooks:

- :func:`allreduce_grads`, the naive way: one all-reduce per parameter tensor;
- :func:`build_buckets` and :class:`Bucket`: gradients flattened into a few large
  buffers, one all-reduce each (fewer, larger messages: the latency term of the
  alpha-beta cost model is paid once per bucket, not once per tensor).

A parameter that received no gradient on this rank contributes zeros. It gets the
average afterwards unless that average is all zeros, in which case it keeps ``grad =
None`` as in one process (a parameter nobody used must not be decayed by AdamW).
Limitation: a parameter used elsewhere whose gradient is exactly zero there would then
stay ``None`` on this rank only; torch DDP avoids that with
``find_unused_parameters=True``, which pays an extra all-reduce of a "used" bitmap every
step.

Taught in: Chapter 3, "Three DDPs, one on another".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.distributed as dist


def group_size(group: Any = None) -> int:
    """Ranks in ``group`` (the default group when None)."""
    return dist.get_world_size(group)


def _write_back(param: torch.Tensor, reduced: torch.Tensor) -> None:
    """Store an averaged gradient, keeping ``None`` for a parameter nobody used."""
    if param.grad is not None:
        if param.grad.data_ptr() != reduced.data_ptr():
            param.grad.copy_(reduced.view_as(param.grad))
    elif bool(reduced.any()):
        param.grad = reduced.view_as(param).to(param.dtype, copy=True)


def allreduce_grads(params: Sequence[torch.Tensor], group: Any = None) -> int:
    """Naive data parallel: all-reduce every gradient, one call per tensor, and average.

    Args:
        params: the parameters whose ``.grad`` to average across the group.
        group: the process group (default: the whole world).
    Returns:
        The number of all-reduce calls issued (``len(params)``; 0 on a group of one).

    Taught in: Chapter 3, "Step 1: naive".
    """
    world_size = group_size(group)
    if world_size == 1:
        return 0
    calls = 0
    for p in params:
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        dist.all_reduce(grad, group=group)  # SUM, then divide: what AVG does, shown
        grad.div_(world_size)
        _write_back(p, grad)
        calls += 1
    return calls


@dataclass
class Bucket:
    """Parameters whose gradients travel together in one flat buffer.

    index: position in launch order (0 goes first: the parameters nearest the loss).
    params: the parameters, in the order their slices sit in the buffer.
    numel: total elements of the buffer.
    """

    index: int
    params: list[torch.Tensor]
    numel: int
    ready: int = 0  # parameters whose gradient arrived this backward
    work: Any = None  # async handle while the all-reduce is in flight
    buffer: torch.Tensor | None = field(default=None, repr=False)

    @property
    def nbytes(self) -> int:
        """Bytes one all-reduce of this bucket sends in (numel x element size)."""
        return self.numel * self.params[0].element_size()

    def flatten(self) -> torch.Tensor:
        """Copy the gradients (zeros where missing) into one flat buffer."""
        p0 = self.params[0]
        if self.buffer is None:
            self.buffer = torch.empty(self.numel, dtype=p0.dtype, device=p0.device)
        offset = 0
        for p in self.params:
            n = p.numel()
            dst = self.buffer[offset:offset + n]
            if p.grad is None:
                dst.zero_()
            else:
                dst.copy_(p.grad.reshape(-1))
            offset += n
        return self.buffer

    def launch(self, group: Any = None, async_op: bool = False) -> Any:
        """Flatten and all-reduce (sum) the buffer; return the async handle if asked."""
        self.work = dist.all_reduce(self.flatten(), group=group, async_op=async_op)
        return self.work

    def unflatten(self, world_size: int) -> None:
        """Divide the summed buffer by ``world_size``; copy slices back to ``.grad``."""
        assert self.buffer is not None, "unflatten() before launch()"
        self.buffer.div_(world_size)
        self.write_back(self.buffer)

    def write_back(self, averaged: torch.Tensor) -> None:
        """Copy slices of the flat ``averaged`` buffer back to ``.grad``."""
        offset = 0
        for p in self.params:
            n = p.numel()
            _write_back(p, averaged[offset:offset + n])
            offset += n
        self.work = None
        self.ready = 0


class HookBucket:
    """A :class:`Bucket` as a communication hook sees it: the methods of torch's
    ``dist.GradBucket`` that hooks call, so one hook serves both DDPs.

    Args:
        bucket: the bucket, its gradients already flattened into ``bucket.buffer``.
        last: whether it is the last bucket of the step (``is_last()``).

    Taught in: Chapter 15, "A hook for both DDPs".
    """

    def __init__(self, bucket: Bucket, last: bool) -> None:
        assert bucket.buffer is not None, "HookBucket() before flatten()"
        self._bucket, self._last, self._buffer = bucket, last, bucket.buffer

    def index(self) -> int:
        """The bucket's position in launch order (0 goes first)."""
        return self._bucket.index

    def is_last(self) -> bool:
        """Whether this is the step's last bucket."""
        return self._last

    def buffer(self) -> torch.Tensor:
        """The flat buffer of the bucket's gradients (or what set_buffer put)."""
        return self._buffer

    def set_buffer(self, buffer: torch.Tensor) -> None:
        """Replace the buffer (a wrapper hook's 16-bit copy, as torch allows)."""
        self._buffer = buffer

    def gradients(self) -> list[torch.Tensor]:
        """The gradients, shaped like their parameters: views of the flat buffer."""
        flat = self._bucket.buffer
        assert flat is not None
        sizes = [p.numel() for p in self._bucket.params]
        return [v.view_as(p) for v, p in zip(flat.split(sizes), self._bucket.params)]

    def parameters(self) -> list[torch.Tensor]:
        """The parameters, in the order of their slices in the buffer."""
        return list(self._bucket.params)


def build_buckets(params: Sequence[torch.Tensor], bucket_cap_mb: float = 25.0
                  ) -> list[Bucket]:
    """Group parameters into buckets of at most ``bucket_cap_mb`` MiB, in reverse order.

    Backward produces gradients roughly from the last layer to the first, so the
    parameters are taken in reverse: the first bucket fills first and can leave while
    backward is still working on earlier layers. A parameter larger than the cap gets a
    bucket of its own; a change of dtype starts a new bucket (one buffer, one dtype).

    Args:
        params: parameters in module order (``module.parameters()``: a tied weight
            once).
        bucket_cap_mb: the size cap in MiB (torch DDP's default is 25).
    Returns:
        The buckets, in launch order.

    Taught in: Chapter 3, "Step 2: bucketed".
    """
    if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) \
            or not bucket_cap_mb > 0:
        raise ValueError(f"bucket_cap_mb={bucket_cap_mb!r} must be a number > 0 (MiB)")
    cap_bytes = bucket_cap_mb * 2**20
    buckets: list[Bucket] = []
    current: list[torch.Tensor] = []
    size = 0
    for p in reversed(list(params)):
        nbytes = p.numel() * p.element_size()
        if current and (size + nbytes > cap_bytes or p.dtype != current[0].dtype):
            buckets.append(Bucket(len(buckets), current,
                                  sum(q.numel() for q in current)))
            current, size = [], 0
        current.append(p)
        size += nbytes
    if current:
        buckets.append(Bucket(len(buckets), current, sum(q.numel() for q in current)))
    return buckets


def allreduce_buckets(buckets: Sequence[Bucket], group: Any = None) -> int:
    """Bucketed data parallel, after backward: one blocking all-reduce per bucket.

    Args:
        buckets: from :func:`build_buckets`.
        group: the process group (default: the whole world).
    Returns:
        The number of all-reduce calls issued (``len(buckets)``; 0 on a group of one).

    Taught in: Chapter 3, "Step 2: bucketed".
    """
    world_size = group_size(group)
    if world_size == 1:
        return 0
    for b in buckets:
        b.launch(group)
        b.unflatten(world_size)
    return len(buckets)
