"""A teaching DDP in three steps: naive, bucketed, overlapped.

``DataParallel(module, variant=...)`` wraps a model so that, when ``loss.backward()``
returns, every rank holds the mean of all ranks' gradients, and the training loop is the
one you would write for a single process::

    model = DataParallel(build_gpt(cfg), variant="overlapped")
    opt = torch.optim.AdamW(model.parameters())
    loss = model(idx, targets)[1]
    loss.backward()          # gradients are averaged across ranks here
    opt.step()

How it gets there:

- every parameter gets a ``register_post_accumulate_grad_hook``: it fires once per
  backward when that parameter's ``.grad`` is complete (a tied weight is one tensor, so
  its hook fires once, after both uses have been summed);
- the first hook of a backward queues :meth:`DataParallel._finish` on the autograd
  engine (``Variable._execution_engine.queue_callback``, early, as FSDP2 does; torch
  DDP's reducer queues its ``finalize_backward`` only once its last bucket is ready,
  which is why it needs ``find_unused_parameters=True`` for a parameter that gets no
  gradient), which runs after the last gradient of the backward and before
  ``backward()`` returns;
- ``naive``: ``_finish`` all-reduces each gradient (one call per tensor);
- ``bucketed``: ``_finish`` all-reduces flat buckets (one call per bucket);
- ``overlapped``: each hook counts its bucket; a full bucket starts an *asynchronous*
  all-reduce at once, while backward goes on computing earlier layers; ``_finish`` only
  waits. Buckets are launched strictly in index order, so every rank issues the same
  collectives in the same order even when a bucket fills out of turn.

A communication hook (:meth:`DataParallel.register_comm_hook`, torch DDP's signature)
replaces each bucket's all-reduce: the hook gets the bucket (:class:`HookBucket`) and
returns a future of the averaged buffer, which goes back into the gradients.

Taught in: Chapter 3, "Three DDPs, one on another"; the hook in Chapter 15.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn

from dtlib.runtime.dist import sync
from dtlib.data_parallel.buckets import (Bucket, HookBucket, allreduce_buckets,
                                         allreduce_grads, build_buckets)

#: The teaching variants of :class:`DataParallel`, each built on the one before.
TEACHING_VARIANTS = ("naive", "bucketed", "overlapped")


def sync_module_states(module: nn.Module, group: Any = None) -> int:
    """Broadcast parameters and buffers from the group's rank 0 to every rank.

    Replicas must start equal: a different random init per rank would make each rank
    train a different model while their gradients are averaged as if they were one.

    Args:
        module: the model, on this rank's device.
        group: the process group (default: the whole world).
    Returns:
        The number of broadcast calls (one per tensor; 0 on a group of one).

    Taught in: Chapter 3, "Replicas start equal".
    """
    if dist.get_world_size(group) == 1:
        return 0
    src = 0 if group is None else dist.get_global_rank(group, 0)
    calls = 0
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            dist.broadcast(t.data, src=src, group=group)
            calls += 1
    return calls


class DataParallel(nn.Module):
    """Data parallelism written out: the model is replicated, gradients are averaged.

    Args:
        module: the model, already on this rank's device (all parameters on one device).
        variant: ``"naive"`` (one all-reduce per tensor after backward),
            ``"bucketed"`` (one per bucket after backward) or ``"overlapped"`` (async
            bucket all-reduces started during backward).
        bucket_cap_mb: bucket size cap in MiB for the bucketed variants (> 0).
        group: process group of the data-parallel ranks (default: the whole world).
        timeline: record ``(event, index, time.perf_counter())`` tuples in
            :attr:`events` (forward, each gradient ready, each bucket launched and done)
            for the timeline figure. Off by default: it adds a clock read per hook
            (and, on CUDA, a device synchronisation).

    Taught in: Chapter 3, "Three DDPs, one on another".
    """

    def __init__(self, module: nn.Module, *, variant: str = "naive",
                 bucket_cap_mb: float = 25.0, group: Any = None,
                 timeline: bool = False) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise ValueError(f"module={type(module).__name__} must be a "
                             "torch.nn.Module")
        if variant not in TEACHING_VARIANTS:
            raise ValueError(f"variant={variant!r} is not allowed; allowed: "
                             f"{TEACHING_VARIANTS}")
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("DataParallel needs an initialised process group: call "
                             "dtlib.runtime.dist.init() first (or launch with "
                             "dtlib.runtime.launch)")
        params = [p for p in module.parameters() if p.requires_grad]
        if not params:
            raise ValueError("module has no parameter with requires_grad=True")
        devices = sorted({str(p.device) for p in params})
        if len(devices) > 1:
            raise ValueError(f"module parameters are on devices {devices}; all must "
                             "be on one device (this rank's, see "
                             "dtlib.runtime.dist.world().device)")
        self.buckets: list[Bucket] = build_buckets(params, bucket_cap_mb)
        self.module = module
        self.variant = variant
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.params = params
        self.events: list[tuple[str, int, float]] = []
        self._timeline = timeline
        self._sync_enabled = True  # False inside no_sync()
        self._require_sync = True  # decided at forward time, as in torch DDP
        self._queued = False
        self._next = 0  # next bucket to launch (overlapped)
        self._seen: set[int] = set()
        self._comm_hook: tuple[Any, Callable[..., Any]] | None = None
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._index_of = {id(p): i for i, p in enumerate(params)}
        sync_module_states(module, group)
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad_ready)
                         for p in params]

    # ---- the loop's face -----------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._require_sync = self._sync_enabled
        self._mark("forward_start", -1)
        out = self.module(*args, **kwargs)
        self._mark("forward_end", -1)
        return out

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Skip gradient averaging for backward passes of forwards run inside.

        Gradients accumulate locally in ``.grad``; the first synchronised backward
        after it averages the accumulated sums. Use it for all micro-batches of a
        gradient-accumulation step but the last (one all-reduce per step, not per
        micro-batch).

        Taught in: Chapter 3, "no_sync and gradient accumulation".
        """
        previous = self._sync_enabled
        self._sync_enabled = False
        try:
            yield
        finally:
            self._sync_enabled = previous

    def remove_hooks(self) -> None:
        """Detach the gradient hooks (the module no longer synchronises)."""
        for h in self._handles:
            h.remove()
        self._handles = []

    def register_comm_hook(self, state: Any,
                           hook: Callable[[Any, Any], torch.futures.Future]) -> None:
        """Average each bucket with ``hook(state, bucket)`` instead of an all-reduce.

        The signature is torch DDP's, so one hook serves both: ``bucket`` is a
        :class:`HookBucket` (``buffer()``, ``gradients()``, ``index()``,
        ``is_last()``, ``parameters()``, ``set_buffer()``) whose buffer holds the
        bucket's local gradients; the returned future's value is the *averaged*
        flat buffer, copied back into ``.grad``. Buckets are handed over in index
        order, one whole step's worth per backward.

        Args:
            state: whatever the hook keeps (a process group, PowerSGD's memory).
            hook: ``hook(state, bucket) -> torch.futures.Future[torch.Tensor]``.

        Taught in: Chapter 15, "A hook for both DDPs".
        """
        if self.variant == "naive":
            raise ValueError(f"variant={self.variant!r} has no buckets to hand a "
                             "communication hook; use 'bucketed' or 'overlapped'")
        if self._comm_hook is not None:
            raise ValueError("register_comm_hook: a hook is already registered; "
                             "one per model, as in torch DDP")
        if not callable(hook):
            raise ValueError(f"hook={hook!r} must be callable as hook(state, "
                             "bucket) -> Future")
        self._comm_hook = (state, hook)

    def _call_hook(self, bucket: Bucket) -> torch.futures.Future:
        state, hook = self._comm_hook
        bucket.flatten()
        return hook(state, HookBucket(bucket, bucket.index == len(self.buckets) - 1))

    # ---- during backward -----------------------------------------------------------
    def _mark(self, name: str, index: int) -> None:
        if self._timeline:
            # On CUDA a hook runs when the kernel is queued, not done: wait for the GPU
            # (and the communication stream) so the time is when the work finished.
            # The timeline is a measurement mode; the waits cost overlap.
            sync()
            self.events.append((name, index, time.perf_counter()))

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        if not self._require_sync or self.world_size == 1:
            return
        if id(param) in self._seen:  # e.g. a second backward through a retained graph
            return
        self._seen.add(id(param))
        self._mark("grad", self._index_of[id(param)])
        if not self._queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
            self._queued = True
        if self.variant == "overlapped":
            self._bucket_of[id(param)].ready += 1
            self._launch_full_buckets()

    def _launch(self, bucket: Bucket) -> None:
        self._mark("launch", bucket.index)
        if self._comm_hook is None:
            bucket.launch(self.group, async_op=True)
        else:
            bucket.work = self._call_hook(bucket)  # a future
        if self._timeline:
            index = bucket.index
            fut = bucket.work if self._comm_hook else bucket.work.get_future()
            # Runs when the all-reduce completes (on the communication thread).
            fut.then(lambda _: self._mark("done", index))

    def _launch_full_buckets(self) -> None:
        while (self._next < len(self.buckets)
               and self.buckets[self._next].ready
               == len(self.buckets[self._next].params)):
            self._launch(self.buckets[self._next])
            self._next += 1

    def _finish(self) -> None:
        """Autograd-engine callback: the end of backward; leave gradients averaged."""
        self._queued = False
        self._seen.clear()
        self._mark("backward_end", -1)
        if self.variant == "naive":
            allreduce_grads(self.params, self.group)
        elif self.variant == "bucketed" and self._comm_hook is not None:
            for b in self.buckets:  # one at a time, as the all-reduces below
                b.write_back(self._call_hook(b).wait())
        elif self.variant == "bucketed":
            allreduce_buckets(self.buckets, self.group)
        else:
            # Buckets holding a parameter that got no gradient never filled: send now.
            while self._next < len(self.buckets):
                self._launch(self.buckets[self._next])
                self._next += 1
            for b in self.buckets:
                if self._comm_hook is None:
                    b.work.wait()
                    b.unflatten(self.world_size)
                else:
                    b.write_back(b.work.wait())  # a future: the averaged buffer
            self._next = 0
        self._mark("synced", -1)


def allreduce_calls_per_step(model: DataParallel) -> int:
    """All-reduce calls one synchronised step issues: tensors (naive) or buckets.

    Taught in: Chapter 3, "Counting the messages".
    """
    if model.world_size == 1:
        return 0
    return len(model.params) if model.variant == "naive" else len(model.buckets)
