"""Mixed precision across ranks: the casts one process simulates, the flag ranks share.

Two things change when gradients cross ranks:

- Each rank computes its gradient in ``param_dtype`` on its own rows, casts it to
  ``reduce_dtype`` and the reduce-scatter sums the N ranks' gradients in that dtype.
  :class:`SimulatedRanks` is the one-process computation with exactly those casts (the
  reference a sharded mixed-precision run is compared with): one 16-bit copy of the
  fp32 master, the N ranks' rows run one after the other, each gradient cast to
  ``reduce_dtype`` and summed in rank order, the mean cast up into the master's
  ``.grad``.
- With sharded gradients a rank sees only its shard, so an inf or NaN found there is
  one rank's news. :class:`ShardedLossScaler` all-reduces the flag (MAX) over the
  group before deciding to skip, as torch's ``ShardedGradScaler`` and Megatron's
  found-inf all-reduce over the model-parallel group do; without it one rank steps
  while another skips, and their loss scales part.

Taught in: Chapter 7, "Mixed precision across ranks".
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from dtlib.data_parallel.parallelism import rows_of_rank
from dtlib.models.run import Batch, Parallelism
from dtlib.precision.loss_scaling import DynamicLossScaler
from dtlib.runtime.dist import world

__all__ = ["SimulatedRanks", "ShardedLossScaler", "REDUCE_DTYPES"]

#: Dtypes a gradient reduction may run in.
REDUCE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class SimulatedRanks(Parallelism):
    """One process computing what ``world_size`` ranks do under a mixed-precision
    policy: forward and backward in ``param_dtype`` per rank's rows, the gradients
    summed in ``reduce_dtype`` in rank order, averaged, kept in fp32 on the master.

    Args:
        world_size: the ranks simulated (must divide the batch's rows).
        param_dtype: the compute dtype of the copy (``torch.float32`` too).
        reduce_dtype: the dtype of the sum (None: ``param_dtype``, FSDP2's default).

    Taught in: Chapter 7, "Mixed precision across ranks".
    """

    def __init__(self, world_size: int, param_dtype: torch.dtype = torch.bfloat16,
                 reduce_dtype: torch.dtype | None = None) -> None:
        if isinstance(world_size, bool) or not isinstance(world_size, int) \
                or world_size < 1:
            raise ValueError(f"world_size={world_size!r} must be an int >= 1")
        reduce_dtype = reduce_dtype or param_dtype
        for name, value in (("param_dtype", param_dtype),
                            ("reduce_dtype", reduce_dtype)):
            if value not in REDUCE_DTYPES:
                raise ValueError(f"{name}={value!r} not allowed; allowed: "
                                 f"{REDUCE_DTYPES}")
        self.world_size = world_size
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype
        self.name = f"simulated-{world_size}"
        # backward averages over the simulated ranks, as data parallelism does
        # (accumulation's normaliser multiplies it back); they live in this process
        self.dp_size = world_size

    def apply(self, model: nn.Module) -> nn.Module:
        self.low = copy.deepcopy(model).to(self.param_dtype)  # keeps ties tied
        return model

    def sum_over_dp(self, t: torch.Tensor) -> torch.Tensor:
        """The simulated ranks' tokens are all in this process: no collective."""
        return t

    def global_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``forward_backward`` already returns the simulated ranks' mean."""
        return loss

    def forward_backward(self, wrapped: nn.Module, batch: Batch, loss_fn: Any,
                         scale: float = 1.0, scaler: Any = None) -> torch.Tensor:
        with torch.no_grad():
            for lo, hi in zip(self.low.parameters(), wrapped.parameters()):
                lo.copy_(hi)  # every rank casts the same master values
        total: list[torch.Tensor | None] | None = None
        losses = []
        for rank in range(self.world_size):
            self.low.zero_grad(set_to_none=True)
            loss = loss_fn(self.low, *rows_of_rank(batch, rank, self.world_size))
            weighted = loss * scale if scale != 1.0 else loss
            (scaler.scale(weighted) if scaler is not None else weighted).backward()
            grads = [None if p.grad is None else p.grad.to(self.reduce_dtype)
                     for p in self.low.parameters()]
            total = grads if total is None else [
                g if t is None else t if g is None else t + g  # in reduce_dtype
                for t, g in zip(total, grads)]
            losses.append(loss.detach().float())
        for g, master in zip(total or [], wrapped.parameters()):
            if g is not None:
                mean = (g / self.world_size).to(master.dtype)
                master.grad = mean if master.grad is None else master.grad + mean
        return torch.stack(losses).mean()


class ShardedLossScaler(DynamicLossScaler):
    """:class:`DynamicLossScaler` whose overflow flag is agreed across ``group``.

    Each rank checks its own gradient shards, then one all-reduce (MAX) of the flag
    makes every rank skip, and back off, together. Use it with sharded gradients
    (ZeRO-2/3, FSDP); replicated gradients (DDP) are identical on every rank and need
    no all-reduce.

    Args:
        group: the ranks that hold shards of one model's gradients (default: the
            world).
        **kwargs: :class:`DynamicLossScaler`'s.

    Taught in: Chapter 7, "Mixed precision across ranks".
    """

    def __init__(self, group: Any = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.group = group

    def _found_inf(self, st: dict[str, Any]) -> bool:
        if st["inf"] is None:
            flag = torch.zeros(1, dtype=torch.float32, device=world().device)
            for found in st["found_inf"]:  # one per device this rank's shards use
                flag = torch.maximum(flag, found.to(flag.device))
            if dist.is_available() and dist.is_initialized():
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
            st["inf"] = bool(flag.item())  # the step's one host synchronisation
        return st["inf"]
