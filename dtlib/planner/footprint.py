"""Memory one GPU needs for a configuration, from Chapter 1's formulas.

- Model states: ``dtlib.memory.model_state_bytes`` (Rajbhandari et al. 2020): the
  parameters split evenly over the tp x pp model-parallel ranks (embeddings on the
  end stages are ignored), mixed-precision Adam (2 + 2 + 12 bytes per parameter),
  ZeRO over the dp x cp ranks (context-parallel ranks hold the same weights).
- Activations: ``dtlib.memory.activation_bytes`` (Korthikanti et al. 2022, Table 2)
  for the local sequence s / cp, plus what that table does not cover, in sbh/t
  units per layer: K and V narrower than Q under grouped-query attention
  (``4 n_kv/n_heads - 4``), an MLP that is not 4h GeLU (GeLU: ``4 f/h - 16``;
  SwiGLU keeps gate, up and their product: ``6 f/h - 16``).
- Context parallelism splits the sequence: a rank holds s / cp tokens. Its
  attention runs blockwise (ring or all-gathered K/V with a FlashAttention-style
  kernel), so the s x s scores are never stored: "none" then saves what
  "selective" saves.
- Pipeline: the first stage has ceil(l / pp) layers and holds min(pp, m)
  micro-batches in flight (1F1B; ZB-H1 holds as many on every stage, ZB-V on
  every rank, Chapter 6). The zero-bubble schedules also keep, for each W not yet
  run, the 16-bit gradient of every weight-owning module's output: per layer and
  token ``4h + 2 kv + f`` values (``+ 2f`` for a gated MLP), over tp; the last stage
  waits for up to min(pp, m) of them (ZB-H1; ZB-V's ranks fewer), counted on top.
- Full recomputation also needs one layer's activations while it is recomputed.

Taught in: Chapter 11, a planner checked against published runs.
"""

from __future__ import annotations

import math

from dtlib.memory.formulas import activation_bytes, model_state_bytes

from dtlib.planner.specs import ModelSpec, ParallelConfig


def _beyond_korthikanti(model: ModelSpec, micro_batch: int, tp: int, cp: int,
                        recompute: str) -> float:
    """Bytes per layer that Korthikanti's GPT table does not count (may be < 0)."""
    s_local = model.seq_len // cp
    sbh = s_local * micro_batch * model.hidden
    if recompute == "full":
        return 0.0
    ratio = model.n_kv_heads / model.n_heads
    mlp = (6 if model.gated_mlp else 4) * model.ffn_hidden / model.hidden
    return sbh * ((4 * ratio - 4) + (mlp - 16)) / tp


def layer_activation_bytes(model: ModelSpec, micro_batch: int, *, tp: int = 1,
                           cp: int = 1, sequence_parallel: bool = True,
                           recompute: str = "none") -> float:
    """Bytes one layer saves for backward, for one micro-batch, on one rank.

    Args:
        model: the :class:`ModelSpec`.
        micro_batch: sequences per micro-batch (b).
        tp, cp: tensor- and context-parallel degrees.
        sequence_parallel: Megatron sequence parallelism inside the tp group.
        recompute: "none", "selective" or "full".
    Returns:
        Bytes (16-bit activations, 1-byte dropout masks).

    Taught in: Chapter 11, a planner checked against published runs.
    """
    blockwise = "selective" if cp > 1 and recompute == "none" else recompute
    base = activation_bytes(model.seq_len // cp, micro_batch, model.hidden,
                            model.n_heads, 1, tp=tp,
                            sequence_parallel=sequence_parallel, recompute=blockwise)
    return base + _beyond_korthikanti(model, micro_batch, tp, cp, recompute)


def memory_breakdown(model: ModelSpec, config: ParallelConfig, n_params: int,
                     n_micro: int) -> dict[str, float]:
    """Bytes on the most loaded GPU (the first pipeline stage), by kind.

    Args:
        model, config: what runs and how it is split.
        n_params: the model's parameter count.
        n_micro: micro-batches per replica per iteration (m).
    Returns:
        ``{"params", "grads", "optimizer", "activations"}`` in bytes.

    Taught in: Chapter 11, a planner checked against published runs.
    """
    c = config
    per_rank = -(-n_params // (c.tp * c.pp))
    states = model_state_bytes(per_rank, zero_stage=c.zero_stage, dp=c.dp * c.cp)
    stage_layers = math.ceil(model.n_layers / c.pp)
    in_flight = min(c.pp, n_micro) * stage_layers
    kw = dict(tp=c.tp, cp=c.cp, sequence_parallel=c.sequence_parallel)
    acts = in_flight * layer_activation_bytes(model, c.micro_batch,
                                              recompute=c.recompute, **kw)
    if c.recompute == "full":
        acts += layer_activation_bytes(model, c.micro_batch, recompute="none", **kw)
    if c.pp > 1 and c.schedule != "1f1b":  # output gradients held for the W's
        f = model.ffn_hidden * (2 if model.gated_mlp else 1)
        per_token = 4 * model.hidden + 2 * model.kv_hidden + f
        tokens = model.seq_len // c.cp * c.micro_batch
        acts += min(c.pp, n_micro) * stage_layers * 2 * tokens * per_token / c.tp
    return {"params": states.params, "grads": states.grads,
            "optimizer": states.optimizer, "activations": acts}
