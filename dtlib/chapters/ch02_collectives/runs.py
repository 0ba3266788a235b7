"""What Chapter 2's page runs on ranks: each primitive's before/after, the ring's trace,
and the collectives of one training step.

Taught in: Chapter 2, "Collectives".
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from dtlib.collectives.accounting import count_comms
from dtlib.collectives.algorithms import (all_gather_into, reduce_scatter_into,
                                          ring_all_reduce_trace)
from dtlib.models.gpt import MLP
from dtlib.runtime.dist import world

__all__ = ["primitive_states", "training_step_comms", "ring_trace_states"]


def _values(rank: int, length: int) -> torch.Tensor:
    # 100*rank + j: the hundreds digit says which rank a value came from; sums are
    # >= 400
    # on four ranks, so they cannot be mistaken for an original value.
    return torch.arange(length, dtype=torch.int64, device=world().device) + 100 * rank


def primitive_states() -> dict[str, tuple[list[int] | None, list[int] | None]]:
    """On every rank: run each primitive once; return {name: (before, after)} lists.

    ``None`` means the rank has no such buffer (gather's output off the root, ...).
    For barrier, before/after are the arrival and departure times in milliseconds
    (rank r arrives 100*r ms late on purpose).

    Taught in: Chapter 2, "Every primitive".
    """
    rank, n = dist.get_rank(), dist.get_world_size()
    dev = world().device  # NCCL only moves tensors that live on the rank's GPU
    out: dict[str, Any] = {}

    t = _values(rank, 4)
    before = t.tolist()
    dist.broadcast(t, src=0)
    out["broadcast"] = (before, t.tolist())

    t = _values(rank, 4)
    dist.reduce(t, dst=0)  # every rank calls it; only the root's result is defined
    out["reduce"] = (before, t.tolist() if rank == 0 else None)

    t = _values(rank, 4)
    dist.all_reduce(t)
    out["all_reduce"] = (before, t.tolist())

    t = _values(rank, 4)
    parts = [torch.empty_like(t) for _ in range(n)] if rank == 0 else None
    dist.gather(t, gather_list=parts, dst=0)  # non-roots pass gather_list=None
    out["gather"] = (before, torch.cat(parts).tolist() if parts else None)

    full = _values(rank, 4 * n)
    chunks = list(full.chunk(n)) if rank == 0 else None
    t = torch.zeros(4, dtype=torch.int64, device=dev)
    dist.scatter(t, scatter_list=chunks, src=0)
    out["scatter"] = (full.tolist() if rank == 0 else None, t.tolist())

    t = _values(rank, 4)
    g = torch.empty(4 * n, dtype=torch.int64, device=dev)
    all_gather_into(g, t)
    out["all_gather"] = (before, g.tolist())

    t = torch.empty(4, dtype=torch.int64, device=dev)
    reduce_scatter_into(t, full)
    out["reduce_scatter"] = (full.tolist(), t.tolist())

    src = _values(rank, n)
    dst = torch.empty(n, dtype=torch.int64, device=dev)
    dist.all_to_all_single(dst, src)  # element j goes to rank j
    out["all_to_all"] = (src.tolist(), dst.tolist())

    t = _values(rank, 4)
    if rank % 2 == 0 and rank + 1 < n:
        dist.send(t, dst=rank + 1)  # even ranks send to their right neighbour
    elif rank % 2 == 1:
        dist.recv(t, src=rank - 1)
    out["send/recv"] = (before, t.tolist())

    dist.barrier()
    t0 = torch.tensor([time.time()], dtype=torch.float64, device=dev)
    dist.broadcast(t0, src=0)  # one clock origin for everybody
    time.sleep(0.1 * rank)
    arrive = time.time()
    dist.barrier()
    leave = time.time()
    out["barrier"] = ([round(1e3 * (arrive - t0.item()))],
                      [round(1e3 * (leave - t0.item()))])
    return out


def training_step_comms(sizes: tuple[int, ...] = (16, 64, 64, 7)) -> dict[str, Any]:
    """On every rank: what one DDP step and one FSDP2 step of the MLP communicate.

    Args:
        sizes: the MLP's widths; the default's 7 outputs do not divide by 2 ranks, so
            FSDP2 pads the last layer's weight and bias (dim 0) and the padding shows.
    Returns:
        ``{"param_bytes", "param_shapes", "element_size", "ddp": summary,
        "fsdp2": summary}`` where each summary is
        :meth:`dtlib.collectives.accounting.CommLog.summary` of one forward+backward.

    Taught in: Chapter 2, "Counting communication".
    """
    from torch.nn.parallel import DistributedDataParallel as DDP

    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import fully_shard
    dev = world().device
    torch.manual_seed(0)
    x = torch.randn(8, 16).to(dev)
    ddp = DDP(MLP(sizes).to(dev))
    with count_comms() as ddp_log:
        ddp(x).square().mean().backward()
    model = MLP(sizes).to(dev)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    shapes = [tuple(p.shape) for p in model.parameters()]
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    with count_comms() as fsdp_log:
        model(x).square().mean().backward()
    return {"param_bytes": param_bytes, "param_shapes": shapes,
            "element_size": next(model.parameters()).element_size(),
            "ddp": ddp_log.summary(),
            "fsdp2": fsdp_log.summary(),
            "sources": sorted({r.source for r in ddp_log.records + fsdp_log.records})}


def ring_trace_states(numel_per_chunk: int = 1) -> list[list[int]]:
    """On every rank: snapshots of a ring all-reduce of ``10**rank`` values.

    Each element's decimal digits then say which ranks' contributions it holds (digit
    r set = rank r added in): 1011 = ranks 0, 1 and 3.

    Taught in: Chapter 2, "Ring all-reduce".
    """
    rank, n = dist.get_rank(), dist.get_world_size()
    t = torch.full((n * numel_per_chunk,), 10 ** rank, dtype=torch.int64,
                   device=world().device)
    return [s.tolist() for s in ring_all_reduce_trace(t)]
