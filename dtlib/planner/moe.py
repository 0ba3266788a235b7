"""Expert parallelism in the planner: a Mixtral-style MoE, its memory and all-to-all.

Pure Python, like the rest of the planner. :class:`MixtralSpec` counts an MoE
transformer's parameters from its ``config.json`` fields (Mixtral, Jiang et al. 2024:
SwiGLU experts of three ``h x f`` matrices without bias, grouped key/value heads,
untied embedding and head, RMSNorm). :func:`ep_plan` prices expert parallelism over
``ep`` GPUs: model states per GPU (experts divided by ``ep``, the dense part whole)
and the step's all-to-all time on the link the ``ep`` group spans (Chapter 2's
alpha-beta model: ``ep - 1`` messages per all-to-all, the share ``(ep - 1)/ep`` of
the rows leaving the GPU under uniform routing). The formulas are Chapter 14's,
checked there against the module, the communication log and Hugging Face's Mixtral.

Taught in: Chapter 14, "What experts cost" (the planner of Chapter 11, extended).
"""

from __future__ import annotations

from dataclasses import dataclass

from dtlib.planner.specs import ClusterSpec

__all__ = ["MixtralSpec", "EPPlan", "ep_plan"]


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
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if self.num_experts_per_tok > self.num_local_experts:
            raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} must be "
                             f"<= num_local_experts={self.num_local_experts}")

    def params(self) -> dict[str, int]:
        """``{"total", "active", "expert", "dense"}`` parameters (active: what one
        token's forward uses; expert: one expert; dense: all but the experts).

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
                "active": l * (per_layer + self.num_experts_per_tok * expert) + embed,
                "expert": expert,
                "dense": l * per_layer + embed}


@dataclass(frozen=True)
class EPPlan:
    """What one configuration of expert parallelism costs per GPU.

    state_bytes: parameters, gradients and optimizer state (dense whole, experts
        divided by ``ep``).
    fits: ``state_bytes`` plus the cluster's reserve within the GPU's memory.
    a2a_bytes: bytes one GPU sends to other GPUs in the step's all-to-alls (four
        per MoE layer: dispatch and combine, forward and backward).
    a2a_seconds: their time on the link the ep group spans (NVLink inside a node).
    """

    state_bytes: float
    fits: bool
    a2a_bytes: float
    a2a_seconds: float


def ep_plan(spec: MixtralSpec, cluster: ClusterSpec, ep: int, tokens_per_gpu: int,
            *, bytes_per_param: int = 16, element_size: int = 2) -> EPPlan:
    """Memory and all-to-all time per GPU of ``spec`` with experts over ``ep`` GPUs.

    Args:
        spec: the model.
        cluster: the GPUs (memory, links, alpha).
        ep: expert-parallel size; divides the experts and, above one node, is a
            multiple of ``gpus_per_node``.
        tokens_per_gpu: tokens each GPU routes per step (micro-batch x sequence x
            accumulation steps).
        bytes_per_param: model-state bytes per parameter (16: mixed-precision AdamW).
        element_size: bytes per activation element sent (2: bf16).
    Returns:
        An :class:`EPPlan`.

    Taught in: Chapter 14, "What experts cost".
    """
    for name, value in (("ep", ep), ("tokens_per_gpu", tokens_per_gpu),
                        ("bytes_per_param", bytes_per_param),
                        ("element_size", element_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer")
    if spec.num_local_experts % ep:
        raise ValueError(f"ep={ep} must divide num_local_experts="
                         f"{spec.num_local_experts}")
    p = spec.params()
    layers = spec.num_hidden_layers
    local_experts = layers * spec.num_local_experts // ep * p["expert"]
    state = (p["dense"] + local_experts) * bytes_per_param
    rows = spec.num_experts_per_tok * tokens_per_gpu  # sent in each all-to-all
    off = rows * spec.hidden_size * element_size * (ep - 1) / ep
    a2a = 4 * layers * off
    bw = cluster.intra_node_bw if ep <= cluster.gpus_per_node else \
        cluster.inter_node_bw
    seconds = 4 * layers * (cluster.latency_s * (ep - 1)) + a2a / bw
    return EPPlan(float(state), state + cluster.reserved_bytes <= cluster.memory_bytes,
                  float(a2a), seconds)
