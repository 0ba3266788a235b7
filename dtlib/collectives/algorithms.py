"""Collectives built from scratch on point-to-point send/recv only.

Why build what torch already has? Because every cost later in the book (DDP's gradient
traffic, ZeRO's all-gathers, tensor parallelism's all-reduces) is the cost of one of
these algorithms, and the algorithm explains the number (Thakur et al. 2005; Patarasuk
and Yuan 2009 for the ring):

- :func:`ring_reduce_scatter`: n-1 steps; in each, every rank sends one chunk to its
  right neighbour and adds the chunk arriving from its left one.
- :func:`ring_all_gather`: n-1 steps passing finished chunks around the same ring.
- :func:`ring_all_reduce`: the two above in sequence; in place, like
  ``dist.all_reduce``.
- :func:`tree_broadcast`: a binomial tree, ceil(log2 n) rounds.
- :func:`naive_all_reduce`: everything to one rank, sum there, send back: the contrast.

Deadlock freedom: each ring step posts its send and its receive together, in one
``batch_isend_irecv``, so no rank blocks in a send that its neighbour would answer only
after its own send completes (gloo forgives a lone blocking send, NCCL does not).

Groups: ``group`` ranks are numbered 0..n-1 inside the group; send/recv take *global*
ranks, so neighbours are translated with ``dist.get_global_rank``.

Sizes need not divide by the group size: the flat tensor is cut with
``tensor_split`` (the first ``numel % n`` chunks are one element longer) and empty
chunks are simply not sent, on both sides.

Taught in: Chapter 2, "Collectives from send and recv".
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist


def _group(group: Any) -> tuple[int, int]:
    """(rank in group, group size); ValueError if this rank is not a member."""
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(f"group={group!r}: this process (global rank "
                         f"{dist.get_rank()}) is not a member")
    return rank, dist.get_world_size(group)


def _global(group: Any, group_rank: int) -> int:
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def chunk_bounds(numel: int, world_size: int) -> list[tuple[int, int]]:
    """Start and end of each rank's chunk of a flat tensor of ``numel`` elements.

    Same cut as ``torch.tensor_split``: the first ``numel % world_size`` chunks hold one
    element more. Chunks may be empty when ``numel < world_size``.

    Taught in: Chapter 2, "Ring all-reduce".
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    base, extra = divmod(numel, world_size)
    bounds, start = [], 0
    for i in range(world_size):
        end = start + base + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def _exchange(send_buf: torch.Tensor, recv_buf: torch.Tensor, right: int, left: int,
              group: Any) -> None:
    """Send to ``right`` and receive from ``left`` (global ranks) as one batch.

    Every rank of the ring sends at the same moment. A gloo send completes only once
    the peer has posted the matching receive, and NCCL needs a send and a receive
    that must progress together in one group: blocking sends alone wait for each
    other forever, on either backend. ``batch_isend_irecv`` posts both operations
    before waiting (on NCCL as one group), so each rank's receive is already there
    when its neighbour sends. Empty chunks are skipped on both sides alike."""
    c10d = dist.distributed_c10d  # looked up now: patched isend (accounting) is seen
    ops = []
    if send_buf.numel():
        ops.append(dist.P2POp(c10d.isend, send_buf, right, group))
    if recv_buf.numel():
        ops.append(dist.P2POp(c10d.irecv, recv_buf, left, group))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


def _ring_reduce_scatter_(flat: torch.Tensor, group: Any,
                          on_step: Callable[[], None] | None = None) -> tuple[int, int]:
    """In place on a 1-D contiguous ``flat``: afterwards chunk ``rank`` holds the sum
    over the group. Returns that chunk's (start, end)."""
    rank, n = _group(group)
    bounds = chunk_bounds(flat.numel(), n)
    right, left = _global(group, (rank + 1) % n), _global(group, (rank - 1) % n)
    # One receive buffer (the largest chunk): each receive is complete before reuse.
    recv = torch.empty(bounds[0][1] - bounds[0][0], dtype=flat.dtype,
                       device=flat.device)
    for step in range(n - 1):
        # Send the partial sum of chunk (rank - step - 1); receive chunk
        # (rank - step - 2), add our own contribution. After n-1 steps chunk `rank`
        # has all n terms.
        s0, s1 = bounds[(rank - step - 1) % n]
        r0, r1 = bounds[(rank - step - 2) % n]
        buf = recv[: r1 - r0]
        _exchange(flat[s0:s1], buf, right, left, group)
        flat[r0:r1].add_(buf)
        if on_step is not None:
            on_step()
    return bounds[rank]


def _ring_all_gather_(flat: torch.Tensor, group: Any,
                      on_step: Callable[[], None] | None = None) -> None:
    """In place on a 1-D ``flat`` whose chunk ``rank`` is final: fill the others."""
    rank, n = _group(group)
    bounds = chunk_bounds(flat.numel(), n)
    right, left = _global(group, (rank + 1) % n), _global(group, (rank - 1) % n)
    for step in range(n - 1):
        # Forward chunk (rank - step): ours first, then the one that just arrived.
        s0, s1 = bounds[(rank - step) % n]
        r0, r1 = bounds[(rank - step - 1) % n]
        _exchange(flat[s0:s1], flat[r0:r1], right, left, group)
        if on_step is not None:
            on_step()


def all_gather_into(output: torch.Tensor, input: torch.Tensor,
                    group: Any = None) -> None:
    """torch's all-gather into one tensor, under its name in the running torch.

    ``dist.all_gather_single`` where torch has it (added in 2026, pytorch#186123;
    torch 2.13 warns with a FutureWarning on the old name) or
    ``dist.all_gather_into_tensor`` (the only name before). Looked up at call time, so
    accounting sees it.

    Taught in: Chapter 2, "A collective only rank 0 calls".
    """
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(output, input, group=group)


def reduce_scatter_into(output: torch.Tensor, input: torch.Tensor,
                        group: Any = None) -> None:
    """torch's reduce-scatter (sum) of one tensor, under its name in the running torch:
    ``dist.reduce_scatter_single`` where torch has it (added with
    ``all_gather_single``; torch 2.13 warns on the old name) or
    ``dist.reduce_scatter_tensor`` (the only name before).

    Taught in: Chapter 2, "A collective only rank 0 calls".
    """
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(output, input, group=group)


def _check_tensor(tensor: Any) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"tensor={type(tensor).__name__} must be a torch.Tensor")


def _check_op(op: Any) -> None:
    if op != dist.ReduceOp.SUM:
        raise ValueError(f"op={op!r} is not supported; allowed: dist.ReduceOp.SUM")


def ring_all_reduce(tensor: torch.Tensor, group: Any = None,
                    op: Any = dist.ReduceOp.SUM) -> torch.Tensor:
    """Sum ``tensor`` over the group, in place: ring reduce-scatter, then all-gather.

    Each rank sends 2(n-1)/n of the tensor's bytes, whatever n: the bandwidth-optimal
    all-reduce (Patarasuk and Yuan 2009).

    Args:
        tensor: any shape and dtype; overwritten with the sum (as ``dist.all_reduce``).
        group: a process group (default: the world).
        op: only ``dist.ReduceOp.SUM``.
    Returns:
        ``tensor`` itself, for convenience.

    Taught in: Chapter 2, "Ring all-reduce".
    """
    _check_tensor(tensor)
    _check_op(op)
    _, n = _group(group)
    if n == 1 or tensor.numel() == 0:
        return tensor
    flat = tensor.view(-1) if tensor.is_contiguous() else tensor.flatten()
    _ring_reduce_scatter_(flat, group)
    _ring_all_gather_(flat, group)
    if flat.data_ptr() != tensor.data_ptr() or not tensor.is_contiguous():
        tensor.copy_(flat.view_as(tensor))
    return tensor


def ring_all_reduce_trace(tensor: torch.Tensor,
                          group: Any = None) -> list[torch.Tensor]:
    """:func:`ring_all_reduce` of a copy of ``tensor``, keeping a snapshot per step.

    Returns:
        ``[start, after step 1, ..., after step 2(n-1)]``: the first n-1 steps are the
        reduce-scatter, the next n-1 the all-gather (each snapshot a flat clone).

    Taught in: Chapter 2, "Ring all-reduce" (the step-by-step figure).
    """
    _check_tensor(tensor)
    _, n = _group(group)
    flat = tensor.flatten().clone()
    snaps = [flat.clone()]
    if n > 1 and flat.numel():
        _ring_reduce_scatter_(flat, group, lambda: snaps.append(flat.clone()))
        _ring_all_gather_(flat, group, lambda: snaps.append(flat.clone()))
    return snaps


def ring_reduce_scatter(tensor: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Sum ``tensor`` over the group and return this rank's chunk of the flat sum.

    Args:
        tensor: the full, unreduced tensor (same shape on every rank); not modified.
        group: a process group (default: the world).
    Returns:
        1-D ``tensor.flatten().tensor_split(n)[rank]`` of the sum: equal to
        ``dist.reduce_scatter_single`` when numel divides by n.

    Taught in: Chapter 2, "Ring all-reduce".
    """
    _check_tensor(tensor)
    rank, n = _group(group)
    flat = tensor.flatten().clone()
    if n == 1:
        return flat
    start, end = _ring_reduce_scatter_(flat, group)
    return flat[start:end].clone()


def ring_all_gather(tensor: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along dim 0, by passing chunks round a ring.

    Args:
        tensor: this rank's shard; the same shape on every rank.
        group: a process group (default: the world).
    Returns:
        A new tensor of shape ``(n * tensor.shape[0], *tensor.shape[1:])`` (a 0-d input
        gives shape ``(n,)``): what ``dist.all_gather_single`` produces.

    Taught in: Chapter 2, "Ring all-reduce" (and exercise ch2-ex-allgather).
    """
    _check_tensor(tensor)
    rank, n = _group(group)
    shard = tensor.reshape(1) if tensor.dim() == 0 else tensor
    out = torch.empty((n * shard.shape[0], *shard.shape[1:]), dtype=tensor.dtype,
                      device=tensor.device)
    flat = out.view(-1)
    k = shard.numel()
    flat[rank * k:(rank + 1) * k].copy_(shard.reshape(-1))
    if n > 1 and k > 0:
        _ring_all_gather_(flat, group)
    return out


def tree_broadcast(tensor: torch.Tensor, src: int = 0,
                   group: Any = None) -> torch.Tensor:
    """Copy ``tensor`` from ``src`` to every rank along a binomial tree, in place.

    Round k (k = 0, 1, ...): every rank that already has the data and whose distance
    from ``src`` is below 2**k sends to the rank 2**k further on. ceil(log2 n) rounds.

    Args:
        tensor: the data on ``src``; overwritten on the others (same shape everywhere).
        src: the *global* rank that holds the data (as in ``dist.broadcast``).
        group: a process group (default: the world).
    Returns:
        ``tensor``.

    Taught in: Chapter 2, "The cost model".
    """
    _check_tensor(tensor)
    rank, n = _group(group)
    src_g = src if group is None else dist.get_group_rank(group, src)
    if not 0 <= src_g < n:
        raise ValueError(f"src={src} is not a rank of the group (size {n})")
    if n == 1 or tensor.numel() == 0:
        return tensor
    buf = tensor if tensor.is_contiguous() else tensor.contiguous()
    vr = (rank - src_g) % n  # distance from the root
    mask = 1
    while mask < n:
        if vr < mask and vr + mask < n:
            dist.send(buf, _global(group, (rank + mask) % n), group=group)
        elif mask <= vr < 2 * mask:
            dist.recv(buf, _global(group, (rank - mask) % n), group=group)
        mask *= 2
    if buf is not tensor:
        tensor.copy_(buf)
    return tensor


def naive_all_reduce(tensor: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Sum ``tensor`` in place the naive way: all to group rank 0, sum, send back.

    Rank 0 receives and sends n-1 whole tensors one after the other: its link carries
    2(n-1) times the data, against 2(n-1)/n for the ring.

    Args:
        tensor: any shape and dtype; overwritten with the sum.
        group: a process group (default: the world).
    Returns:
        ``tensor``.

    Taught in: Chapter 2, "The cost model".
    """
    _check_tensor(tensor)
    rank, n = _group(group)
    if n == 1 or tensor.numel() == 0:
        return tensor
    buf = tensor if tensor.is_contiguous() else tensor.contiguous()
    root = _global(group, 0)
    if rank == 0:
        tmp = torch.empty_like(buf)
        for r in range(1, n):
            dist.recv(tmp, _global(group, r), group=group)
            buf.add_(tmp)
        for r in range(1, n):
            dist.send(buf, _global(group, r), group=group)
    else:
        dist.send(buf, root, group=group)
        dist.recv(buf, root, group=group)
    if buf is not tensor:
        tensor.copy_(buf)
    return tensor
