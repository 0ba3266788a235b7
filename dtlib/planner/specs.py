"""What the planner is asked about: a model, a cluster, a parallel configuration.

Three frozen dataclasses, each validated in ``__post_init__`` (a bad field raises
ValueError naming the field, the value and what is allowed). Units: bytes, FLOP/s,
bytes/s, seconds.

Taught in: Chapter 11, a planner checked against published runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

RECOMPUTE = ("none", "selective", "full")
#: The pipeline schedules the planner prices (Chapter 6): 1F1B, and the zero-bubble
#: ZB-H1 and ZB-V (two stages a rank, in a V), whose backward is split into B and W.
PP_SCHEDULES = ("1f1b", "zb-h1", "zb-v")


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be an integer >= 1")


def _positive_float(name: str, value: object) -> None:
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or not math.isfinite(value) or value <= 0):
        raise ValueError(f"{name}={value!r} must be a finite number > 0")


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer: GPT (Narayanan et al. 2021) or Llama-style.

    The planner's model (Chapter 11): the shape of a published run, counted but never
    built (the model that runs is ``dtlib.models.GPTConfig``, Chapter 1's memory
    estimate takes ``dtlib.memory.TrainingConfig``); ``vocab_size`` as in both.

    n_layers: transformer layers (l).
    hidden: model width (h).
    n_heads: query heads (a); divides ``hidden``.
    vocab_size: vocabulary (V).
    seq_len: tokens per sequence (s).
    ffn_hidden: MLP width; None means 4 * hidden (GPT).
    n_kv_heads: key/value heads (grouped-query attention); None means n_heads.
    gated_mlp: SwiGLU MLP (three ffn matrices, Llama) instead of GeLU (two, GPT).
        A gated model is counted Llama-style: no biases, RMSNorm, rotary positions,
        an output head not tied to the embedding.
    """

    n_layers: int
    hidden: int
    n_heads: int
    vocab_size: int
    seq_len: int
    ffn_hidden: int | None = None
    n_kv_heads: int | None = None
    gated_mlp: bool = False

    def __post_init__(self) -> None:
        for name in ("n_layers", "hidden", "n_heads", "vocab_size", "seq_len"):
            _positive_int(name, getattr(self, name))
        if self.ffn_hidden is None:
            object.__setattr__(self, "ffn_hidden", 4 * self.hidden)
        if self.n_kv_heads is None:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        _positive_int("ffn_hidden", self.ffn_hidden)
        _positive_int("n_kv_heads", self.n_kv_heads)
        if self.hidden % self.n_heads:
            raise ValueError(f"n_heads={self.n_heads} must divide hidden={self.hidden}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_kv_heads={self.n_kv_heads} must divide "
                             f"n_heads={self.n_heads}")
        if not isinstance(self.gated_mlp, bool):
            raise ValueError(f"gated_mlp={self.gated_mlp!r} must be True or False")

    @property
    def is_gpt(self) -> bool:
        """The shape Narayanan's Eq. 2 and 3 are written for (4h GeLU MLP, MHA)."""
        return (self.ffn_hidden == 4 * self.hidden and not self.gated_mlp
                and self.n_kv_heads == self.n_heads)

    @property
    def kv_hidden(self) -> int:
        """Width of K (and of V): hidden * n_kv_heads / n_heads."""
        return self.hidden * self.n_kv_heads // self.n_heads

    @property
    def layer_matrix_params(self) -> int:
        """Weights of one layer's matrices: Q, K, V, O and the MLP."""
        h, f = self.hidden, self.ffn_hidden
        attention = 2 * h * h + 2 * h * self.kv_hidden
        return attention + (3 if self.gated_mlp else 2) * h * f


@dataclass(frozen=True)
class ClusterSpec:
    """GPUs in nodes; bandwidths are per GPU and per direction.

    n_gpus: GPUs in the job; a multiple of ``gpus_per_node`` when above it.
    gpus_per_node: GPUs sharing the fast intra-node link (NVLink).
    memory_bytes: device memory of one GPU.
    peak_flops: dense 16-bit peak of one GPU (datasheet).
    intra_node_bw: bytes/s one GPU sends to another of its node (NVLink).
    inter_node_bw: bytes/s one GPU sends to another node (its own NIC).
    latency_s: alpha of the alpha-beta model, per message (Chapter 2).
    compute_efficiency: fraction of ``peak_flops`` the layers' kernels reach;
        a stated assumption, the same for every configuration.
    reserved_bytes: memory the model does not count (CUDA context, communication
        buffers, allocator fragmentation); ``fits`` keeps it free.
    name: a label for tables.
    """

    n_gpus: int
    gpus_per_node: int
    memory_bytes: float
    peak_flops: float
    intra_node_bw: float
    inter_node_bw: float
    latency_s: float = 5e-6
    compute_efficiency: float = 0.6
    reserved_bytes: float = 0.0
    name: str = field(default="custom")

    def __post_init__(self) -> None:
        _positive_int("n_gpus", self.n_gpus)
        _positive_int("gpus_per_node", self.gpus_per_node)
        if self.n_gpus > self.gpus_per_node and self.n_gpus % self.gpus_per_node:
            raise ValueError(f"n_gpus={self.n_gpus} must be a multiple of "
                             f"gpus_per_node={self.gpus_per_node}")
        for name in ("memory_bytes", "peak_flops", "intra_node_bw", "inter_node_bw",
                     "latency_s"):
            _positive_float(name, getattr(self, name))
        if not 0 < self.compute_efficiency <= 1:
            raise ValueError(f"compute_efficiency={self.compute_efficiency!r} "
                             "must be in (0, 1]")
        if not 0 <= self.reserved_bytes < self.memory_bytes:
            raise ValueError(f"reserved_bytes={self.reserved_bytes!r} must be in "
                             f"[0, memory_bytes={self.memory_bytes})")

    @classmethod
    def preset(cls, name: str, n_gpus: int, **overrides: float) -> "ClusterSpec":
        """A cluster of ``n_gpus`` GPUs of a named kind (see ``PRESETS``).

        Args:
            name: "A100-80GB" or "H100-80GB".
            n_gpus: GPUs in the job.
            overrides: fields to change, e.g. ``compute_efficiency=0.5``.
        Returns:
            The :class:`ClusterSpec`.

        Taught in: Chapter 11, a planner checked against published runs.
        """
        if name not in PRESETS:
            raise ValueError(f"name={name!r} is not one of {sorted(PRESETS)}")
        return cls(n_gpus=n_gpus, name=name, **{**PRESETS[name], **overrides})


# Datasheet numbers. 80 GB parts hold 80 GiB; 4 GB are kept free (reserved_bytes).
# A100 (DGX A100 / Selene, Narayanan et al. 2021 §5): 312 TFLOP/s bf16 dense,
# NVLink 3 at 600 GB/s both ways (300 GB/s each way), eight 200 Gb/s HDR
# InfiniBand NICs per node, one per GPU (25 GB/s).
# H100 (Grand Teton, Dubey et al. 2024 §3.3): 989 TFLOP/s bf16 dense, NVLink 4 at
# 900 GB/s both ways (450 GB/s each way), one 400 Gb/s RoCE NIC per GPU (50 GB/s).
PRESETS: dict[str, dict] = {
    "A100-80GB": dict(gpus_per_node=8, memory_bytes=80 * 2**30, peak_flops=312e12,
                      intra_node_bw=300e9, inter_node_bw=25e9, reserved_bytes=4e9),
    "H100-80GB": dict(gpus_per_node=8, memory_bytes=80 * 2**30, peak_flops=989e12,
                      intra_node_bw=450e9, inter_node_bw=50e9, reserved_bytes=4e9),
}


@dataclass(frozen=True)
class ParallelConfig:
    """How the GPUs split the work: dp x cp x pp x tp = number of GPUs.

    dp: data-parallel replicas (each sees global_batch / dp sequences).
    tp: tensor-parallel ranks inside a layer (Megatron; Chapter 5).
    pp: pipeline ranks (Chapter 6); ``schedule`` says how they run.
    zero_stage: 0-3, sharding over the dp x cp ranks (Chapter 4); 3 is FSDP.
    micro_batch: sequences per micro-batch on one replica (b).
    recompute: "none", "selective" (attention core; what FlashAttention also does)
        or "full" (keep each layer's input, recompute the layer in backward).
    cp: context-parallel ranks splitting each sequence (ring/all-gather attention).
    sequence_parallel: Megatron sequence parallelism inside the tp group
        (Korthikanti et al. 2022); it changes memory only, its all-gather +
        reduce-scatter cost what the all-reduce they replace costs.
    schedule: the pipeline's schedule, one of :data:`PP_SCHEDULES` ("zb-v": each
        of the pp ranks holds two stages, so 2 pp <= n_layers).
    """

    dp: int
    tp: int
    pp: int
    zero_stage: int = 0
    micro_batch: int = 1
    recompute: str = "none"
    cp: int = 1
    sequence_parallel: bool = True
    schedule: str = "1f1b"

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "micro_batch", "cp"):
            _positive_int(name, getattr(self, name))
        if self.zero_stage not in (0, 1, 2, 3) or isinstance(self.zero_stage, bool):
            raise ValueError(f"zero_stage={self.zero_stage!r} must be 0, 1, 2 or 3")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"recompute={self.recompute!r} is not one of {RECOMPUTE}")
        if self.schedule not in PP_SCHEDULES:
            raise ValueError(f"schedule={self.schedule!r} is not one of "
                             f"{PP_SCHEDULES}")
        if not isinstance(self.sequence_parallel, bool):
            raise ValueError(f"sequence_parallel={self.sequence_parallel!r} "
                             "must be True or False")

    @property
    def world_size(self) -> int:
        """dp * cp * pp * tp."""
        return self.dp * self.cp * self.pp * self.tp

    def label(self) -> str:
        """A short name such as ``dp4 tp8 pp12 z0 b1 full``."""
        cp = f" cp{self.cp}" if self.cp > 1 else ""
        schedule = f" {self.schedule}" if self.pp > 1 and self.schedule != "1f1b" \
            else ""
        return (f"dp{self.dp} tp{self.tp} pp{self.pp}{cp} z{self.zero_stage} "
                f"b{self.micro_batch} {self.recompute}{schedule}")
