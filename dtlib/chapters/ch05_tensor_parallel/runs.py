"""Rank functions that put tensor parallelism next to one process (tests and Chapter 5).

- :func:`reference_gpt_run`: one process, the full GPT (the truth);
- :func:`train_tp`: one rank of the same training, tensor-parallel ("ours" or
  "dtensor"), optionally with the seed's mistake of leaving out f (ERRATA 17);
- :func:`mlp_pair_comms`: the collectives of one column -> row MLP pair, with and
  without a needless all-gather between the layers (ERRATA 18);
- :func:`init_scale`: activation scale through column -> row pairs, seed-style
  independent std-1 shards versus slices of one sanely initialised weight (ERRATA 20).

Taught in: Chapter 5, "Equal to one process" and "The seed's mistakes".
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from dtlib.collectives.accounting import count_comms
from dtlib.models.gpt import GPTConfig, build_gpt
from dtlib.models.reference import gpt_batches
from dtlib.models.reference import reference_gpt_run
from dtlib.models.run import (Parallelism, RunConfig, RunResult, TrainState,
                              default_step, local_tensor, run_steps)
from dtlib.models.sizes import size
from dtlib.runtime import dist as ddist
from dtlib.tensor_parallel import VARIANTS, parallelism
from dtlib.tensor_parallel.gpt import parallel_param_count
from dtlib.tensor_parallel.layers import (ColumnParallelLinear, RowParallelLinear,
                                          full_linear, tp_rank, tp_size)

__all__ = ["TINY", "VARIANTS", "reference_gpt_run", "drop_f", "train_tp",
           "count_first_step", "tp_runs", "mlp_pair_both", "mlp_pair_comms",
           "init_scale", "reference_linear_pair", "ColumnParallelLinearWithoutF"]

# Small enough that 4 ranks train it for 5 steps in well under a second.
TINY = size("tiny")


class ColumnParallelLinearWithoutF(ColumnParallelLinear):
    """The seed's column layer (ERRATA 17): no f, so the input gradient stays partial.

    forward: ``F.linear`` on the replicated input, backward: each rank keeps only its
    own slice's contribution to the input gradient (never summed). Teaching only.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


def drop_f(model: nn.Module) -> nn.Module:
    """Turn every :class:`ColumnParallelLinear` of ``model`` into the seed's (no f).

    Taught in: Chapter 5, "Leaving out f (ERRATA 17)".
    """
    for m in model.modules():
        if type(m) is ColumnParallelLinear:
            m.__class__ = ColumnParallelLinearWithoutF
    return model


def count_first_step(into: dict[str, Any]) -> Callable[..., torch.Tensor]:
    """A ``step_fn`` for ``run_steps`` that counts the first step's collectives.

    Args:
        into: receives ``{"forward": summary, "backward": summary}`` of the first
            call (:func:`~dtlib.collectives.accounting.count_comms`); later calls
            are the default step.
    Returns:
        ``step_fn(par, wrapped, batch, loss_fn, scaler=None) -> detached loss``.

    Taught in: Chapter 5, "Counting the messages".
    """
    def step_fn(par: Parallelism, wrapped: nn.Module, batch: Any,
                loss_fn: Callable[..., torch.Tensor], scaler: Any = None
                ) -> torch.Tensor:
        if into:
            return default_step(par, wrapped, batch, loss_fn, scaler=scaler)
        with par.grad_sync(wrapped, True):
            with count_comms() as fwd:
                loss = loss_fn(wrapped, *batch)
            with count_comms() as bwd:
                loss.backward()
        into.update(forward=fwd.summary(), backward=bwd.summary())
        return loss.detach()

    return step_fn


def _replicated(model: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's own copy of every parameter that no layer splits."""
    split = (ColumnParallelLinear, RowParallelLinear)
    return {n: p.detach().cpu().clone() for n, p in model.named_parameters()
            if local_tensor(p) is p
            and not isinstance(model.get_submodule(n.rpartition(".")[0]), split)}


def train_tp(cfg: GPTConfig, variant: str, batch: int, steps: int, lr: float = 1e-3,
             seed: int = 0, with_f: bool = True, count: bool = True,
             optimizer_class: type = torch.optim.AdamW,
             **optimizer_kwargs: Any) -> RunResult:
    """One rank of tensor-parallel training of :func:`reference_gpt_run`'s GPT.

    Every rank sees the whole batch (tensor parallelism splits the model, not the
    data). The first step's collectives are counted, forward and backward apart.

    Args:
        cfg: the GPT; ``n_heads`` and ``4 * hidden`` divisible by the world size.
        variant: ``"ours"`` (:func:`tensor_parallelize`) or ``"dtensor"``.
        batch, steps, lr, seed, optimizer_class, optimizer_kwargs: as
            :func:`reference_gpt_run`.
        with_f: False reproduces ERRATA 17 (ours only).
        count: record the first step's communication.
    Returns:
        The :class:`~dtlib.models.run.RunResult` of ``run_steps``: ``losses``,
        ``grads`` (full, first step), ``params`` (full, after the last step); and
        ``local`` (this rank's replicated parameters after training, to compare
        across ranks), ``counts`` (this rank's parameters, see
        :func:`parallel_param_count`), ``comms`` (``{"forward": summary,
        "backward": summary}`` of the first step).

    Taught in: Chapter 5, "Equal to one process".
    """
    if not with_f and variant != "ours":
        raise ValueError(f"with_f=False is the seed's mistake in our layers; "
                         f"variant={variant!r} is not allowed with it; allowed: 'ours'")
    par = parallelism(variant)
    device = ddist.world().device
    model = par.apply(build_gpt(cfg, seed).to(device))
    if not with_f:
        drop_f(model)
    comms: dict[str, Any] = {}
    config = RunConfig(steps, optimizer_class=optimizer_class,
                       optimizer_kwargs={"lr": lr, **optimizer_kwargs},
                       step_fn=count_first_step(comms) if count else None)
    result = run_steps(par, None, gpt_batches(cfg, batch, device), config,
                       TrainState(model))
    result.extra.update(counts=parallel_param_count(model), comms=comms,
                        local=_replicated(model))
    return result


def tp_runs(cfg: GPTConfig, batch: int, steps: int, **optimizer: Any
            ) -> dict[str, RunResult]:
    """One rank, one launch: :func:`train_tp` ours, DTensor's and ours without f.

    Args:
        cfg, batch, steps: as :func:`train_tp`.
        optimizer: ``lr``, ``optimizer_class`` and its keyword arguments.
    Returns:
        ``{"ours": ..., "dtensor": ..., "no_f": ...}`` (the last without counting).

    Taught in: Chapter 5, "Equal to one process" and "Leaving out f (ERRATA 17)".
    """
    return {"ours": train_tp(cfg, "ours", batch, steps, **optimizer),
            "dtensor": train_tp(cfg, "dtensor", batch, steps, **optimizer),
            "no_f": train_tp(cfg, "ours", batch, steps, with_f=False, count=False,
                             **optimizer)}


def mlp_pair_both(hidden: int, batch: int) -> dict[bool, dict[str, Any]]:
    """One rank, one launch: :func:`mlp_pair_comms` without and with the gather.

    Returns:
        ``{False: Megatron's pairing, True: the seed's all-gather between}``.

    Taught in: Chapter 5, "An all-gather that is not needed (ERRATA 18)".
    """
    return {g: mlp_pair_comms(hidden, batch, g) for g in (False, True)}


def mlp_pair_comms(hidden: int, batch: int, gather_between: bool) -> dict[str, Any]:
    """Forward and backward of one column -> GELU -> row pair, collectives counted.

    Args:
        hidden: model width h (the pair is h -> 4h -> h).
        batch: rows of the replicated input.
        gather_between: the seed's reading of ERRATA 18: all-gather the column output
            and let the row layer split it again.
    Returns:
        ``{"forward": summary, "backward": summary, "out": output, "grad": input
        gradient}`` (CPU tensors), the same on every rank.
    """
    world = ddist.world()
    fc = ColumnParallelLinear(hidden, 4 * hidden, seed=1,
                              gather_output=gather_between).to(world.device)
    proj = RowParallelLinear(4 * hidden, hidden, seed=2,
                             input_is_parallel=not gather_between).to(world.device)
    x = torch.randn(batch, hidden, generator=torch.Generator().manual_seed(0))
    x = x.to(world.device).requires_grad_()
    with count_comms() as fwd:
        y = proj(F.gelu(fc(x)))
    with count_comms() as bwd:
        y.pow(2).sum().backward()
    return {"forward": fwd.summary(), "backward": bwd.summary(),
            "out": y.detach().cpu(), "grad": x.grad.cpu()}


def init_scale(hidden: int, pairs: int, batch: int = 64) -> dict[str, list[float]]:
    """Std of the activations after each column -> GELU -> row pair, two inits.

    ``"seed"``: every rank draws its shards with ``torch.randn`` (std 1) from its own
    seed, as the seed tutorial does (ERRATA 20). ``"sliced"``: every shard is a slice
    of one full ``nn.Linear``-initialised weight (:func:`full_linear`).

    Returns:
        ``{"seed": [std after pair 1, ...], "sliced": [...]}``; the input has std 1.
    """
    world = ddist.world()
    out: dict[str, list[float]] = {}
    for style in ("seed", "sliced"):
        layers = []
        for i in range(pairs):
            fc = ColumnParallelLinear(hidden, 4 * hidden, seed=2 * i)
            proj = RowParallelLinear(4 * hidden, hidden, seed=2 * i + 1)
            if style == "seed":
                gen = torch.Generator().manual_seed(1000 * tp_rank() + i)
                with torch.no_grad():
                    for lin in (fc, proj):
                        lin.weight.copy_(torch.randn(lin.weight.shape, generator=gen))
            layers.append((fc.to(world.device), proj.to(world.device)))
        x = torch.randn(batch, hidden, generator=torch.Generator().manual_seed(0))
        x, stds = x.to(world.device), []
        with torch.no_grad():
            for fc, proj in layers:
                x = proj(F.gelu(fc(x)))
                stds.append(x.std().item())
        out[style] = stds
    out["tp"] = [float(tp_size())]
    return out


def reference_linear_pair(hidden: int, batch: int) -> dict[str, torch.Tensor]:
    """One process: :func:`mlp_pair_comms`'s pair with full ``nn.Linear`` layers."""
    fc, proj = full_linear(hidden, 4 * hidden, seed=1), full_linear(4 * hidden, hidden,
                                                                   seed=2)
    x = torch.randn(batch, hidden, generator=torch.Generator().manual_seed(0))
    x.requires_grad_()
    y = proj(F.gelu(fc(x)))
    y.pow(2).sum().backward()
    return {"out": y.detach(), "grad": x.grad}
