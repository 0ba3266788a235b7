"""Which model the capstone trains: the book's GPT or a Hugging Face causal LM.

``--model gpt`` (the default) is the book's GPT; ``--model hf-llama`` is
``transformers``' ``LlamaForCausalLM``, built from a ``LlamaConfig`` with the same
size flags (``--hidden``, ``--n-layers``, ...) or from ``--model-config
config.json``, with random weights; ``--init-from DIR`` loads real weights from a
local ``save_pretrained`` directory. Nothing is downloaded. ``transformers`` is
imported only when a Hugging Face model is asked for.

The rest of the script sees only an ``nn.Module`` whose output has logits: the
parameter count comes from the model itself (built on the meta device first, so a
model that cannot fit is refused before a byte is allocated), FSDP2 wraps each
decoder layer (the outermost ``nn.ModuleList``: the GPT's blocks, Llama's
``model.layers``); :func:`dtlib.models.run.logits_of` unwraps a ``ModelOutput``.

Taught in: Chapter 10, "A Hugging Face model".
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch
import torch.nn as nn

from dtlib.memory.recompute import apply_recompute
from dtlib.models.gpt import GPTConfig, build_gpt, meta_gpt
from dtlib.train.config import TrainConfig

__all__ = ["build_model", "hf_config", "count_params", "HF_ATTENTION",
           "starts_on_meta", "init_model", "unit_params"]

#: ``--attention`` -> transformers' ``attn_implementation``.
HF_ATTENTION = {"explicit": "eager", "sdpa": "sdpa"}


def hf_config(cfg: TrainConfig) -> Any:
    """The ``LlamaConfig`` of ``cfg``'s Hugging Face model: from ``--init-from``'s or
    ``--model-config``'s file, else from the size flags.

    Taught in: Chapter 10, "A Hugging Face model".
    """
    from dtlib.models import hf  # needs transformers (the .[hf] extra)

    source = cfg.init_from or cfg.model_config
    flag = "init_from" if cfg.init_from else "model_config"
    config = hf.load_config(source, flag) if source else hf.llama_config(
        vocab_size=cfg.vocab_size, hidden=cfg.hidden, n_layers=cfg.n_layers,
        n_heads=cfg.n_heads, seq_len=cfg.seq_len)
    config._attn_implementation = HF_ATTENTION[cfg.attention]
    if config.vocab_size < cfg.vocab_size:  # the data's tokens must be in the table
        raise ValueError(f"vocab_size={cfg.vocab_size} exceeds the model's vocabulary "
                         f"({config.vocab_size} in {source}); allowed: <= "
                         f"{config.vocab_size}")
    return config


def build_model(cfg: TrainConfig, meta: bool = False) -> nn.Module:
    """The model ``cfg`` names, with the same weights on every rank.

    Args:
        cfg: the run's configuration (``model``, sizes, ``model_config``,
            ``init_from``, ``seed``).
        meta: build on the meta device (shapes only, no memory) to count parameters.
    Returns:
        The unwrapped fp32 model on the CPU (or on the meta device).

    Taught in: Chapter 10, "A Hugging Face model".
    """
    if cfg.model == "gpt":
        gcfg = _gpt_config(cfg)
        if meta:  # shapes only: init_model writes the seeded values later
            return apply_recompute(copy.deepcopy(meta_gpt(gcfg)), cfg.recompute)
        return apply_recompute(build_gpt(gcfg, seed=cfg.seed), cfg.recompute)
    from dtlib.models import hf  # needs transformers (the .[hf] extra)

    config = hf_config(cfg)
    if meta:
        with torch.device("meta"):
            model = hf.build_hf_llama(config)
    elif cfg.init_from:
        model = hf.load_pretrained(cfg.init_from)
        model.config._attn_implementation = HF_ATTENTION[cfg.attention]
    else:
        model = hf.build_hf_llama(config, seed=cfg.seed)
    if cfg.recompute == "full":  # the decoder layers' own activation checkpointing
        enable = getattr(model, "activation_checkpointing_enable", None) \
            or model.gradient_checkpointing_enable  # its name before transformers 5.x
        enable({"use_reentrant": False})
    return model


def starts_on_meta(cfg: TrainConfig) -> bool:
    """Whether the model ``cfg`` names starts on the meta device (the book's GPT, a
    random-init Hugging Face Llama with an untied head: :func:`init_model`
    initialises them in place) or is built whole on the CPU (``--init-from``'s
    ``from_pretrained``, a tied head).

    Taught in: Chapter 10, "Refuse what cannot fit".
    """
    if cfg.model == "gpt":
        return True
    return not cfg.init_from and not getattr(hf_config(cfg), "tie_word_embeddings",
                                             False)


def init_model(model: nn.Module, cfg: TrainConfig,
               probe: Callable[[nn.Module], None] | None = None) -> None:
    """Write ``build_model(cfg)``'s seeded values into ``model``, a meta-device
    build of it that was sharded (or not) and then ``to_empty``-ed onto a device.

    Args:
        model: the model (unwrapped or sharded in place; DDP wraps afterwards).
        cfg: the run's configuration (``seed``).
        probe: called with each module's full CPU values while they exist (to
            measure what a rank holds during set-up).

    Taught in: Chapter 10, "Refuse what cannot fit".
    """
    if not starts_on_meta(cfg):
        raise ValueError(f"model={cfg.model!r} (init_from={cfg.init_from!r}) does "
                         "not start on the meta device; allowed: 'gpt', or "
                         "'hf-llama' with random weights and an untied head")
    if cfg.model == "gpt":
        model.init_weights(cfg.seed, probe=probe)
        return
    from dtlib.models import hf  # needs transformers (the .[hf] extra)

    hf.init_weights(model, cfg.seed, probe=probe)


def unit_params(cfg: TrainConfig) -> int:
    """Parameters of the largest FSDP unit of the model ``cfg`` names: one decoder
    layer, or the root's own (embeddings, final norm, head), counted on meta.

    Taught in: Chapter 10, "Refuse what cannot fit".
    """
    model = _shapes(cfg)
    layers = [m for m in model.modules() if isinstance(m, nn.ModuleList)][0]
    inside = {id(p) for p in layers.parameters()}
    root = sum(p.numel() for p in model.parameters() if id(p) not in inside)
    return max(root, *(sum(p.numel() for p in layer.parameters())
                       for layer in layers))


def count_params(cfg: TrainConfig) -> int:
    """Parameters of the model ``cfg`` names, counted on the meta device (no memory).

    Taught in: Chapter 10, "Refuse what cannot fit".
    """
    return sum(p.numel() for p in _shapes(cfg).parameters())


def _shapes(cfg: TrainConfig) -> nn.Module:
    """The model on meta, to read and not to change (the GPT's is shared)."""
    if cfg.model != "gpt":
        return build_model(cfg, meta=True)
    return meta_gpt(_gpt_config(cfg))


def _gpt_config(cfg: TrainConfig) -> GPTConfig:
    return GPTConfig(vocab_size=cfg.vocab_size, seq_len=cfg.seq_len,
                     n_layers=cfg.n_layers, hidden=cfg.hidden, n_heads=cfg.n_heads,
                     attention=cfg.attention)
