"""Parameters and FLOPs of a transformer, from its shape.

FLOPs follow Narayanan et al. 2021, §5.1: only matrix multiplications count (2 FLOPs
per multiply-add). One layer's forward pass over B sequences of s tokens costs
``2 B s P_layer + 4 B s^2 h`` (its weight matrices, then QK^T and scores x V), which
for GPT's ``P_layer = 12 h^2`` is their ``24 B s h^2 + 4 B s^2 h``; the logit layer
costs ``2 B s h V``. Backward costs twice the forward. Per iteration:

======================  ==================================================
recompute               FLOPs
======================  ==================================================
"none"                  3 x layers + 3 x logits
"selective"             3 x layers + 1 x attention core (4 B s^2 h l) + 3 x logits
"full"                  4 x layers + 3 x logits  (= Eq. 3 for GPT)
======================  ==================================================

For GPT, "full" is Eq. 3, ``96 B s l h^2 (1 + s/(6h) + V/(16 l h))``, written
``96Bslh^2 + 16Bs^2lh + 6BshV`` so that it is an exact integer; "none" is then
``72Bslh^2 + 12Bs^2lh + 6BshV`` (the logit layer is never recomputed, so it is not
72/96 of Eq. 3).

Taught in: Chapter 11, a planner checked against published runs.
"""

from __future__ import annotations

from dtlib.memory.formulas import transformer_params

from dtlib.planner.specs import RECOMPUTE, ModelSpec


def megatron_eq3(global_batch: int, seq_len: int, n_layers: int, hidden: int,
                 vocab_size: int) -> int:
    """Narayanan et al. 2021, Eq. 3: FLOPs per iteration with full recomputation.

    Args:
        global_batch (B), seq_len (s), n_layers (l), hidden (h), vocab_size (V).
    Returns:
        ``96 B s l h^2 (1 + s/(6h) + V/(16 l h))`` as an exact integer.

    Taught in: Chapter 11, FLOPs per iteration.
    """
    b, s, l, h, v = global_batch, seq_len, n_layers, hidden, vocab_size
    return 96 * b * s * l * h * h + 16 * b * s * s * l * h + 6 * b * s * h * v


def param_count(model: ModelSpec) -> int:
    """Parameters of the model.

    GPT shape: Narayanan et al. 2021, Eq. 2 (``dtlib.memory.transformer_params``:
    biases, LayerNorms, learned positions, output head tied to the embedding).
    Otherwise per layer the matrices, plus biases and two LayerNorms when the MLP is
    GeLU (GPT-style), or two RMSNorm weights when it is gated (Llama-style: no
    biases, rotary positions, untied head, a final RMSNorm).

    Args:
        model: the :class:`ModelSpec`.
    Returns:
        The exact parameter count.

    Taught in: Chapter 11, a planner checked against published runs.
    """
    h, l, v, s = model.hidden, model.n_layers, model.vocab_size, model.seq_len
    if model.is_gpt:
        return transformer_params(l, h, v, s)
    if model.gated_mlp:
        return l * (model.layer_matrix_params + 2 * h) + 2 * v * h + h
    biases = 2 * h + 2 * model.kv_hidden + model.ffn_hidden + h
    return l * (model.layer_matrix_params + biases + 4 * h) + (v + s) * h


def flops_per_iteration(model: ModelSpec, global_batch: int,
                        recompute: str = "full") -> int:
    """Matrix-multiply FLOPs of one training iteration, recomputation included.

    Args:
        model: the :class:`ModelSpec`.
        global_batch: sequences per iteration (B).
        recompute: "none", "selective" or "full" (see the module's table).
    Returns:
        An exact integer; equals :func:`megatron_eq3` for a GPT with "full".

    Taught in: Chapter 11, FLOPs per iteration.
    """
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute={recompute!r} is not one of {RECOMPUTE}")
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) \
            or global_batch < 1:
        raise ValueError(f"global_batch={global_batch!r} must be an integer >= 1")
    tokens = global_batch * model.seq_len
    matrices = 2 * tokens * model.layer_matrix_params * model.n_layers
    core = 4 * tokens * model.seq_len * model.hidden * model.n_layers
    logits = 2 * tokens * model.hidden * model.vocab_size
    if recompute == "full":
        return 4 * (matrices + core) + 3 * logits
    if recompute == "selective":
        return 3 * matrices + 4 * core + 3 * logits
    return 3 * (matrices + core) + 3 * logits
