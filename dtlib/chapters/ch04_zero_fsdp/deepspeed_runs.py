"""DeepSpeed ZeRO-1/2/3 run beside the book's ZeRO and FSDP2 on one Hugging Face Llama.

Every rank of one launch trains the same tiny ``LlamaForCausalLM`` (random weights from
a seed, nothing downloaded) for a few steps (AdamW, or SGD with momentum), on its
slice of one global batch, with each variant in turn: ``deepspeed.initialize`` at ZeRO
stage 1, 2 and 3 (:class:`DeepSpeedParallelism`), :func:`dtlib.zero.parallelism` at the
same stages, and FSDP2, all through :func:`dtlib.models.run.run_steps`. Each returns the
global mean loss of every step, the full parameters at the end and the model-state
bytes this rank holds, so the page (and the tests) can put them side by side and
against one process.

DeepSpeed on CPU: it picks its CPU accelerator and gloo by itself; we hand it a torch
optimizer (``zero_allow_untested_optimizer``) instead of its ``FusedAdam``, and tell
it that no compiled op is available, so nothing is JIT-compiled (its CPU shared-memory
all-reduce would be: it falls back to torch.distributed).

Taught in: Chapter 4, "DeepSpeed, run".
"""

from __future__ import annotations

import os
from typing import Any, Iterable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from dtlib.chapters.ch04_zero_fsdp.runs import StateAfterStep, optimizer_of
from dtlib.models import hf
from dtlib.models.run import Batch, Parallelism, run_steps
from dtlib.zero import parallelism
from dtlib.data_parallel.parallelism import rows_of_rank
from dtlib.zero.shards import storage_bytes

__all__ = ["TINY_LLAMA", "VARIANTS", "DeepSpeedParallelism", "deepspeed_ds_config",
           "deepspeed_state_bytes", "train_rank", "compare_rank", "reference_run"]

#: vocab 128, hidden 64, 2 decoder layers, 4 heads: 98,624 parameters.
TINY_LLAMA = dict(vocab_size=128, hidden=64, n_layers=2, n_heads=4, seq_len=16)
VARIANTS = ("deepspeed", "ours", "fsdp2")
HYPER = dict(lr=1e-2, weight_decay=0.1, clip=1.0)


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


def deepspeed_ds_config(stage: int, micro_batch: int) -> dict[str, Any]:
    """The DeepSpeed config of these runs: fp32, ZeRO ``stage``, clip 1.0, a torch
    optimizer.

    Taught in: Chapter 4, "DeepSpeed, run".
    """
    return {"train_micro_batch_size_per_gpu": micro_batch,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": HYPER["clip"],
            "zero_optimization": {"stage": stage},
            "zero_allow_untested_optimizer": True,  # a torch optimizer, not FusedAdam
            "steps_per_print": 10 ** 6, "wall_clock_breakdown": False}


def _tensors(obj: Any, depth: int = 2) -> Iterable[torch.Tensor]:
    """Tensors in ``obj`` (a tensor, or lists/dicts of them, ``depth`` levels deep)."""
    if torch.is_tensor(obj):
        yield obj
    elif depth and isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v, depth - 1)
    elif depth and isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v, depth - 1)


def deepspeed_state_bytes(engine: Any, grads: Iterable[torch.Tensor]
                          ) -> dict[str, int]:
    """Bytes of model states one DeepSpeed rank holds, by role (unique storages).

    params: the module's parameters (ZeRO-3: each one's partition ``ds_tensor``) plus
    the fp32 partition the optimizer updates (a second copy, even in fp32 training);
    grads: the gradient buffers passed in (collected after ``backward``);
    optimizer: AdamW's ``exp_avg`` and ``exp_avg_sq``.

    Taught in: Chapter 4, "DeepSpeed, run".
    """
    seen: set[int] = set()
    module = [getattr(p, "ds_tensor", p) for p in engine.module.parameters()]
    inner = engine.optimizer.optimizer  # the torch AdamW inside DeepSpeed's ZeRO
    master = [p for g in inner.param_groups for p in g["params"]]
    p = storage_bytes(module, seen)
    master_bytes = storage_bytes(master, seen)
    o = storage_bytes((v for st in inner.state.values() for k, v in st.items()
                        if k != "step"), seen)
    g = storage_bytes(grads, seen)
    return {"params": p + master_bytes, "master": master_bytes, "grads": g,
            "optimizer": o, "total": p + master_bytes + g + o}


def _deepspeed_grads(engine: Any) -> list[torch.Tensor]:
    """Gradient buffers a DeepSpeed rank holds between backward and step."""
    out = [p.grad for p in engine.module.parameters() if p.grad is not None]
    opt = engine.optimizer
    for name, value in vars(opt).items():  # stage 2/3 keep partitions in buffers
        if "grad" in name and "norm" not in name and "acc" not in name:
            out += list(_tensors(value))
    return out


def _cpu_accelerator_unless_cuda() -> None:
    """Tell DeepSpeed it runs on the CPU (it would guess so, with a warning)."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


def _deepspeed(model: nn.Module, stage: int, micro_batch: int,
               optimizer: torch.optim.Optimizer) -> Any:
    _cpu_accelerator_unless_cuda()
    import deepspeed
    import deepspeed.ops

    # No compiled op: DeepSpeed would JIT-build its CPU shared-memory all-reduce
    # (minutes on a laptop) before the first step; without it, torch.distributed.
    deepspeed.ops.__compatible_ops__ = {}
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer,
                                      config=deepspeed_ds_config(stage, micro_batch),
                                      dist_init_required=False)
    return engine


def _full_deepspeed(engine: Any, stage: int) -> dict[str, torch.Tensor]:
    if stage < 3:
        return {n: p.detach().cpu().clone()
                for n, p in engine.module.named_parameters()}
    import deepspeed

    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params):  # all-gathers each partition
        return {n: p.detach().cpu().clone()
                for n, p in engine.module.named_parameters()}


class _EngineStep:
    """The optimizer ``run_steps`` sees for DeepSpeed: ``step`` is ``engine.step()``
    (which clips, steps and zeroes the gradients); after the last one it records
    the model-state bytes, with the gradients collected just before it."""

    def __init__(self, engine: Any, steps: int) -> None:
        self.engine, self.steps, self.done, self.state = engine, steps, 0, {}

    def step(self) -> None:
        last = self.done == self.steps - 1
        grads = _deepspeed_grads(self.engine) if last else []
        self.engine.step()
        self.done += 1
        if last:
            self.state = deepspeed_state_bytes(self.engine, grads)

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass  # engine.step() did


class DeepSpeedParallelism(Parallelism):
    """``deepspeed.initialize`` behind the one loop: ``apply`` returns the engine,
    backward is ``engine.backward(loss)``, the optimizer's step is ``engine.step()``.

    Args:
        stage: ZeRO stage 1-3 (the config's ``zero_optimization.stage``).
        micro_batch: rows per rank (the config's micro-batch).
        optimizer_class, optimizer_kwargs: the torch optimizer handed to DeepSpeed.
        steps: the run's length (the bytes are measured after the last step).

    Taught in: Chapter 4, "DeepSpeed, run".
    """

    def __init__(self, stage: int, micro_batch: int, optimizer_class: type,
                 optimizer_kwargs: dict[str, Any], steps: int) -> None:
        self.stage, self.micro_batch, self.steps = stage, micro_batch, steps
        self.optimizer_class, self.optimizer_kwargs = optimizer_class, optimizer_kwargs
        self.dp_size, self.dp_rank = dist.get_world_size(), dist.get_rank()
        self.name = f"deepspeed-{stage}"

    def apply(self, model: nn.Module) -> Any:
        opt = self.optimizer_class(model.parameters(), **self.optimizer_kwargs)
        return _deepspeed(model, self.stage, self.micro_batch, opt)

    def make_optimizer(self, wrapped: Any, optimizer_class: type,
                       **kwargs: Any) -> Any:
        return _EngineStep(wrapped, self.steps)

    def local_batch(self, batch: Batch) -> Batch:
        return rows_of_rank(batch, self.dp_rank, self.dp_size)

    def check_accumulation(self, micro_batches: int) -> None:
        """DeepSpeed's engine accumulates itself: ``gradient_accumulation_steps``
        in its config decides when its ``step`` reduces and steps."""
        raise ValueError(
            f"gradient accumulation over {micro_batches} micro-batch(es) with "
            f"{self.name}: the DeepSpeed engine accumulates by its own config; "
            "allowed: the default step, with gradient_accumulation_steps in the "
            "engine's config")

    def forward_backward(self, wrapped: Any, batch: Batch, loss_fn: Any,
                         scale: float = 1.0, scaler: Any = None) -> torch.Tensor:
        loss = loss_fn(wrapped, *batch)
        wrapped.backward(loss * scale if scale != 1.0 else loss)
        return loss.detach()

    def full_state(self, wrapped: Any, grads: bool = False
                   ) -> dict[str, torch.Tensor]:
        if grads:
            raise ValueError("grads=True is not supported for DeepSpeed (its "
                             "partitions are its own); allowed: grads=False")
        return _full_deepspeed(wrapped, self.stage)



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
        par: Any = DeepSpeedParallelism(stage, batch_per_rank, cls, kwargs, steps)
        wrapped = par.apply(model)
        opt = par.make_optimizer(wrapped, cls)
        clip = None  # the config's gradient_clipping, inside engine.step()
    else:
        par = parallelism(stage, variant=variant)
        wrapped = par.apply(model)
        inner = par.make_optimizer(wrapped, cls, **kwargs)
        opt = StateAfterStep(inner, lambda: par.state_bytes(wrapped, inner), steps)
        clip = HYPER["clip"]
    run = run_steps(par, model, lambda step: batch, steps, wrapped=wrapped,
                    optimizer=opt, loss_fn=_loss, max_grad_norm=clip,
                    record_grads=False)
    return {"variant": variant, "stage": stage, "losses": run.losses,
            "n_params": n_params, "params": run.params, "state": opt.state}


def reference_run(world_size: int = 2, steps: int = 3, batch_per_rank: int = 2,
                  seed: int = 0, optimizer: str = "adamw", lr: float | None = None
                  ) -> dict[str, Any]:
    """One process, the whole global batch: the losses and parameters to match.

    Taught in: Chapter 4, "DeepSpeed, run".
    """
    batch = _global_batch(world_size * batch_per_rank, seed)
    cls, kwargs = optimizer_of(optimizer, HYPER["lr"] if lr is None else lr)
    kwargs["weight_decay"] = HYPER["weight_decay"]
    run = run_steps(Parallelism(), _model(seed), lambda step: batch, steps,
                    optimizer_class=cls, optimizer_kwargs=kwargs, loss_fn=_loss,
                    max_grad_norm=HYPER["clip"], record_grads=False)
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
