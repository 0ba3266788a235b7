"""Everything one training run is made of, built from its configuration.

:func:`build_job` answers, in the book's order: does the model fit (Chapter 1), which
technique runs it (the capstone's rows of the book's one strategy table,
:data:`dtlib.planner.strategies.STRATEGIES`: DDP, FSDP2, FSDP x TP), the optimizer
and learning-rate schedule, the fp16 loss scaler (Chapter 7), this rank's data
(Chapter 3's sampler) and the step that accumulates micro-batches (Chapter 8).
:mod:`dtlib.train.loop` hands the :class:`Job` to the one loop,
:func:`dtlib.models.run.run_steps`.

Taught in: Chapter 10, "The script's structure".
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from dtlib.accumulation import accumulation_step
from dtlib.data_parallel.parallelism import DataParallelism
from dtlib.low_comm import DiLoCo, OuterStepping
from dtlib.low_comm.powersgd import PowerSGDState, powersgd_hook
from dtlib.memory.formulas import GB, ModelStates, model_state_bytes
from dtlib.models.init import storage_bytes
from dtlib.models.run import Parallelism, RunConfig, TrainState, logits_of
from dtlib.planner.strategies import STRATEGIES, Options, Strategy
from dtlib.runtime import dist as ddist
from dtlib.train.config import OPTIMIZERS, STRATEGY_NAMES, TrainConfig
from dtlib.train.data import (GlobalSampler, MicroBatch, SyntheticTokens, open_split,
                              step_batches)
from dtlib.train.identity import run_identity
from dtlib.train.model import (build_model, count_params, init_model, starts_on_meta,
                               unit_params)
from dtlib.zero.fsdp import bf16_policy

__all__ = ["DoesNotFit", "check_memory", "startup_bytes", "prepare_model",
           "start_model", "lr_lambda", "token_loss", "low_comm", "plain_hook",
           "stepped", "Job", "build_job", "build_data"]


class DoesNotFit(RuntimeError):
    """The model states alone exceed the device's memory (ERRATA 34)."""


def startup_bytes(n_params: int, strategy: str, world_size: int,
                  unit_params: int | None) -> float:
    """Peak bytes of fp32 parameter storage per device while the model is set up.

    A meta-device start-up (``unit_params`` given) allocates only what the rank
    keeps, then writes each module's full values through one CPU copy of that
    module: FSDP2 peaks at its shard plus one unit, ``4 (N / dp + unit)``; DDP at
    the replica plus one unit, ``4 (N + unit)``. A model built whole first (None)
    holds all ``4 N`` bytes on every rank before anything is sharded (ERRATA 34's
    second half: the state formula alone misses it).

    Args:
        n_params, strategy, world_size: as :func:`check_memory`.
        unit_params: parameters of the largest unit (:func:`dtlib.train.model.
            unit_params`), or None when the model is built whole.
    Returns:
        The bytes.

    Taught in: Chapter 10, "Refuse what cannot fit".
    """
    if unit_params is None:
        return 4.0 * n_params
    kept = n_params / world_size if STRATEGIES[strategy].shards_on_meta else n_params
    return 4.0 * (kept + unit_params)


def check_memory(n_params: int, strategy: str, world_size: int,
                 device_gb: float | None, unit_params: int | None = None
                 ) -> ModelStates:
    """Model-state bytes per device for ``strategy``; raise if they cannot fit, in
    training or while the model is set up.

    DDP keeps everything on every rank (ZeRO stage 0); FSDP2 shards parameters,
    gradients and AdamW state over the ``world_size`` ranks (stage 3). The script keeps
    fp32 parameters and optimizer state in every precision (autocast and FSDP's
    MixedPrecisionPolicy compute in bf16 but store fp32): 4 + 4 + 8 = 16 B/param.
    Set-up peaks at :func:`startup_bytes`: the shard plus one unit when the model
    starts on the meta device, the whole fp32 model when it is built whole.

    Args:
        n_params: parameters of the model.
        strategy: "ddp" or "fsdp" (a key of the strategy table).
        world_size: data-parallel ranks.
        device_gb: the device's memory in GB (1e9 B); None (CPU) only estimates.
        unit_params: parameters of the largest unit of a meta-device start-up;
            None: the model is built whole on every rank first.
    Returns:
        The :class:`dtlib.memory.ModelStates` per device.
    Raises:
        DoesNotFit: the states, or the set-up's peak, exceed ``device_gb``.

    Taught in: Chapter 10, "Refuse what cannot fit" (formula: Chapter 1).
    """
    if strategy not in STRATEGY_NAMES:
        raise ValueError(f"strategy={strategy!r} is not allowed; allowed: "
                         f"{', '.join(STRATEGY_NAMES)}")
    stage = STRATEGIES[strategy].zero_stage
    states = model_state_bytes(n_params, zero_stage=stage, dp=world_size,
                               precision="fp32", optimizer="adam")
    if device_gb is not None and states.total > device_gb * GB:
        raise DoesNotFit(
            f"{strategy} on {world_size} ranks needs {states.total / GB:.1f} GB of "
            f"model states per device (ZeRO stage {stage}, 16 B/param x "
            f"{n_params:.3g} params) but the device has {device_gb:.0f} GB; use "
            f"--strategy fsdp, more ranks or a smaller model")
    start = startup_bytes(n_params, strategy, world_size, unit_params)
    if device_gb is not None and start > device_gb * GB:
        how = ("the whole fp32 model, built before sharding" if unit_params is None
               else f"the shard plus one unit of {unit_params:.3g} params")
        raise DoesNotFit(
            f"{strategy} on {world_size} ranks needs {start / GB:.1f} GB per device "
            f"while setting up ({how}) but the device has {device_gb:.0f} GB")
    return states


def prepare_model(model: nn.Module, par: Parallelism, device: torch.device,
                  sync_bn: bool | None = None) -> nn.Module:
    """BatchNorm -> SyncBatchNorm, move to ``device``, *then* wrap (ERRATA 33).

    DDP and FSDP register the parameters and buffers they see when they wrap; a
    module swapped in afterwards is not what they synchronise, so the conversion comes
    first (the PyTorch docs' order). The book's GPT, like Llama, has LayerNorm/RMSNorm
    and no BatchNorm: the conversion is then a no-op, kept for models that have one.

    Args:
        model: the unwrapped model, identical on every rank.
        par: the strategy's Parallelism; ``par.apply`` wraps (DDP), shards (FSDP2)
            or splits and shards (FSDP x TP).
        device: this rank's device (from :mod:`dtlib.runtime.dist`: local rank,
            ERRATA 35).
        sync_bn: convert BatchNorm; None converts on CUDA only (DDP refuses
            SyncBatchNorm on CPU, where each rank keeps its own batch statistics).
    Returns:
        The wrapped model.

    Taught in: Chapter 10, "Wrap in the right order".
    """
    if sync_bn if sync_bn is not None else device.type == "cuda":
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    return par.apply(model.to(device))


def start_model(cfg: TrainConfig, strategy: Strategy, par: Parallelism,
                device: torch.device,
                probe: Callable[[str, nn.Module, nn.Module | None], None] | None = None
                ) -> nn.Module:
    """The wrapped model with ``build_model(cfg)``'s values, never whole on a rank
    that shards it.

    The book's GPT and a random-init Llama start on the meta device (shapes, no
    memory; :func:`dtlib.train.model.starts_on_meta`). A sharding
    strategy (``shards_on_meta``: FSDP2, FSDP x TP) applies there, then
    ``to_empty`` allocates this rank's shards on ``device`` and
    :func:`dtlib.train.model.init_model` writes the seeded values module by module;
    DDP allocates and initialises the replica first, then wraps. ``--init-from``
    (``from_pretrained``) builds the model whole, as before.

    Args:
        cfg: the configuration; strategy, par: its row and its Parallelism.
        device: this rank's device.
        probe: ``probe(step, model, twin)`` after each set-up step ("meta",
            "applied", "allocated", "module": ``twin`` holds one module's full
            values, "initialised"; a whole build: "built"), to measure what the
            rank holds.
    Returns:
        The wrapped (or sharded) model.

    Taught in: Chapter 10, "Refuse what cannot fit".
    """
    def note(step: str, model: nn.Module, twin: nn.Module | None = None) -> None:
        if probe is not None:
            probe(step, model, twin)

    if not starts_on_meta(cfg):
        model = build_model(cfg)  # same weights everywhere
        note("built", model)
        return prepare_model(model, par, device)
    model = build_model(cfg, meta=True)
    note("meta", model)

    def init(m: nn.Module) -> None:
        m.to_empty(device=device)
        note("allocated", m)
        init_model(m, cfg, probe=lambda twin: note("module", m, twin))
        note("initialised", m)

    if strategy.shards_on_meta:  # shard the shapes, then allocate the shards only
        model = prepare_model(model, par, torch.device("meta"),
                              sync_bn=device.type == "cuda")
        note("applied", model)
        init(model)
        return model
    init(model)
    return prepare_model(model, par, device)


def lr_lambda(step: int, warmup: int, steps: int, min_lr_ratio: float) -> float:
    """Learning-rate multiplier: linear warm-up, then cosine decay to min_lr_ratio.

    Taught in: Chapter 10, "The script's structure".
    """
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, steps - warmup))
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def token_loss(model: nn.Module, idx: torch.Tensor, targets: torch.Tensor
               ) -> torch.Tensor:
    """Summed fp32 cross-entropy of a micro-batch (the GPT's logits or a HF model's
    ``ModelOutput``): what Chapter 8's accumulation normalises by the global tokens.

    Taught in: Chapter 10, "The script's structure".
    """
    logits = logits_of(model(idx))
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(),
                           reduction="sum")


@dataclass
class Job:
    """One run, built: what :func:`dtlib.models.run.run_steps` and the checkpoint
    code need.

    cfg, world: the configuration and this process's world.
    strategy: the row of the strategy table; par: its Parallelism.
    model: the wrapped (or sharded) model; optimizer, scheduler, scaler (fp16 or
        None): built after wrapping, restored by a resume.
    data, sampler: the training samples and the job's sampler (the data state:
        samples consumed, the same on every rank); held_out: the evaluation
        samples (None without ``--eval-every``).
    batch_fn, step_fn: ``run_steps``'s per-step local batch (``accum_steps``
        micro-batches) and the accumulating step (Chapter 8).
    n_params, states: the parameter count and the model-state bytes per device.
    startup_bytes: the bytes of parameter storage this rank held while the model
        was set up: ``peak`` (the largest, after any set-up step), ``kept`` (its
        parameters when training starts) and ``whole`` (the fp32 model, ``4 N``).
    verified: the files of the resumed checkpoint this rank hashed (the ones it
        reads).
    identity: the run's identity (:func:`dtlib.train.identity.run_identity`),
        computed once: what every save writes as ``run.json`` and every resume
        compares with.
    resumed: what the resume loaded and checked (``path``, ``step``, ``damaged``
        (the newer checkpoints fallen back over), ``save_s`` (how long that save
        took), ``changes`` (the lines of what differs), ``checked`` (identity
        entries compared)); None for a run from step 0.
    """

    cfg: TrainConfig
    world: ddist.World
    strategy: Strategy
    par: Parallelism
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    scaler: Any
    data: Any
    sampler: GlobalSampler
    held_out: Any
    batch_fn: Callable[[int], list[MicroBatch]]
    step_fn: Callable[..., torch.Tensor]
    n_params: int
    states: ModelStates
    startup_bytes: dict[str, int]
    identity: dict[str, Any] = field(default_factory=dict)
    verified: set[str] = field(default_factory=set)
    resumed: dict[str, Any] | None = None

    @property
    def train_state(self) -> TrainState:
        """The built (or resumed) model, optimizer, scheduler and scaler, as the
        one loop takes them."""
        return TrainState(self.model, self.optimizer, self.scheduler, self.scaler)

    def run_config(self, steps: int | None = None, start: int = 0,
                   **more: Any) -> RunConfig:
        """The one loop's configuration of this job, from ``start`` to ``steps``
        (``cfg.steps``): this rank's batches (``batch_fn``), the accumulating step,
        the gradient norm clipped to ``--grad-clip`` or, at 0, measured and not
        clipped (clipping to inf multiplies every gradient by exactly 1.0, the
        coefficient min(inf / norm, 1)), nothing recorded; ``more``: other
        :class:`~dtlib.models.run.RunConfig` fields (the save schedule)."""
        cfg = self.cfg
        return RunConfig(cfg.steps if steps is None else steps, start=start,
                         step_fn=self.step_fn, local_batches=True,
                         max_grad_norm=cfg.grad_clip if cfg.grad_clip > 0
                         else math.inf, record_grads=False, record_params=False,
                         **more)

    @property
    def global_tokens(self) -> int:
        """Target tokens of one optimizer step over all data-parallel ranks."""
        return self.cfg.tokens_per_micro_batch * self.cfg.accum_steps * self.par.dp_size


def low_comm(cfg: TrainConfig, par: Parallelism) -> Parallelism:
    """``--diloco H``: the ddp row's replicas, synchronised by DiLoCo's outer step
    every H steps instead of DDP's every step; ``--powersgd R``: torch DDP with
    PowerSGD of rank R as its communication hook (Chapter 15). Else ``par``.

    Taught in: Chapter 15, "In the capstone".
    """
    if cfg.diloco:
        return DiLoCo(cfg.diloco)
    if cfg.powersgd:
        state = PowerSGDState(matrix_rank=cfg.powersgd, start_iter=cfg.powersgd_start)
        return DataParallelism("torch", comm_hook=powersgd_hook, comm_state=state)
    return par


@contextlib.contextmanager
def plain_hook(job: "Job") -> Iterator[None]:
    """Inside: PowerSGD's hook (``--powersgd``) all-reduces plainly and its memory
    comes back unchanged afterwards. DDP's warm-up backward (its buckets regrouped
    before the first real step, fresh or resumed) runs inside: its gradients are
    thrown away, and the first backward's buckets do not fit a resumed memory."""
    state = getattr(job.par, "comm_state", None)
    if not isinstance(state, PowerSGDState):
        yield
        return
    saved = state.state_dict()
    state.iteration = 0  # before start_iter: plain all-reduces, no memory read
    try:
        yield
    finally:
        state.load_state_dict(saved)


def stepped(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer a schedule and DCP's state-dict helpers see: DiLoCo's
    inner one (its outer state is saved beside, per rank), else ``optimizer``."""
    return optimizer.inner if isinstance(optimizer, OuterStepping) else optimizer


def strategy_options(cfg: TrainConfig, strategy: Strategy) -> Options:
    """What the flags choose about the strategy: ``--tp``, and bf16 computed by
    FSDP2's mixed-precision policy where the strategy does not autocast.

    Taught in: Chapter 10, "The script's structure".
    """
    policy = bf16_policy() if cfg.precision == "bf16" and not strategy.autocast \
        else None
    return Options(mp_policy=policy, tp=cfg.tp) if "tp" in strategy.options \
        else Options()


def build_job(cfg: TrainConfig, world: ddist.World | None = None) -> Job:
    """Build every part of the run ``cfg`` describes, on this process's ``world``.

    Every rank calls it (wrapping and sharding are collectives). Nothing is resumed
    here: :func:`dtlib.train.state.resume` loads a checkpoint into the job.

    Args:
        cfg: the validated configuration.
        world: the world (default: :func:`dtlib.runtime.dist.world`).
    Returns:
        The :class:`Job`.
    Raises:
        DoesNotFit: the model states cannot fit on the device.

    Taught in: Chapter 10, "The script's structure".
    """
    world = world or ddist.world()
    device = world.device
    # ERRATA 34: count before allocating: the model itself, built on the meta device
    # (shapes only), whatever it is (the GPT, a HF Llama, a config.json).
    n_params = count_params(cfg)
    device_gb = (torch.cuda.get_device_properties(device).total_memory / GB
                 if device.type == "cuda" else None)
    states = check_memory(n_params, cfg.strategy, world.world_size, device_gb,
                          unit_params(cfg) if starts_on_meta(cfg) else None)
    strategy = STRATEGIES[cfg.strategy]
    par = low_comm(cfg, strategy.parallelism(strategy_options(cfg, strategy)))
    held: list[int] = []  # bytes of parameter storage after each set-up step

    def probe(step: str, m: nn.Module, twin: nn.Module | None) -> None:
        held.append(storage_bytes(m.parameters())
                    + (storage_bytes(twin.parameters()) if twin is not None else 0))

    model = start_model(cfg, strategy, par, device, probe)  # same values everywhere
    startup = {"peak": max(held), "kept": storage_bytes(model.parameters()),
               "whole": 4 * n_params}
    optimizer_class, kwargs = OPTIMIZERS[cfg.optimizer]
    opt = par.make_optimizer(model, optimizer_class, lr=cfg.lr,  # after wrapping
                             weight_decay=cfg.weight_decay, **kwargs)
    sched = torch.optim.lr_scheduler.LambdaLR(stepped(opt), lambda s: lr_lambda(
        s, cfg.warmup, cfg.steps, cfg.min_lr_ratio))
    # fp16 needs a loss scaler, bf16 does not (Chapter 7); it is part of the state,
    # so it exists before a resume restores its scale.
    scaler = torch.amp.GradScaler(device.type, init_scale=cfg.loss_scale) \
        if cfg.precision == "fp16" else None
    data, held_out = build_data(cfg)
    # Shard by data-parallel rank only: the tp ranks of one row read the same batch.
    dp_rank = dist.get_rank(par.dp_group) if par.dp_size > 1 else 0
    sampler = GlobalSampler(len(data), seed=cfg.seed)
    low = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.precision)
    step_fn = accumulation_step(cfg.accum_steps, token_loss, autocast_dtype=low
                                if strategy.autocast else None)
    batch_fn = step_batches(data, sampler, cfg.micro_batch, cfg.accum_steps,
                            dp_rank, par.dp_size, device)
    return Job(cfg, world, strategy, par, model, opt, sched, scaler, data, sampler,
               held_out, batch_fn, step_fn, n_params, states, startup,
               run_identity(cfg, world.world_size))


def build_data(cfg: TrainConfig) -> tuple[Any, Any]:
    """(training samples, held-out samples or None) of ``cfg``: the token file's
    split (``--data``) or the synthetic corpus (held out: ``eval_samples`` of
    another seed), the same on every rank.

    Taught in: Chapter 10, "Real token files".
    """
    if cfg.data is not None:
        data, held_out, _ = open_split(cfg.data, cfg.seq_len, cfg.eval_fraction)
        return data, held_out if cfg.eval_every else None
    data = SyntheticTokens(cfg.dataset_size, cfg.seq_len, cfg.vocab_size, cfg.seed)
    held_out = SyntheticTokens(cfg.eval_samples, cfg.seq_len, cfg.vocab_size,
                               cfg.seed + 1) if cfg.eval_every else None
    return data, held_out
