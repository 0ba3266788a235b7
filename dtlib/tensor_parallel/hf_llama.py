"""Tensor parallelism on a Hugging Face Llama: Megatron's split of attention and SwiGLU.

A Llama decoder layer has the GPT's two column -> row pairs, with more columns:
attention projects the input with ``q_proj``, ``k_proj`` and ``v_proj`` (column
parallel: each rank computes ``n_heads / tp`` whole heads, since the heads are
contiguous rows of each weight) and recombines with ``o_proj`` (row parallel: partial
sums, one all-reduce); the SwiGLU MLP computes ``silu(gate_proj(x)) * up_proj(x)``
(both column parallel with the same row split, so the product is elementwise on each
rank's slice) and ``down_proj`` (row parallel). Embeddings, norms and ``lm_head`` stay
replicated. ``transformers`` ships the same plan as strings in
``LlamaConfig.base_model_tp_plan`` (:func:`plan_table` puts them side by side).

Two ways to apply it, as in Chapter 5: :func:`tensor_parallelize_llama` swaps in the
book's :class:`ColumnParallelLinear` / :class:`RowParallelLinear` (f and g written
out); :func:`dtensor_parallelize_llama` hands torch's ``ColwiseParallel`` /
``RowwiseParallel`` to ``parallelize_module``. Both need ``n_heads``,
``n_kv_heads`` and ``intermediate_size`` divisible by the group size. HF's attention
reshapes with ``view(..., -1, head_dim)``, so it runs on the local heads unchanged.

Taught in: Chapter 5, "A Hugging Face Llama"; Chapter 10 uses the model.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from dtlib.runtime import dist as ddist
from dtlib.tensor_parallel.gpt import full_tensors
from dtlib.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from dtlib.tensor_parallel.mappings import tp_size

__all__ = ["LLAMA_PLAN", "check_llama_tp", "tensor_parallelize_llama",
           "dtensor_parallelize_llama", "full_parameters_tp", "plan_table"]

#: Module (inside each decoder layer) -> "colwise" or "rowwise": our plan.
LLAMA_PLAN = {"self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise",
              "self_attn.v_proj": "colwise", "self_attn.o_proj": "rowwise",
              "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise",
              "mlp.down_proj": "rowwise"}


def _layers(model: nn.Module) -> nn.ModuleList:
    return model.get_decoder().layers


def check_llama_tp(model: nn.Module, tp: int) -> None:
    """Raise ValueError unless heads, key/value heads and SwiGLU width divide by tp.

    Taught in: Chapter 5, "A Hugging Face Llama".
    """
    cfg = model.config
    for name, value in (("num_attention_heads", cfg.num_attention_heads),
                        ("num_key_value_heads", cfg.num_key_value_heads),
                        ("intermediate_size", cfg.intermediate_size)):
        if value % tp:
            raise ValueError(f"{name}={value} is not divisible by the tensor-parallel "
                             f"size {tp}; allowed: a multiple of {tp}")


def tensor_parallelize_llama(model: nn.Module, group: Any = None) -> nn.Module:
    """Split every decoder layer with the book's column/row layers (in place).

    Args:
        model: a ``LlamaForCausalLM``, identical on every rank of ``group``.
        group: the tensor-parallel group (None: the world).
    Returns:
        ``model``; each rank keeps 1/tp of q/k/v/o/gate/up/down.

    Taught in: Chapter 5, "A Hugging Face Llama".
    """
    check_llama_tp(model, tp_size(group))
    for layer in _layers(model):
        for name, style in LLAMA_PLAN.items():
            owner_name, _, attr = name.rpartition(".")
            owner = layer.get_submodule(owner_name)
            full = getattr(owner, attr)
            split = (ColumnParallelLinear.from_linear(full, group) if style == "colwise"
                     else RowParallelLinear.from_linear(full, group))
            setattr(owner, attr, split)
    return model


def dtensor_parallelize_llama(model: nn.Module, mesh: Any = None) -> nn.Module:
    """The same split with torch's DTensor plan (``parallelize_module``), in place.

    Args:
        model: a ``LlamaForCausalLM``, identical on every rank of ``mesh``.
        mesh: a 1-D ``DeviceMesh`` (None: all ranks on this rank's device type).
    Returns:
        ``model`` with DTensor weights in the planned modules.

    Taught in: Chapter 5, "A Hugging Face Llama".
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    if mesh is None:
        world = ddist.world()
        mesh = init_device_mesh(world.device.type, (world.world_size,))
    check_llama_tp(model, mesh.size())
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    plan = {name: styles[style]() for name, style in LLAMA_PLAN.items()}
    for layer in _layers(model):
        parallelize_module(layer, mesh, plan)
    return model


def full_parameters_tp(model: nn.Module, group: Any = None, grads: bool = False
                       ) -> dict[str, torch.Tensor]:
    """Every parameter (or gradient) as the full tensor, by name (a collective).

    Works for ours (all-gathers the slices), DTensor's (``full_tensor()``) and a
    plain model; names match the single-process model's. The same as
    :func:`dtlib.tensor_parallel.gpt.full_tensors`, which knows every model whose
    split layers are ours or DTensors.

    Args:
        model: the Llama after :func:`tensor_parallelize_llama` or
            :func:`dtensor_parallelize_llama`.
        group: the tensor-parallel group (ours).
        grads: gradients instead of parameters.
    Returns:
        ``{name: CPU tensor}``.

    Taught in: Chapter 5, "A Hugging Face Llama".
    """
    return full_tensors(model, group, grads)


def plan_table(config: Any, model_cls: Any = None) -> list[dict[str, str]]:
    """Our plan beside ``transformers``' own for the same model, one row per module.

    Args:
        config: a ``LlamaConfig`` (its ``base_model_tp_plan``).
        model_cls: the model class whose ``_tp_plan`` covers the head (e.g.
            ``LlamaForCausalLM``).
    Returns:
        Rows ``{"module", "ours", "DTensor", "transformers"}``.

    Taught in: Chapter 5, "A Hugging Face Llama".
    """
    theirs = dict(getattr(config, "base_model_tp_plan", None) or {})
    head = dict(getattr(model_cls, "_tp_plan", None) or {})
    layer = {"colwise": ("ColumnParallelLinear", "ColwiseParallel()"),
             "rowwise": ("RowParallelLinear", "RowwiseParallel()")}
    rows = [{"module": f"layers.*.{name}", "ours": layer[style][0],
             "DTensor": layer[style][1],
             "transformers": theirs.get(f"layers.*.{name}", "(none)")}
            for name, style in LLAMA_PLAN.items()]
    for name in ("embed_tokens", "norm", "lm_head"):
        rows.append({"module": name, "ours": "replicated", "DTensor": "replicated",
                     "transformers": theirs.get(name, head.get(name, "replicated"))})
    return rows
