"""DeepSpeed ZeRO-1/2/3 run beside the book's ZeRO and FSDP2 on one Hugging Face Llama.

Every rank of one launch trains the same tiny ``LlamaForCausalLM`` (random weights from
a seed, nothing downloaded) for a few AdamW steps, on its slice of one global batch,
with each implementation in turn: ``deepspeed.initialize`` at ZeRO stage 1, 2 and 3,
:class:`dtlib.zero.ZeRO` at the same stages, and FSDP2. Each returns the global mean
loss of every step, the full parameters at the end and the model-state bytes this rank
holds, so the page (and the tests) can put them side by side and against one process.

DeepSpeed on CPU: it picks its CPU accelerator and gloo by itself; we hand it a torch
``AdamW`` (``zero_allow_untested_optimizer``) instead of its ``FusedAdam``, and tell
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

from dtlib.models import hf
from dtlib.zero.fsdp import fsdp_state_bytes, full_parameters, shard_fsdp2
from dtlib.zero.optimizer import ZeRO

__all__ = ["TINY_LLAMA", "IMPLS", "deepspeed_ds_config", "deepspeed_state_bytes",
           "train_rank", "compare_rank", "reference_run"]

#: vocab 128, hidden 64, 2 decoder layers, 4 heads: 98,624 parameters.
TINY_LLAMA = dict(vocab_size=128, hidden=64, n_layers=2, n_heads=4, seq_len=16)
IMPLS = ("deepspeed", "ours", "fsdp2")
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
    """The DeepSpeed config of these runs: fp32, ZeRO ``stage``, clip 1.0, torch AdamW.

    Taught in: Chapter 4, "DeepSpeed, run".
    """
    return {"train_micro_batch_size_per_gpu": micro_batch,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": HYPER["clip"],
            "zero_optimization": {"stage": stage},
            "zero_allow_untested_optimizer": True,  # a torch AdamW, not FusedAdam
            "steps_per_print": 10 ** 6, "wall_clock_breakdown": False}


def _storage_bytes(tensors: Iterable[Any], seen: set[int]) -> int:
    total = 0
    for t in tensors:
        if not torch.is_tensor(t):
            continue
        s = t.untyped_storage()
        if s.nbytes() == 0 or s.data_ptr() in seen:
            continue
        seen.add(s.data_ptr())
        total += s.nbytes()
    return total


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
    p = _storage_bytes(module, seen)
    master_bytes = _storage_bytes(master, seen)
    o = _storage_bytes((v for st in inner.state.values() for k, v in st.items()
                        if k != "step"), seen)
    g = _storage_bytes(grads, seen)
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


def _deepspeed(model: nn.Module, stage: int, micro_batch: int) -> Any:
    _cpu_accelerator_unless_cuda()
    import deepspeed
    import deepspeed.ops

    # No compiled op: DeepSpeed would JIT-build its CPU shared-memory all-reduce
    # (minutes on a laptop) before the first step; without it, torch.distributed.
    deepspeed.ops.__compatible_ops__ = {}
    opt = torch.optim.AdamW(model.parameters(), lr=HYPER["lr"],
                            weight_decay=HYPER["weight_decay"])
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt,
                                      config=deepspeed_ds_config(stage, micro_batch),
                                      dist_init_required=False)
    return engine


def _full_deepspeed(engine: Any, stage: int) -> dict[str, torch.Tensor]:
    if stage < 3:
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    import deepspeed

    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params):  # all-gathers each partition
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def train_rank(impl: str, stage: int = 3, steps: int = 3, batch_per_rank: int = 2,
               seed: int = 0) -> dict[str, Any]:
    """On every rank: train the tiny Llama with ``impl`` and report what it did.

    Args:
        impl: ``"deepspeed"`` (``deepspeed.initialize``), ``"ours"``
            (:class:`dtlib.zero.ZeRO`) or ``"fsdp2"`` (stage 3 only).
        stage: ZeRO stage 1, 2 or 3.
        steps: AdamW steps (lr 1e-2, weight decay 0.1, clip 1.0).
        batch_per_rank: sequences per rank; the global batch is sliced by rank.
    Returns:
        ``{"impl", "stage", "losses" (global mean per step), "params" (full, by
        name), "state" (bytes by role on this rank), "n_params"}``.

    Taught in: Chapter 4, "DeepSpeed, run".
    """
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r} not allowed; allowed: {IMPLS}")
    if stage not in (1, 2, 3) or (impl == "fsdp2" and stage != 3):
        raise ValueError(f"stage={stage!r} not allowed for {impl}; allowed: "
                         + ("3" if impl == "fsdp2" else "1, 2, 3"))
    ws, rank = dist.get_world_size(), dist.get_rank()
    model = _model(seed)
    n_params = hf.n_params(model)
    x, y = (t.chunk(ws)[rank] for t in _global_batch(ws * batch_per_rank, seed))
    lr, wd, clip = HYPER["lr"], HYPER["weight_decay"], HYPER["clip"]
    if impl == "deepspeed":
        engine = _deepspeed(model, stage, batch_per_rank)
    elif impl == "ours":
        engine = ZeRO(model, stage, lr=lr, weight_decay=wd)
    else:
        engine = shard_fsdp2(model)
        opt = torch.optim.AdamW(engine.parameters(), lr=lr, weight_decay=wd)
    losses, state = [], {}
    for i in range(steps):
        loss = _loss(engine, x, y)
        last = i == steps - 1
        if impl == "deepspeed":
            engine.backward(loss)
            grads = _deepspeed_grads(engine) if last else []
            engine.step()  # clips (gradient_clipping), steps, zeroes the gradients
            if last:
                state = deepspeed_state_bytes(engine, grads)
        elif impl == "ours":
            loss.backward()
            engine.clip_grad_norm_(clip)
            engine.step()
            state = engine.state_bytes() if last else state
            engine.zero_grad()
        else:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(engine.parameters(), clip)
            opt.step()
            state = fsdp_state_bytes(engine, opt) if last else state
            opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)  # equal slices: the mean of the means is the mean
        losses.append(float(mean) / ws)
    params = (_full_deepspeed(engine, stage) if impl == "deepspeed"
              else engine.full_parameters() if impl == "ours"
              else full_parameters(engine))
    return {"impl": impl, "stage": stage, "losses": losses, "n_params": n_params,
            "params": {n: t.cpu() for n, t in params.items()}, "state": state}


def reference_run(world_size: int = 2, steps: int = 3, batch_per_rank: int = 2,
                  seed: int = 0) -> dict[str, Any]:
    """One process, the whole global batch: the losses and parameters to match.

    Taught in: Chapter 4, "DeepSpeed, run".
    """
    model = _model(seed)
    x, y = _global_batch(world_size * batch_per_rank, seed)
    opt = torch.optim.AdamW(model.parameters(), lr=HYPER["lr"],
                            weight_decay=HYPER["weight_decay"])
    losses = []
    for _ in range(steps):
        loss = _loss(model, x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), HYPER["clip"])
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def compare_rank(stages: tuple[int, ...] = (1, 2, 3), steps: int = 3,
                 with_fsdp2: bool = True) -> dict[str, dict[str, Any]]:
    """On every rank: DeepSpeed and ours at each of ``stages``, then FSDP2.

    Returns:
        ``{"deepspeed1": ..., "ours1": ..., ..., "fsdp2": ...}`` of :func:`train_rank`
        results; parameters are kept on rank 0 only (the others return ``{}``).

    Taught in: Chapter 4, "DeepSpeed, run".
    """
    runs = [(impl, s) for s in stages for impl in ("deepspeed", "ours")]
    runs += [("fsdp2", 3)] if with_fsdp2 else []
    out = {}
    for impl, stage in runs:
        r = train_rank(impl, stage, steps)
        if dist.get_rank() != 0:
            r["params"] = {}
        out[f"{impl}{stage}" if impl != "fsdp2" else "fsdp2"] = r
    return out
