"""A mixture-of-experts layer on one process: router, capacity, dropping, aux losses.

A router (one linear map ``h -> E``) scores every token against ``E`` experts; each
token goes to its ``top_k`` experts, each expert is the GPT's MLP (``h -> 4h -> h``,
GELU; :class:`dtlib.models.MLP`), and the token's output is the gate-weighted sum of
its experts' outputs. With ``top_k = 1`` the gate is the router probability itself
(Switch Transformer, Fedus et al. 2022); with ``top_k > 1`` the ``k`` chosen
probabilities are renormalised to sum to one (GShard, Mixtral).

**Capacity and dropping.** Tokens are routed in *groups* (GShard's; one group per
expert-parallel rank, Chapter 14): within a group each expert takes at most
``capacity = ceil(capacity_factor * k * n / E)`` of the group's ``n`` tokens, first
choices before second choices, earlier tokens first. An assignment past the capacity is
dropped: that expert does not see the token, its gate is lost, and a token whose every
assignment is dropped leaves the layer as zero: the block's residual ``x + moe(x)``
carries it on unchanged. ``capacity_factor=None`` drops nothing.

**Auxiliary losses** (per group, averaged over groups; kept in ``self.aux_loss``):
Switch's load-balancing loss ``E * sum_e f_e P_e`` (``f_e``: share of the group's
assignments routed to expert ``e``, before dropping; ``P_e``: mean router probability
of ``e``), equal to 1 when the load is uniform; and ST-MoE's router z-loss, the mean
squared log-sum-exp of the router logits (Zoph et al. 2022), which keeps logits small.

Taught in: Chapter 14, "The MoE layer on one process".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from dtlib.models.gpt import MLP

__all__ = ["MoEConfig", "Routing", "route", "capacity", "MoE", "expert_mlp"]


@dataclass(frozen=True)
class MoEConfig:
    """Shape and routing of an MoE layer.

    n_experts: experts in the layer (E).
    top_k: experts per token (k), 1 (Switch) or more (GShard, Mixtral: 2).
    capacity_factor: slots per expert as a multiple of the even share ``k n / E``;
        None: no capacity, nothing dropped.
    aux_loss_coef: weight of Switch's load-balancing loss (Fedus et al. use 0.01).
    z_loss_coef: weight of the router z-loss (ST-MoE uses 0.001); 0 leaves it out.
    groups: routing groups on one process (capacity and aux losses per group): an
        expert-parallel run over ``ep`` ranks equals one process with ``groups=ep``.
    ffn_mult: expert width as a multiple of ``h`` (the GPT's MLP: 4).
    """

    n_experts: int = 4
    top_k: int = 1
    capacity_factor: float | None = None
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 0.0
    groups: int = 1
    ffn_mult: int = 4

    def __post_init__(self) -> None:
        for name in ("n_experts", "top_k", "groups", "ffn_mult"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if self.top_k > self.n_experts:
            raise ValueError(f"top_k={self.top_k} must be <= n_experts="
                             f"{self.n_experts}")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ValueError(f"capacity_factor={self.capacity_factor!r} must be > 0 "
                             "or None (no dropping)")
        for name in ("aux_loss_coef", "z_loss_coef"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)!r} must be >= 0")


def capacity(cfg: MoEConfig, n_tokens: int) -> int | None:
    """Slots per expert in a group of ``n_tokens``: ``ceil(cf * k * n / E)``.

    Taught in: Chapter 14, "Capacity and dropped tokens".
    """
    if cfg.capacity_factor is None:
        return None
    return math.ceil(cfg.capacity_factor * cfg.top_k * n_tokens / cfg.n_experts)


@dataclass
class Routing:
    """Where one group's tokens go: ``k * n`` assignments in priority order.

    expert, token, gate: per assignment, the expert, the token (row of the group) and
        the gate weight (differentiable, from the router's softmax).
    kept: per assignment, whether it fits in the expert's capacity.
    aux_loss: the weighted auxiliary losses of the group (a scalar tensor).
    """

    expert: torch.Tensor
    token: torch.Tensor
    gate: torch.Tensor
    kept: torch.Tensor
    aux_loss: torch.Tensor

    def counts(self, n_experts: int) -> torch.Tensor:
        """Tokens each expert processes (kept assignments), shape ``(E,)``."""
        return torch.bincount(self.expert[self.kept], minlength=n_experts)


def route(logits: torch.Tensor, cfg: MoEConfig) -> Routing:
    """Top-k routing of one group from router ``logits`` ``(n, E)``.

    Args:
        logits: the router's scores of the group's ``n`` tokens.
        cfg: the layer's configuration (``top_k``, capacity, loss weights).
    Returns:
        A :class:`Routing`: assignments choice-major (every token's first choice, then
        every second choice), each expert's first ``capacity`` assignments kept.

    Taught in: Chapter 14, "The MoE layer on one process".
    """
    n, n_experts = logits.shape
    probs = F.softmax(logits, dim=-1)
    gate, expert = probs.topk(cfg.top_k, dim=-1)  # (n, k)
    if cfg.top_k > 1:
        gate = gate / gate.sum(-1, keepdim=True)
    expert, gate = expert.t().reshape(-1), gate.t().reshape(-1)  # choice-major
    token = torch.arange(n, device=logits.device).repeat(cfg.top_k)
    onehot = F.one_hot(expert, n_experts)
    slot = (onehot.cumsum(0) - 1).gather(1, expert[:, None])[:, 0]  # place in queue
    cap = capacity(cfg, n)
    kept = slot < cap if cap is not None else torch.ones_like(expert, dtype=torch.bool)
    f = onehot.float().mean(0)  # share of the assignments routed to each expert
    aux = cfg.aux_loss_coef * n_experts * (f * probs.mean(0)).sum()
    if cfg.z_loss_coef:
        aux = aux + cfg.z_loss_coef * torch.logsumexp(logits, -1).pow(2).mean()
    return Routing(expert, token, gate, kept, aux)


def expert_mlp(hidden: int, ffn_mult: int = 4) -> MLP:
    """One expert: the GPT's MLP, ``h -> ffn_mult * h -> h`` with GELU, with biases."""
    return MLP((hidden, ffn_mult * hidden, hidden))


class MoE(nn.Module):
    """The MoE layer, all experts on this process.

    ``forward(x)`` takes ``(..., h)`` and returns the same shape; it leaves the
    group-averaged auxiliary loss in ``self.aux_loss`` and the tokens each expert
    processed in ``self.counts`` (``(E,)``, summed over groups).

    Args:
        hidden: model width h.
        cfg: a :class:`MoEConfig`.

    Taught in: Chapter 14, "The MoE layer on one process".
    """

    def __init__(self, hidden: int, cfg: MoEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.router = nn.Linear(hidden, cfg.n_experts, bias=False)
        self.experts = nn.ModuleList(expert_mlp(hidden, cfg.ffn_mult)
                                     for _ in range(cfg.n_experts))
        self.aux_loss = torch.zeros(())
        self.counts = torch.zeros(cfg.n_experts, dtype=torch.long)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.size(-1))
        if flat.size(0) % self.cfg.groups:
            raise ValueError(f"{flat.size(0)} tokens do not split into groups="
                             f"{self.cfg.groups}")
        outs, aux, counts = [], [], []
        for xg in flat.chunk(self.cfg.groups):
            r = route(self.router(xg), self.cfg)
            out = torch.zeros_like(xg)
            for e, expert in enumerate(self.experts):
                pick = r.kept & (r.expert == e)
                rows = r.token[pick]
                y = expert(xg[rows])  # an empty batch too: its gradients are zeros
                out = out.index_add(0, rows, r.gate[pick, None] * y)
            outs.append(out)
            aux.append(r.aux_loss)
            counts.append(r.counts(self.cfg.n_experts))
        self.aux_loss = torch.stack(aux).mean()
        self.counts = torch.stack(counts).sum(0).detach()
        return torch.cat(outs).reshape(x.shape)
