"""What an MoE layer costs, as formulas: parameters, FLOPs, all-to-all bytes, memory.

For the book's MoE (experts are the GPT's MLP ``h -> f h -> h`` with biases, a router
``h -> E`` without bias), per layer:

- parameters: one expert ``2 f h^2 + f h + h``; the layer ``E`` experts plus ``h E``
  for the router (*total*); a token meets only ``k`` experts and the router
  (*active*): capacity grows with ``E`` at a fixed cost per token;
- forward FLOPs per token (matmuls, 2 per multiply-add): ``2 h E`` (router) plus
  ``k * 4 f h^2`` (its experts), i.e. ``k`` dense MLPs;
- all-to-all per token (expert parallelism): dispatch and combine each move ``k``
  rows of ``h`` elements forward, and again backward; of them a share
  ``(ep - 1)/ep`` leaves the rank when routing is uniform. The counts exchange adds
  ``E`` integers per rank and layer;
- memory per rank: the experts' parameters, gradients and optimizer state divided by
  ``ep``; the dense part whole on every rank.

:class:`MixtralSpec` (from the planner, :mod:`dtlib.planner.moe`, which prices expert
parallelism at scale) counts Mixtral's parameters (Jiang et al. 2024) from its config.

Taught in: Chapter 14, "What experts cost".
"""

from __future__ import annotations

from dtlib.planner.moe import MixtralSpec

__all__ = ["expert_params", "moe_layer_params", "moe_layer_flops", "a2a_elements",
           "ep_a2a_bytes", "ep_grad_bytes", "ep_memory_bytes", "MixtralSpec"]


def _positive(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer")


def expert_params(hidden: int, ffn_mult: int = 4) -> int:
    """Parameters of one expert (the GPT's MLP with biases): ``2 f h^2 + f h + h``.

    Taught in: Chapter 14, "What experts cost".
    """
    _positive(hidden=hidden, ffn_mult=ffn_mult)
    f = ffn_mult * hidden
    return 2 * f * hidden + f + hidden


def moe_layer_params(hidden: int, n_experts: int, top_k: int, ffn_mult: int = 4
                     ) -> dict[str, int]:
    """``{"total", "active"}`` parameters of one MoE layer (router included).

    Taught in: Chapter 14, "What experts cost".
    """
    _positive(n_experts=n_experts, top_k=top_k)
    one, router = expert_params(hidden, ffn_mult), hidden * n_experts
    return {"total": n_experts * one + router, "active": top_k * one + router}


def moe_layer_flops(tokens: int, hidden: int, n_experts: int, assignments: int,
                    ffn_mult: int = 4) -> int:
    """Forward matmul FLOPs of one MoE layer: ``2 h E`` per token for the router and
    ``4 f h^2`` per (kept) assignment; ``assignments = k * tokens`` when nothing is
    dropped.

    Taught in: Chapter 14, "What experts cost".
    """
    _positive(tokens=tokens, hidden=hidden, n_experts=n_experts)
    f = ffn_mult * hidden
    return 2 * hidden * n_experts * tokens + 4 * f * hidden * assignments


def a2a_elements(rows: int, hidden: int) -> int:
    """Elements one rank puts into one all-to-all of tokens: ``rows * h``. The
    dispatch sends its kept assignments (``k`` rows per token when nothing is
    dropped), the combine sends back the rows its experts received (torch's message
    size: the part that stays on the rank included).

    Taught in: Chapter 14, "What experts cost".
    """
    if rows < 0:
        raise ValueError(f"rows={rows!r} must be >= 0")
    _positive(hidden=hidden)
    return rows * hidden


def ep_a2a_bytes(kept: int, received: int, hidden: int, n_experts: int,
                 element_size: int = 4, count_size: int = 8) -> int:
    """All-to-all bytes one rank sends for one MoE layer, forward and backward.

    The counts (``E`` integers), the dispatch (``kept`` rows) and the combine
    (``received`` rows back) forward; backward, the combine's gradient (``kept``
    rows) and the dispatch's (``received`` rows). Over all ranks ``kept`` and
    ``received`` sum to the same number: ``4 k h`` elements per token and layer
    when nothing is dropped.

    Taught in: Chapter 14, "What experts cost".
    """
    return n_experts * count_size + 2 * element_size * (
        a2a_elements(kept, hidden) + a2a_elements(received, hidden))


def ep_grad_bytes(dense: int, expert: int, moe_layers: int, n_experts: int, ep: int,
                  element_size: int = 4) -> dict[str, int]:
    """Gradient bytes one rank all-reduces per step under ep x dp.

    Args:
        dense: parameters outside the experts (attention, norms, routers, embeddings).
        expert: parameters of one expert; moe_layers: MoE layers; n_experts: E.
        ep: expert-parallel size (divides E).
    Returns:
        ``{"world": dense bytes, "edp": the local experts' bytes}``: the message of
        the world's all-reduce and of the expert-data-parallel group's.

    Taught in: Chapter 14, "Expert and data parallelism together".
    """
    _positive(dense=dense, expert=expert, moe_layers=moe_layers, n_experts=n_experts,
              ep=ep)
    if n_experts % ep:
        raise ValueError(f"n_experts={n_experts} must be divisible by ep={ep}")
    return {"world": dense * element_size,
            "edp": moe_layers * (n_experts // ep) * expert * element_size}


def ep_memory_bytes(dense: int, expert: int, moe_layers: int, n_experts: int, ep: int,
                    bytes_per_param: int = 16) -> dict[str, int]:
    """Model-state bytes per rank: ``{"dense", "experts", "total"}``.

    ``bytes_per_param``: parameter, gradient and optimizer state together (16 for
    mixed-precision AdamW, ZeRO's count; 12 for fp32 SGD with momentum).

    Taught in: Chapter 14, "What experts cost".
    """
    _positive(bytes_per_param=bytes_per_param)
    g = ep_grad_bytes(dense, expert, moe_layers, n_experts, ep, 1)
    out = {"dense": g["world"] * bytes_per_param, "experts": g["edp"] * bytes_per_param}
    out["total"] = out["dense"] + out["experts"]
    return out
