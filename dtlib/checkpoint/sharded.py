"""Checkpoints of sharded (ZeRO-3 / FSDP2) state: every rank writes what it holds.

Under FSDP2 each parameter and each optimizer moment is a DTensor of which a rank holds
one dim-0 shard. ``torch.save`` on rank 0 writes rank 0's shards only: a quarter of the
model on four ranks. The fix is a *distributed* checkpoint: every rank writes its
shards, plus metadata that says where each shard sits in the global tensor, so a job of
any size can read back the rows it needs.

This module has a teaching version of that format (:func:`save_sharded`,
:func:`load_sharded`, :func:`load_full`: one ``rank{r}.pt`` per rank and a
``metadata.json`` of global shapes and row offsets), and the rank functions the
chapter runs to show it agrees exactly with ``torch.distributed.checkpoint`` (DCP),
saved on 4 ranks and loaded on 2 and on 1.

Taught in: Chapter 9, "Sharded state".
"""

from __future__ import annotations

import json
import os
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

try:  # public since torch 2.5
    from torch.distributed.tensor import DTensor, Replicate, Shard
except ImportError:  # pragma: no cover - older torch
    from torch.distributed._tensor import DTensor, Replicate, Shard

from dtlib.checkpoint.state import atomic_save

__all__ = ["flatten", "state_bytes", "save_sharded", "load_sharded", "load_full",
           "dcp_load_full"]


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts and lists -> ``{"a/b/0": leaf}`` (the keys of the file format)."""
    if isinstance(tree, dict):
        items = tree.items()
    elif isinstance(tree, (list, tuple)):
        items = enumerate(tree)
    else:
        return {prefix: tree}
    out: dict[str, Any] = {}
    for k, v in items:
        out.update(flatten(v, f"{prefix}/{k}" if prefix else str(k)))
    return out


def state_bytes(state: Any) -> dict[str, int]:
    """Bytes of the tensors in ``state``: ``{"local", "global"}``.

    ``local`` counts what this rank holds (a DTensor's local shard), ``global`` what
    the whole tensor holds. Equal for plain tensors.

    Taught in: Chapter 9, "Rank 0 holds a shard".
    """
    local = glob = 0
    for leaf in flatten(state).values():
        if isinstance(leaf, DTensor):
            local += leaf.to_local().numel() * leaf.element_size()
            glob += leaf.numel() * leaf.element_size()
        elif isinstance(leaf, torch.Tensor):
            local += leaf.numel() * leaf.element_size()
            glob += leaf.numel() * leaf.element_size()
    return {"local": local, "global": glob}


def _check_dim0(key: str, t: DTensor) -> None:
    ok = all(isinstance(p, (Shard, Replicate)) for p in t.placements) and all(
        p.dim == 0 for p in t.placements if isinstance(p, Shard))
    if not ok or t.device_mesh.ndim != 1:
        raise ValueError(f"{key}: placements={t.placements} not supported; the "
                         "teaching format handles a 1-D mesh with Shard(0) or "
                         "Replicate()")


def _row_offsets(leaves: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """``{key: (first global row, rows)}`` of this rank's shard of each DTensor."""
    mine = {k: (v.to_local().shape[0] if v.to_local().dim() else 1)
            for k, v in leaves.items() if isinstance(v, DTensor)}
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)  # one collective for all tensors
    rank, out = dist.get_rank(), {}
    for k in mine:
        if isinstance(leaves[k].placements[0], Replicate):
            out[k] = (0, leaves[k].shape[0])
            continue
        out[k] = (sum(everyone[r][k] for r in range(rank)), mine[k])
    return out


def save_sharded(state: dict[str, Any], ckpt_dir: str) -> None:
    """Every rank writes ``rank{r}.pt`` (its shards); rank 0 also ``metadata.json``.

    DTensors sharded on dim 0 are written by every rank that holds rows of them; plain
    tensors (replicated, e.g. AdamW's step counts) by rank 0 only. Non-tensor leaves
    (hyperparameters) are not saved: they come from the code that rebuilds the job.
    Collective: every rank must call it.

    Taught in: Chapter 9, "A sharded format by hand".
    """
    leaves = {k: v for k, v in flatten(state).items() if isinstance(v, torch.Tensor)}
    for k, v in leaves.items():
        if isinstance(v, DTensor):
            _check_dim0(k, v)
    rows = _row_offsets(leaves)
    rank = dist.get_rank()
    shard: dict[str, torch.Tensor] = {}
    meta: dict[str, Any] = {}
    for k, v in leaves.items():
        if isinstance(v, DTensor):
            replicated = isinstance(v.placements[0], Replicate)
            if rank == 0 or not replicated:
                shard[k] = v.to_local().detach().cpu()
            meta[k] = {"shape": list(v.shape), "dtype": str(v.dtype)}
        elif rank == 0:
            shard[k] = v.detach().cpu()
        if not isinstance(v, DTensor):
            meta[k] = {"shape": list(v.shape), "dtype": str(v.dtype)}
    my_rows = {k: (rows[k] if k in rows and not isinstance(leaves[k].placements[0],
                                                          Replicate) else None)
               for k in shard}
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, my_rows)
    os.makedirs(ckpt_dir, exist_ok=True)
    atomic_save(shard, os.path.join(ckpt_dir, f"rank{rank}.pt"))
    if rank == 0:
        for k in meta:
            meta[k]["shards"] = [[r, *(everyone[r][k] or (0, None))]
                                 for r in range(len(everyone)) if k in everyone[r]]
        doc = {"world_size": len(everyone), "tensors": meta}
        tmp = os.path.join(ckpt_dir, ".metadata.json.part")
        with open(tmp, "w") as f:
            json.dump(doc, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(ckpt_dir, "metadata.json"))
    dist.barrier()


class _Reader:
    """Reads the rows ``[start, start + n)`` of a saved tensor from the rank files."""

    def __init__(self, ckpt_dir: str) -> None:
        self.dir = ckpt_dir
        with open(os.path.join(ckpt_dir, "metadata.json")) as f:
            self.meta = json.load(f)
        self.files: dict[int, dict[str, torch.Tensor]] = {}

    def _file(self, rank: int) -> dict[str, torch.Tensor]:
        if rank not in self.files:
            self.files[rank] = torch.load(os.path.join(self.dir, f"rank{rank}.pt"),
                                          map_location="cpu", weights_only=True)
        return self.files[rank]

    def rows(self, key: str, start: int = 0, n: int | None = None) -> torch.Tensor:
        if key not in self.meta["tensors"]:
            raise KeyError(f"{key!r} is not in the checkpoint at {self.dir}")
        info = self.meta["tensors"][key]
        shape = info["shape"]
        for rank, first, count in info["shards"]:
            if count is None:  # a whole (replicated) tensor
                full = self._file(rank)[key]
                return full if n is None or not shape else full[start:start + n]
        n = shape[0] - start if n is None else n
        parts = []
        for rank, first, count in sorted(info["shards"], key=lambda s: s[1]):
            lo, hi = max(start, first), min(start + n, first + count)
            if lo < hi:  # this saved shard overlaps the rows we need
                parts.append(self._file(rank)[key][lo - first:hi - first])
        if not parts:
            return torch.empty([0, *shape[1:]], dtype=getattr(torch, info["dtype"][6:]))
        return torch.cat(parts)


def load_sharded(state: dict[str, Any], ckpt_dir: str) -> None:
    """Fill ``state``'s tensors in place from a :func:`save_sharded` checkpoint.

    ``state`` is a template from the *new* job (e.g. ``get_state_dict`` of a freshly
    sharded model): each DTensor receives the global rows its local shard covers, read
    from whichever saved shards overlap them, so the world size may differ from the
    saving job's. Collective when ``state`` holds DTensors.

    Taught in: Chapter 9, "A sharded format by hand".
    """
    reader = _Reader(ckpt_dir)
    leaves = {k: v for k, v in flatten(state).items() if isinstance(v, torch.Tensor)}
    rows = _row_offsets(leaves) if dist.is_initialized() else {}
    with torch.no_grad():
        for k, v in leaves.items():
            if isinstance(v, DTensor):
                local = v.to_local()
                first, n = rows[k]
                local.copy_(reader.rows(k, first, n).reshape(local.shape))
            else:
                v.copy_(reader.rows(k).reshape(v.shape))


def load_full(ckpt_dir: str) -> dict[str, torch.Tensor]:
    """Every tensor of a :func:`save_sharded` checkpoint, reassembled, in one process.

    Returns:
        ``{flattened key: full tensor}``.

    Taught in: Chapter 9, "A sharded format by hand".
    """
    reader = _Reader(ckpt_dir)
    return {k: reader.rows(k) for k in reader.meta["tensors"]}


def dcp_load_full(ckpt_dir: str, template: dict[str, Any]) -> dict[str, Any]:
    """Load a DCP checkpoint into plain (unsharded) tensors ``template`` in one process.

    Without a process group DCP runs with ``no_dist=True``: this process reads every
    shard it needs. Returns ``template``, filled.
    """
    with warnings.catch_warnings():  # "assuming the intent is to load in a single
        warnings.simplefilter("ignore")  # process": yes, that is the intent
        dcp.load(template, checkpoint_id=ckpt_dir, no_dist=not dist.is_initialized())
    return template


