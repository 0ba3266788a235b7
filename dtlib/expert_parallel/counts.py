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

:class:`MixtralSpec` counts Mixtral's parameters (Jiang et al. 2024) from its config:
experts are SwiGLU MLPs (three ``h x f`` matrices, no bias), attention has grouped
key/value heads, embeddings and head are untied.

Taught in: Chapter 14, "What experts cost".
"""

from __future__ import annotations

from dataclasses import dataclass

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


@dataclass(frozen=True)
class MixtralSpec:
    """A Mixtral-style configuration (field names as in its ``config.json``).

    hidden_size: h. intermediate_size: each expert's SwiGLU width f.
    num_hidden_layers: l. num_attention_heads: a. num_key_value_heads: grouped K/V.
    vocab_size: V. num_local_experts: E. num_experts_per_tok: k.
    head_dim: per head; default ``h / a``.
    """

    hidden_size: int = 4096
    intermediate_size: int = 14336
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    vocab_size: int = 32000
    num_local_experts: int = 8
    num_experts_per_tok: int = 2
    head_dim: int | None = None

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "vocab_size",
                     "num_local_experts", "num_experts_per_tok"):
            _positive(**{name: getattr(self, name)})
        if self.num_experts_per_tok > self.num_local_experts:
            raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} must be "
                             f"<= num_local_experts={self.num_local_experts}")

    def params(self) -> dict[str, int]:
        """``{"total", "active"}`` parameters (active: what one token's forward uses).

        Taught in: Chapter 14, "What experts cost".
        """
        h, d = self.hidden_size, self.head_dim or self.hidden_size // \
            self.num_attention_heads
        attn = 2 * h * self.num_attention_heads * d \
            + 2 * h * self.num_key_value_heads * d  # q, o; k, v
        expert = 3 * h * self.intermediate_size  # gate, up, down
        per_layer = attn + h * self.num_local_experts + 2 * h  # router, 2 norms
        embed = 2 * self.vocab_size * h + h  # embedding, head, final norm
        l = self.num_hidden_layers  # noqa: E741
        return {"total": l * (per_layer + self.num_local_experts * expert) + embed,
                "active": l * (per_layer + self.num_experts_per_tok * expert) + embed}
