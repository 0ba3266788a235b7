"""A Hugging Face causal LM (``transformers``' Llama) for the book's training code.

Readers train Hugging Face models; this module builds one the same way the book
builds its GPT: from a configuration, with weights drawn from a seed, so every rank
gets the same model and nothing is downloaded. :func:`llama_config` makes a small
``LlamaConfig`` from the GPT's size names (vocab 128, hidden 64, 2 layers, 4 heads is
~99k parameters); :func:`build_hf_llama` builds ``LlamaForCausalLM`` from it with
random weights; :func:`load_pretrained` reads real weights from a *local* directory
written by ``save_pretrained`` (``local_files_only``: never the Hub).

Importing this module imports ``transformers`` (an optional extra, ``.[hf]``): the
rest of ``dtlib`` imports it only when a Hugging Face model is asked for.

What differs from the GPT, for the code that trains it: ``model(input_ids)`` returns
a ``ModelOutput`` whose ``.logits`` are the GPT's output, the
decoder layers live in ``model.model.layers`` (FSDP2's units, a tensor-parallel plan's
targets), and the output head is not tied to the embedding by default.

Taught in: Chapter 10, "A Hugging Face model"; Chapter 5 (its tensor-parallel plan);
Chapter 4 (DeepSpeed trains it).
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
import torch.nn as nn
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
from transformers.utils import logging as hf_logging

from dtlib.models.init import replay_init, write_full

__all__ = ["llama_config", "load_config", "build_hf_llama", "load_pretrained",
           "init_weights", "decoder_layers", "n_params"]


def llama_config(*, vocab_size: int = 128, hidden: int = 64, n_layers: int = 2,
                 n_heads: int = 4, seq_len: int = 64, intermediate: int | None = None,
                 n_kv_heads: int | None = None) -> LlamaConfig:
    """A small ``LlamaConfig`` named with the book's size words.

    Args:
        vocab_size: tokens in the vocabulary.
        hidden: model width (``hidden_size``); divisible by ``n_heads``.
        n_layers: decoder layers (``num_hidden_layers``).
        n_heads: attention heads; ``n_kv_heads`` key/value heads (default: the same,
            i.e. no grouped-query attention).
        seq_len: longest sequence (``max_position_embeddings``).
        intermediate: SwiGLU width (default ``2 * hidden``).
    Returns:
        The configuration (``use_cache=False``: training needs no KV cache).

    Taught in: Chapter 10, "A Hugging Face model".
    """
    for name, value in (("vocab_size", vocab_size), ("hidden", hidden),
                        ("n_layers", n_layers), ("n_heads", n_heads),
                        ("seq_len", seq_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer")
    if hidden % n_heads:
        raise ValueError(f"hidden={hidden} must be divisible by n_heads={n_heads}")
    kv = n_heads if n_kv_heads is None else n_kv_heads
    if kv < 1 or n_heads % kv:
        raise ValueError(f"n_kv_heads={n_kv_heads!r} must divide n_heads={n_heads}")
    return LlamaConfig(vocab_size=vocab_size, hidden_size=hidden,
                       intermediate_size=intermediate or 2 * hidden,
                       num_hidden_layers=n_layers, num_attention_heads=n_heads,
                       num_key_value_heads=kv, max_position_embeddings=seq_len,
                       use_cache=False)


def load_config(path: str, name: str = "model_config") -> Any:
    """A model configuration from a local ``config.json`` file or model directory.

    Args:
        path: a ``config.json`` file, or a directory that holds one.
        name: the flag or argument ``path`` came from, for the error message.
    Returns:
        The ``PretrainedConfig`` (``AutoConfig`` picks the class from ``model_type``).
    Raises:
        ValueError: ``path`` does not exist (nothing is looked up on the Hub).

    Taught in: Chapter 10, "A Hugging Face model".
    """
    if not os.path.exists(path):
        raise ValueError(f"{name}={path!r} does not exist; allowed: a local "
                         "config.json or a directory from save_pretrained")
    if os.path.isdir(path):
        return AutoConfig.from_pretrained(path, local_files_only=True)
    with open(path) as f:
        fields = json.load(f)
    if "model_type" not in fields:
        raise ValueError(f"{name}={path!r} has no 'model_type'; allowed: a config.json "
                         "written by save_pretrained (e.g. model_type 'llama')")
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def build_hf_llama(config: Any, seed: int = 0) -> nn.Module:
    """A causal LM built from ``config`` with weights drawn from ``seed`` (no download).

    Args:
        config: a ``PretrainedConfig`` (e.g. :func:`llama_config`).
        seed: every rank that passes the same seed gets bit-identical weights; the
            caller's random state is left untouched.
    Returns:
        The model (``LlamaForCausalLM`` for a Llama config), fp32, in training mode.

    Taught in: Chapter 10, "A Hugging Face model".
    """
    config.use_cache = False
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = (LlamaForCausalLM(config) if isinstance(config, LlamaConfig)
                 else AutoModelForCausalLM.from_config(config))
    return model.float().train()


def init_weights(model: nn.Module, seed: int = 0,
                 probe: Any = None) -> None:
    """:func:`build_hf_llama`'s values (``seed``), bit for bit, written into
    ``model``: the same model built on ``meta``, maybe sharded, then
    ``to_empty``-ed onto a device. Untied embeddings only (a tied head would need
    re-tying after ``to_empty``).

    The whole build draws in this order: each sub-model (``PreTrainedModel``
    child, Llama's decoder) draws its modules' constructor initialisation and then
    its own ``post_init`` re-initialisation; every other child (the head) draws its
    constructor's, and the top model's ``post_init`` re-initialises those. Each
    module is replayed on a CPU twin (:func:`dtlib.models.init.replay_init`); the
    rotary tables, computed and not drawn, are rebuilt from the configuration.

    Args:
        model: the model (its parameter names are the meta build's).
        seed: as :func:`build_hf_llama`.
        probe: see :func:`dtlib.models.init.replay_init`.

    Taught in: Chapter 10, "Refuse what cannot fit".
    """
    from transformers import PreTrainedModel

    if getattr(model.config, "tie_word_embeddings", False):
        raise ValueError("tie_word_embeddings=True is not allowed here; allowed: an "
                         "untied head (build the model whole instead)")

    def constructed(twin: nn.Module) -> bool:
        if not hasattr(twin, "reset_parameters"):  # RMSNorm: ones, nothing drawn
            return False
        twin.reset_parameters()
        return True

    def post_init(owner: nn.Module) -> Any:
        def phase(twin: nn.Module) -> bool:
            owner._init_weights(twin)  # every module Llama owns: Linear, Embedding,
            return True                # RMSNorm
        return phase

    with torch.random.fork_rng(devices=[]):
        with torch.device("meta"):
            recipe = build_hf_llama(model.config)
        torch.manual_seed(seed)
        later = []
        for name, child in recipe.named_children():
            target = model.get_submodule(name)
            if isinstance(child, PreTrainedModel):  # its own post_init, at once
                replay_init(target, child, (constructed, post_init(target)), probe)
            else:
                replay_init(target, child, (constructed,), probe)
                later.append((target, child))
        for target, child in later:  # the top model's post_init
            replay_init(target, child, (post_init(model),), probe)
    for module in model.modules():  # the rotary tables: computed, not drawn
        if "RotaryEmbedding" in type(module).__name__:
            fresh = type(module)(module.config)
            for name, buf in fresh.named_buffers(recurse=False):
                write_full(getattr(module, name), buf)


def load_pretrained(path: str) -> nn.Module:
    """Real weights from a local directory written by ``save_pretrained``.

    Args:
        path: the directory (``config.json`` plus ``model.safetensors``).
    Returns:
        The model in fp32 and training mode.
    Raises:
        ValueError: ``path`` is not a directory (nothing is downloaded).

    Taught in: Chapter 10, "A Hugging Face model".
    """
    if not os.path.isdir(path):
        raise ValueError(f"init_from={path!r} is not a directory; allowed: a local "
                         "directory written by save_pretrained")
    hf_logging.disable_progress_bar()  # one bar per rank would fill the log
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True,
                                                 dtype=torch.float32)
    model.config.use_cache = False
    return model.train()


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers (``model.model.layers``): FSDP2 units, TP plan targets."""
    return model.get_decoder().layers


def n_params(model: nn.Module) -> int:
    """Parameters of ``model``, counted from the model itself (unique tensors)."""
    return sum(p.numel() for p in model.parameters())
