"""The MoE layer with its experts sharded over an expert-parallel group.

Rank ``r`` of an ``ep``-rank group holds experts ``r * E/ep .. (r+1) * E/ep - 1`` and
the whole (replicated) router. Its own tokens are one routing group (capacity and
auxiliary losses per rank, as GShard and Switch compute them), so a run over ``ep``
ranks equals one process with ``MoEConfig(groups=ep)``. One forward:

1. route this rank's tokens (:func:`~dtlib.expert_parallel.moe.route`), keep what
   fits, sort the kept assignments by expert (hence by destination rank);
2. dispatch: an all-to-all of the counts per expert, then of the token rows;
3. each local expert runs on every row it received, from every rank;
4. combine: the outputs go back by the reverse all-to-all, and each token sums its
   gate-weighted outputs (dropped assignments add nothing: the residual carries them).

Taught in: Chapter 14, "Expert parallelism on all-to-alls".
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from dtlib.expert_parallel.all_to_all import all_to_all, exchange_counts
from dtlib.expert_parallel.moe import MoE, route

__all__ = ["ExpertParallelMoE", "ep_world"]


def ep_world(group: Any = None) -> tuple[int, int]:
    """``(rank in group, group size)`` of the expert-parallel group (1 rank unset)."""
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


class ExpertParallelMoE(nn.Module):
    """An :class:`~dtlib.expert_parallel.moe.MoE` whose experts live on ``ep`` ranks.

    Built from the full layer (the same on every rank): keeps its router and the
    ``E/ep`` experts this rank owns, as ``experts`` (local index ``j`` is global
    expert ``rank * E/ep + j``). ``aux_loss`` and ``counts`` as in ``MoE``, for this
    rank's tokens; ``received``: rows its experts processed in the last forward.

    Args:
        moe: the full layer.
        group: the expert-parallel process group (None: all ranks).

    Taught in: Chapter 14, "Expert parallelism on all-to-alls".
    """

    def __init__(self, moe: MoE, group: Any = None) -> None:
        super().__init__()
        rank, ep = ep_world(group)
        if moe.cfg.n_experts % ep:
            raise ValueError(f"n_experts={moe.cfg.n_experts} must be divisible by "
                             f"ep={ep}")
        self.cfg, self.group, self.ep, self.ep_rank = moe.cfg, group, ep, rank
        self.local = moe.cfg.n_experts // ep
        self.first = rank * self.local  # global id of local expert 0
        self.router = moe.router
        self.experts = nn.ModuleList(moe.experts[self.first:self.first + self.local])
        self.aux_loss = torch.zeros(())
        self.counts = torch.zeros(moe.cfg.n_experts, dtype=torch.long)
        self.received = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.size(-1))
        r = route(self.router(flat), self.cfg)
        expert, token, gate = r.expert[r.kept], r.token[r.kept], r.gate[r.kept]
        order = torch.argsort(expert, stable=True)  # by expert, so by destination
        expert, token, gate = expert[order], token[order], gate[order]
        counts = torch.bincount(expert, minlength=self.cfg.n_experts)
        # 1. dispatch: counts first (rows of the (ep, E/ep) table), then the tokens
        got = exchange_counts(counts.view(self.ep, self.local), self.group)
        send = counts.view(self.ep, self.local).sum(1).tolist()
        recv = got.sum(1).tolist()
        rows = all_to_all(flat[token], recv, send, self.group)
        # 2. expert compute: rows arrive by source rank, then by expert
        which = torch.arange(self.local, device=x.device).repeat(self.ep)
        which = which.repeat_interleave(got.reshape(-1))
        by_expert = torch.argsort(which, stable=True)
        outs = [expert_j(rows[by_expert[which[by_expert] == j]])
                for j, expert_j in enumerate(self.experts)]
        y = torch.cat(outs)[torch.argsort(by_expert)]  # back to arrival order
        # 3. combine: back where each row came from, gate-weighted sum per token
        back = all_to_all(y, send, recv, self.group)
        out = torch.zeros_like(flat).index_add(0, token, gate[:, None] * back)
        self.aux_loss, self.counts, self.received = r.aux_loss, counts.detach(), \
            sum(recv)
        return out.reshape(x.shape)
