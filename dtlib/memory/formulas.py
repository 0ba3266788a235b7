"""Memory math for training: model states, activations, parameter counts, a planner.

Formulas, each from the paper that derived it:
- model states (parameters, gradients, optimizer state) and their ZeRO partitioning,
  Rajbhandari et al. 2020, §3.1 and §5;
- activations saved for backward by a transformer layer in 16-bit training, with
  tensor/sequence parallelism and recomputation, Korthikanti et al. 2022, Table 2;
- the GPT parameter count of Narayanan et al. 2021, Eq. 2.

Measurement (``measure_model_states``, ``measure_activations``) lives in
``dtlib.memory.measure`` and is re-exported here, so that the formulas are checked
against what PyTorch actually allocates rather than believed.

Units: bytes. ``GB`` means 1e9 bytes, as in the ZeRO paper (7.5B x 16 B = 120 GB).

Taught in: Chapter 1, memory math.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

GB = 1e9

# Bytes per parameter for (params, grads) and the optimizer's K, per precision.
# "mixed": 16-bit params and grads; the optimizer keeps an fp32 master copy (4 B)
# plus its own fp32 state. "fp32": everything fp32, no master copy needed.
_OPT_STATE_FP32 = {"adam": 8, "sgd": 0, "sgd_momentum": 4}  # moments, fp32
PRECISIONS = ("fp32", "mixed")
OPTIMIZERS = tuple(_OPT_STATE_FP32)
RECOMPUTE = ("none", "selective", "full")
# How attention is computed: "explicit" materialises the s x s softmax (and dropout) and
# autograd saves it; "sdpa" is a fused kernel (FlashAttention, PyTorch's
# scaled_dot_product_attention) that recomputes it blockwise in backward.
ATTENTION = ("explicit", "sdpa")


def _check_int(name: str, value: object, minimum: int = 1) -> int:
    """A positive integer (or an integral float such as 175e9)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name}={value!r} must be an integer >= {minimum}")
    if isinstance(value, float) and not (math.isfinite(value) and value.is_integer()):
        raise ValueError(f"{name}={value!r} must be an integer >= {minimum}")
    if value < minimum:
        raise ValueError(f"{name}={value!r} must be an integer >= {minimum}")
    return int(value)


def _check_choice(name: str, value: object, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not one of {allowed}")


def bytes_per_param(precision: str = "mixed",
                    optimizer: str = "adam") -> tuple[int, int, int]:
    """Bytes per parameter held as (params, grads, optimizer state), unpartitioned.

    Args:
        precision: "mixed" (2 + 2 + K with K = 4 for the fp32 master copy + the
            optimizer's fp32 state) or "fp32" (4 + 4 + optimizer state).
        optimizer: "adam" (two moments), "sgd_momentum" (one buffer), "sgd" (none).
    Returns:
        ``(param_bytes, grad_bytes, optimizer_bytes)``; mixed Adam is (2, 2, 12).

    Taught in: Chapter 1, the corrected accounting.
    """
    _check_choice("precision", precision, PRECISIONS)
    _check_choice("optimizer", optimizer, OPTIMIZERS)
    if precision == "fp32":
        return 4, 4, _OPT_STATE_FP32[optimizer]
    return 2, 2, 4 + _OPT_STATE_FP32[optimizer]


@dataclass(frozen=True)
class ModelStates:
    """Bytes of model states held by one device.

    params: the parameters this device stores (full, or its 1/dp shard in ZeRO-3).
    grads: the gradients it keeps (its shard from ZeRO-2 on).
    optimizer: optimizer state incl. the fp32 master copy (its shard from ZeRO-1 on).
    """

    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        """params + grads + optimizer."""
        return self.params + self.grads + self.optimizer


def model_state_bytes(n_params: int, *, zero_stage: int = 0, dp: int = 1,
                      precision: str = "mixed", optimizer: str = "adam") -> ModelStates:
    """Per-device bytes of parameters, gradients and optimizer state.

    ZeRO-DP (Rajbhandari et al. 2020, §5) partitions over the ``dp`` data-parallel
    ranks: stage 1 the optimizer state (P_os), stage 2 also the gradients (P_os+g),
    stage 3 also the parameters (P_os+g+p). A partitioned term holds
    ``ceil(n_params / dp)`` parameters' worth: flat shards are padded to equal size.

    Args:
        n_params: parameters of the model (or of this device's model-parallel part).
        zero_stage: 0 (plain data parallelism) to 3.
        dp: data-parallel degree N_d, >= 1.
        precision: "mixed" (2 + 2 + 12 bytes/param for Adam) or "fp32" (4 + 4 + 8).
        optimizer: "adam", "sgd" or "sgd_momentum".
    Returns:
        A frozen :class:`ModelStates` with ``params``, ``grads``, ``optimizer``,
        ``total`` in bytes.

    Taught in: Chapter 1, ZeRO Table 1.
    """
    n = _check_int("n_params", n_params)
    _check_int("dp", dp)
    if zero_stage not in (0, 1, 2, 3) or isinstance(zero_stage, bool):
        raise ValueError(f"zero_stage={zero_stage!r} must be one of 0, 1, 2, 3")
    p, g, k = bytes_per_param(precision, optimizer)
    shard = -(-n // dp)  # ceil: the padded shard one rank owns
    return ModelStates(params=p * (shard if zero_stage >= 3 else n),
                       grads=g * (shard if zero_stage >= 2 else n),
                       optimizer=k * (shard if zero_stage >= 1 else n))


def activation_bytes(seq_len: int, micro_batch: int, hidden: int, n_heads: int,
                     n_layers: int, *, tp: int = 1, sequence_parallel: bool = False,
                     recompute: str = "none", attention: str = "explicit") -> int:
    """Bytes of activations saved for backward by ``n_layers`` transformer layers.

    Korthikanti et al. 2022, Table 2, per layer (16-bit activations, 1-byte dropout
    masks, an MLP of width 4h; s = seq_len, b = micro_batch, h = hidden,
    a = n_heads, t = tp):

    ===============================  =========================
    none, t = 1                      sbh (34 + 5as/h)
    none, tensor parallel            sbh (10 + 24/t + 5as/(ht))
    none, tensor + sequence par.     sbh (34/t + 5as/(ht))
    selective                        sbh (10 + 24/t)
    selective + sequence par.        sbh 34/t
    full (keep each layer's input)   2sbh  (2sbh/t with sequence parallelism)
    ===============================  =========================

    The total is per-layer x ``n_layers``; the embedding, final norm and loss
    (Korthikanti §4.3, < 1 % at scale) are not added. ``sequence_parallel`` with
    ``tp=1`` is allowed and changes nothing (there is one rank to split over).

    The 5as/h term is the s x s softmax output, dropout mask and dropout output that
    an *explicit* attention stores. A fused kernel (FlashAttention, Dao et al. 2022;
    ``torch.nn.functional.scaled_dot_product_attention``) never materialises them:
    it saves its output and one fp32 log-sum-exp per head and row, and recomputes
    the scores blockwise in backward. ``attention="sdpa"`` therefore drops the term,
    which is what selective recomputation saves; the log-sum-exp (4as b bytes, i.e.
    sbh x 4a/h, under 0.1 % of the layer for h/a = 128) is not added.

    Args:
        seq_len, micro_batch, hidden, n_heads, n_layers: positive integers;
            ``n_heads`` divides ``hidden``.
        tp: tensor-parallel degree; must divide ``n_heads``.
        sequence_parallel: split the norms and dropouts along the sequence too.
        recompute: "none", "selective" (recompute attention scores) or "full".
        attention: "explicit" (the s x s matrices are stored) or "sdpa" (a fused
            attention kernel that stores none of them).
    Returns:
        Bytes on one tensor-parallel rank (an integer; rounded up).

    Taught in: Chapter 1, activations.
    """
    s, b, h, a, n = (_check_int(k, v) for k, v in (
        ("seq_len", seq_len), ("micro_batch", micro_batch), ("hidden", hidden),
        ("n_heads", n_heads), ("n_layers", n_layers)))
    t = _check_int("tp", tp)
    if h % a:
        raise ValueError(f"n_heads={a} must divide hidden={h}")
    if a % t:
        raise ValueError(f"tp={t} must divide n_heads={a}")
    if not isinstance(sequence_parallel, bool):
        raise ValueError(f"sequence_parallel={sequence_parallel!r} must be True/False")
    _check_choice("recompute", recompute, RECOMPUTE)
    _check_choice("attention", attention, ATTENTION)
    sbh = s * b * h
    if recompute == "full":
        per_layer = 2 * sbh / (t if sequence_parallel else 1)
    else:
        # 10 sbh (norm inputs, dropout masks and inputs) stays replicated across the
        # tensor-parallel ranks unless sequence parallelism splits it.
        outside = 10 / t if sequence_parallel else 10
        stored = recompute == "none" and attention == "explicit"
        scores = 5 * a * s / (h * t) if stored else 0
        per_layer = sbh * (outside + 24 / t + scores)
    return math.ceil(per_layer * n)


def transformer_params(n_layers: int, hidden: int, vocab_size: int,
                       seq_len: int) -> int:
    """Parameters of a GPT: 12 l h^2 (1 + 13/(12h) + (V + s)/(12 l h)).

    Narayanan et al. 2021, Eq. 2: per layer 12h^2 weights + 13h biases and norm
    parameters; token (V x h) and learned position (s x h) embeddings; the output
    head tied to the token embedding. The final layer norm (2h) is not counted.

    Args:
        n_layers (l), hidden (h), vocab_size (V), seq_len (s): positive integers.
    Returns:
        The parameter count (exact integer: 12lh^2 + 13lh + (V + s)h).

    Taught in: Chapter 1, how big is the model.
    """
    l, h, v, s = (_check_int(k, x) for k, x in (
        ("n_layers", n_layers), ("hidden", hidden), ("vocab_size", vocab_size),
        ("seq_len", seq_len)))
    return 12 * l * h * h + 13 * l * h + (v + s) * h


@dataclass(frozen=True)
class TrainingConfig:
    """A training configuration to estimate per-device memory for.

    The memory layer's config (Chapter 1): a model's shape as the papers write it
    plus how it is split and trained. The other layers have their own: the model
    that runs is ``dtlib.models.GPTConfig``, the capstone's run
    ``dtlib.train.config.TrainConfig``, the planner's model ``dtlib.planner.ModelSpec``;
    all four name the vocabulary ``vocab_size``.

    n_layers, hidden, n_heads, vocab_size, seq_len: the GPT's shape (l, h, a, V, s).
    micro_batch: sequences per micro-batch on one data-parallel rank (b).
    dp, tp, pp: data-, tensor- and pipeline-parallel degrees.
    zero_stage: ZeRO stage 0-3 over the dp ranks.
    precision: "mixed" (16-bit params/grads/activations) or "fp32".
    optimizer: "adam", "sgd" or "sgd_momentum".
    recompute: "none", "selective" or "full" activation recomputation.
    attention: "explicit" (stores the s x s attention matrices) or "sdpa" (a fused
        kernel such as FlashAttention, which stores none of them).
    sequence_parallel: Megatron sequence parallelism (needs tp > 1 to help).
    n_params: parameter count; None uses :func:`transformer_params` of the shape.
    """

    n_layers: int
    hidden: int
    n_heads: int
    vocab_size: int = 51200
    seq_len: int = 2048
    micro_batch: int = 1
    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero_stage: int = 0
    precision: str = "mixed"
    optimizer: str = "adam"
    recompute: str = "none"
    attention: str = "explicit"
    sequence_parallel: bool = False
    n_params: int | None = field(default=None)

    def __post_init__(self) -> None:
        for name in ("n_layers", "hidden", "n_heads", "vocab_size", "seq_len",
                     "micro_batch", "dp", "tp", "pp"):
            _check_int(name, getattr(self, name))
        if self.hidden % self.n_heads:
            raise ValueError(f"n_heads={self.n_heads} must divide hidden={self.hidden}")
        if self.n_heads % self.tp:
            raise ValueError(f"tp={self.tp} must divide n_heads={self.n_heads}")
        if self.n_layers % self.pp:
            raise ValueError(f"pp={self.pp} must divide n_layers={self.n_layers}")
        if self.zero_stage not in (0, 1, 2, 3) or isinstance(self.zero_stage, bool):
            raise ValueError(
                f"zero_stage={self.zero_stage!r} must be one of 0, 1, 2, 3")
        _check_choice("precision", self.precision, PRECISIONS)
        _check_choice("optimizer", self.optimizer, OPTIMIZERS)
        _check_choice("recompute", self.recompute, RECOMPUTE)
        _check_choice("attention", self.attention, ATTENTION)
        if not isinstance(self.sequence_parallel, bool):
            raise ValueError(
                f"sequence_parallel={self.sequence_parallel!r} must be True or False")
        if self.n_params is not None:
            _check_int("n_params", self.n_params)

    @property
    def params(self) -> int:
        """The model's parameter count."""
        if self.n_params is not None:
            return int(self.n_params)
        return transformer_params(self.n_layers, self.hidden, self.vocab_size,
                                  self.seq_len)


@dataclass(frozen=True)
class MemoryEstimate:
    """Per-device bytes of one training configuration (the most loaded device).

    params, grads, optimizer: model states after tp x pp splitting and ZeRO.
    activations: saved for backward on the first pipeline stage.
    """

    params: int
    grads: int
    optimizer: int
    activations: int

    @property
    def model_states(self) -> int:
        """params + grads + optimizer."""
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> int:
        """Model states + activations (no allocator or framework overhead)."""
        return self.model_states + self.activations

    def fits(self, device_gb: float, *, reserved_gb: float = 0.0) -> bool:
        """Whether ``total`` plus ``reserved_gb`` (CUDA context, allocator
        fragmentation, temporary buffers: ERRATA item 4) fits ``device_gb`` (1e9 B)."""
        if not device_gb > 0 or not reserved_gb >= 0:
            raise ValueError(f"device_gb={device_gb!r} must be > 0 and "
                             f"reserved_gb={reserved_gb!r} >= 0")
        return self.total + reserved_gb * GB <= device_gb * GB


def estimate(cfg: TrainingConfig) -> MemoryEstimate:
    """Per-device memory of a training configuration.

    Assumptions, stated so they can be checked:
    - Model states: the parameters split evenly over the tp x pp model-parallel ranks
      (embeddings on the end stages are ignored), then ZeRO over ``dp``.
    - Activations: Korthikanti et al. 2022, Table 2 for the tp/sp/recompute choice,
      without the s x s attention term under ``attention="sdpa"``, in 16-bit;
      "fp32" doubles them (an upper bound: dropout masks stay 1 byte).
    - Pipeline (non-interleaved 1F1B): a stage has n_layers/pp layers, and the first
      stage keeps ``pp`` micro-batches in flight, so it holds activations for
      pp x n_layers/pp = n_layers layers (Korthikanti §4.2.3; Narayanan §2.2).
    - Not modelled: framework overhead (pass ``reserved_gb`` to ``fits``).

    Args:
        cfg: the :class:`TrainingConfig`.
    Returns:
        A :class:`MemoryEstimate` with the breakdown and ``fits(device_gb)``.

    Taught in: Chapter 1, the planner.
    """
    if not isinstance(cfg, TrainingConfig):
        raise ValueError(f"cfg={cfg!r} must be a TrainingConfig")
    per_rank = -(-cfg.params // (cfg.tp * cfg.pp))
    states = model_state_bytes(per_rank, zero_stage=cfg.zero_stage, dp=cfg.dp,
                               precision=cfg.precision, optimizer=cfg.optimizer)
    stage_layers = cfg.n_layers // cfg.pp
    acts = cfg.pp * activation_bytes(
        cfg.seq_len, cfg.micro_batch, cfg.hidden, cfg.n_heads, stage_layers,
        tp=cfg.tp, sequence_parallel=cfg.sequence_parallel, recompute=cfg.recompute,
        attention=cfg.attention)
    if cfg.precision == "fp32":
        acts *= 2
    return MemoryEstimate(states.params, states.grads, states.optimizer, acts)


_MEASURED = ("ActivationMeasurement", "PAPER_OMITS", "ModelStateMeasurement",
             "gpt_layer_activation_terms", "measure_gpt_layer", "measure_activations",
             "measure_model_states")


def __getattr__(name: str):
    """Re-export the measurement API on first use, so that the formulas (and the
    pure-Python planner built on them) never import torch."""
    if name in _MEASURED:
        import dtlib.memory.measure as measure  # torch, on first use only

        return getattr(measure, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ATTENTION", "GB", "ModelStates", "MemoryEstimate", "TrainingConfig",
    "ActivationMeasurement",
    "ModelStateMeasurement", "activation_bytes", "bytes_per_param", "estimate",
    "PAPER_OMITS", "gpt_layer_activation_terms", "measure_activations",
    "measure_gpt_layer", "measure_model_states",
    "model_state_bytes", "transformer_params",
]
