"""DeepSpeed ZeRO-1/2/3 run beside the book's ZeRO and FSDP2 on one Hugging Face Llama.

Every rank of one launch trains the same tiny ``LlamaForCausalLM`` (random weights from
a seed, nothing downloaded) for a few steps (AdamW, or SGD with momentum), on its
slice of one global batch, with each variant in turn: ``deepspeed.initialize`` at ZeRO
stage 1, 2 and 3 (:class:`DeepSpeedParallelism`), :func:`dtlib.zero.parallelism` at the
same stages, and FSDP2, all through :func:`dtlib.models.run.run_steps` (the engine
as a Parallelism: :mod:`dtlib.zero.deepspeed_engine`). Each returns the
global mean loss of every step, the full parameters at the end and the model-state
bytes this rank holds, so the page (and the tests) can put them side by side and
against one process. :func:`offload_rank` trains once more at ZeRO-3 in bf16 with the
optimizer offloaded and counts the host memory DeepSpeed holds for it.

Taught in: Chapter 4, "DeepSpeed, run".
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from dtlib.chapters.ch04_zero_fsdp.runs import optimizer_of
from dtlib.models import hf
from dtlib.models.run import (AfterOptimizerStep, Parallelism, RunConfig, TrainState,
                              run_steps)
from dtlib.zero import StateAfterStep, parallelism
from dtlib.zero.deepspeed_engine import CLIP, DeepSpeedParallelism, offload_host_bytes

__all__ = ["TINY_LLAMA", "VARIANTS", "train_rank", "compare_rank", "reference_run",
           "offload_rank"]

#: vocab 128, hidden 64, 2 decoder layers, 4 heads: 98,624 parameters.
TINY_LLAMA = dict(vocab_size=128, hidden=64, n_layers=2, n_heads=4, seq_len=16)
VARIANTS = ("deepspeed", "ours", "fsdp2")
HYPER = dict(lr=1e-2, weight_decay=0.1, clip=CLIP)  # clip: the engine config's


def _model(seed: int) -> nn.Module:
    return hf.build_hf_llama(hf.llama_config(**TINY_LLAMA), seed=seed)


def _global_batch(batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed + 1)
    rows = torch.randint(0, TINY_LLAMA["vocab_size"],
                         (batch, TINY_LLAMA["seq_len"] + 1), generator=gen)
    return rows[:, :-1], rows[:, 1:]  # (batch, seq_len) inputs and targets


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x).logits  # a ModelOutput: (batch, seq_len, vocab)
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


def train_rank(variant: str, stage: int = 3, steps: int = 3, batch_per_rank: int = 2,
               seed: int = 0, optimizer: str = "adamw", lr: float | None = None
               ) -> dict[str, Any]:
    """On every rank: train the tiny Llama with ``variant`` and report what it did.

    Args:
        variant: ``"deepspeed"`` (``deepspeed.initialize``), ``"ours"``
            (:func:`dtlib.zero.parallelism`) or ``"fsdp2"`` (stage 3 only).
        stage: ZeRO stage 1, 2 or 3.
        steps: optimizer steps (weight decay 0.1, clip 1.0).
        batch_per_rank: sequences per rank; the global batch is sliced by rank.
        optimizer: ``"adamw"`` or ``"sgd"`` (momentum 0.9), at ``lr`` (default
            ``HYPER["lr"]``).
    Returns:
        ``{"variant", "stage", "losses" (global mean per step), "params" (full, by
        name), "state" (bytes by role on this rank), "n_params"}``.

    Taught in: Chapter 4, "DeepSpeed, run".
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant={variant!r} not allowed; allowed: {VARIANTS}")
    if stage not in (1, 2, 3) or (variant == "fsdp2" and stage != 3):
        raise ValueError(f"stage={stage!r} not allowed for {variant}; allowed: "
                         + ("3" if variant == "fsdp2" else "1, 2, 3"))
    model = _model(seed)
    n_params = hf.n_params(model)
    batch = _global_batch(dist.get_world_size() * batch_per_rank, seed)
    cls, kwargs = optimizer_of(optimizer, HYPER["lr"] if lr is None else lr)
    kwargs["weight_decay"] = HYPER["weight_decay"]
    if variant == "deepspeed":
        par: Any = DeepSpeedParallelism(stage, batch_per_rank, cls, kwargs)
        clip = None  # the config's gradient_clipping, inside engine.step()
        state = TrainState()
    else:
        par = parallelism(stage, variant=variant)
        clip = HYPER["clip"]
        wrapped = par.apply(model)
        state = TrainState(wrapped, par.make_optimizer(wrapped, cls, **kwargs))
    measured = StateAfterStep(par, steps)  # after the last step
    config = RunConfig(steps, loss_fn=_loss, max_grad_norm=clip, record_grads=False)
    run = run_steps(par, model, lambda step: batch, config, state, [measured])
    return {"variant": variant, "stage": stage, "losses": run.losses,
            "n_params": n_params, "params": run.params, "state": measured.state}


def reference_run(world_size: int = 2, steps: int = 3, batch_per_rank: int = 2,
                  seed: int = 0, optimizer: str = "adamw", lr: float | None = None
                  ) -> dict[str, Any]:
    """One process, the whole global batch: the losses and parameters to match.

    Taught in: Chapter 4, "DeepSpeed, run".
    """
    batch = _global_batch(world_size * batch_per_rank, seed)
    cls, kwargs = optimizer_of(optimizer, HYPER["lr"] if lr is None else lr)
    kwargs["weight_decay"] = HYPER["weight_decay"]
    config = RunConfig(steps, optimizer_class=cls, optimizer_kwargs=kwargs,
                       loss_fn=_loss, max_grad_norm=HYPER["clip"], record_grads=False)
    run = run_steps(Parallelism(), _model(seed), lambda step: batch, config)
    return {"losses": run.losses, "params": run.params}


def compare_rank(stages: tuple[int, ...] = (1, 2, 3), steps: int = 3,
                 with_fsdp2: bool = True, optimizer: str = "adamw",
                 lr: float | None = None) -> dict[str, dict[str, Any]]:
    """On every rank: DeepSpeed and ours at each of ``stages``, then FSDP2.

    Returns:
        ``{"deepspeed1": ..., "ours1": ..., ..., "fsdp2": ...}`` of :func:`train_rank`
        results; parameters are kept on rank 0 only (the others return ``{}``).

    Taught in: Chapter 4, "DeepSpeed, run".
    """
    runs = [(variant, s) for s in stages for variant in ("deepspeed", "ours")]
    runs += [("fsdp2", 3)] if with_fsdp2 else []
    out = {}
    for variant, stage in runs:
        r = train_rank(variant, stage, steps, optimizer=optimizer, lr=lr)
        if dist.get_rank() != 0:
            r["params"] = {}
        out[f"{variant}{stage}" if variant != "fsdp2" else "fsdp2"] = r
    return out


def offload_rank(steps: int = 1, batch_per_rank: int = 2, seed: int = 0
                 ) -> dict[str, Any]:
    """On every rank: DeepSpeed ZeRO-3 in bf16 with ``offload_optimizer`` trains the
    tiny Llama (AdamW); the host bytes its optimizer holds after the last step.

    Returns:
        ``{"host" (:func:`offload_host_bytes`, by tensor), "losses", "n_params",
        "n_tensors" (parameter tensors, each partitioned on its own),
        "world_size"}``.

    Taught in: Chapter 4, "DeepSpeed, run".
    """
    model = _model(seed)
    n_params, n_tensors = hf.n_params(model), len(list(model.parameters()))
    batch = _global_batch(dist.get_world_size() * batch_per_rank, seed)
    cls, kwargs = optimizer_of("adamw", HYPER["lr"])
    kwargs["weight_decay"] = HYPER["weight_decay"]
    par = DeepSpeedParallelism(3, batch_per_rank, cls, kwargs, offload_optimizer=True,
                               bf16=True)
    host: dict[str, int] = {}

    def measure(step: int, engine: Any, optimizer: Any) -> None:
        if step == steps:  # the moments exist once the optimizer has stepped
            host.update(offload_host_bytes(engine))

    config = RunConfig(steps, loss_fn=_loss, record_grads=False, record_params=False)
    run = run_steps(par, model, lambda step: batch, config, TrainState(),
                    [AfterOptimizerStep(measure)])
    return {"host": host, "losses": run.losses, "n_params": n_params,
            "n_tensors": n_tensors, "world_size": dist.get_world_size()}
