"""Local SGD and DiLoCo: ``H`` inner steps per replica, then one outer step.

Every data-parallel replica holds the whole model and an *anchor*, the parameters
all replicas last agreed on. It takes ``H`` inner steps (any optimizer, AdamW in the
paper) on its own rows of each global batch, with no communication. Then the outer
step: each replica's pseudo-gradient ``anchor - parameters`` is averaged over the
replicas (one all-reduce of the parameters' size), an outer optimizer steps the
anchor with it (SGD with Nesterov momentum, lr 0.7 and momentum 0.9 in Douillard et
al., 2023), and every replica restarts from the new anchor. Each replica keeps its
inner optimizer's state across outer steps.

- ``H = 1``, an outer SGD of lr 1 without momentum: the average of the replicas'
  one-step updates. With a linear inner optimizer (SGD, with momentum too) that is
  data parallelism's step on the averaged gradient: DDP, within the rounding of the
  averages' order.
- Local SGD is DiLoCo with that outer optimizer and any ``H``.
- Communication per step is one all-reduce of the parameters every ``H`` steps:
  ``1/H`` of DDP's (fp32 gradients every step), the same bytes per all-reduce.

:class:`DiLoCo` is the :class:`~dtlib.models.run.Parallelism` the one loop trains
with; its optimizer (:class:`OuterStepping`) runs the inner step and, every ``H``
steps, the outer one. :func:`simulate_diloco` computes the same on one process.

Taught in: Chapter 15, "When the network is slow".
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from dtlib.data_parallel.parallelism import DataParallelRows, rows_of_rank
from dtlib.models.run import (Batch, Parallelism, RunConfig, RunResult, TrainState,
                              run_steps)

__all__ = ["DiLoCo", "OuterStepping", "outer_update", "simulate_diloco"]


def _check(inner_steps: int, outer_lr: float, outer_momentum: float) -> None:
    if isinstance(inner_steps, bool) or not isinstance(inner_steps, int) \
            or inner_steps < 1:
        raise ValueError(f"inner_steps={inner_steps!r} must be an integer >= 1")
    if not outer_lr > 0:
        raise ValueError(f"outer_lr={outer_lr!r} must be > 0")
    if not 0 <= outer_momentum < 1:
        raise ValueError(f"outer_momentum={outer_momentum!r} must be in [0, 1)")


def _outer_optimizer(anchor: list[torch.Tensor], lr: float, momentum: float
                     ) -> torch.optim.SGD:
    return torch.optim.SGD(anchor, lr=lr, momentum=momentum,
                           nesterov=momentum > 0)


def outer_update(anchor: list[torch.Tensor], pseudo_grads: list[torch.Tensor],
                 outer: torch.optim.Optimizer) -> None:
    """The outer step: ``pseudo_grads`` (the replicas' averaged ``anchor - params``)
    as the anchor's gradient, one step of ``outer``.

    Taught in: Chapter 15, "DiLoCo"."""
    for a, g in zip(anchor, pseudo_grads):
        a.grad = g
    outer.step()
    for a in anchor:
        a.grad = None


class OuterStepping:
    """The optimizer :class:`DiLoCo` gives the loop: ``step()`` is the inner
    optimizer's step, and every ``H``-th the outer step too (an all-reduce of the
    pseudo-gradients over the replicas, the outer optimizer on the anchor, every
    replica back at the anchor). ``state_dict`` holds both optimizers, the anchor
    and the inner steps taken, so a checkpoint resumes mid-outer-step."""

    def __init__(self, inner: torch.optim.Optimizer, params: list[nn.Parameter],
                 par: "DiLoCo") -> None:
        self.inner, self.params, self.par = inner, params, par
        self.anchor = [p.detach().clone() for p in params]
        self.outer = _outer_optimizer(self.anchor, par.outer_lr, par.outer_momentum)
        self.steps = 0

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.inner.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        self.inner.step()
        self.steps += 1
        if self.steps % self.par.inner_steps == 0:
            self.sync()

    @torch.no_grad()
    def sync(self) -> None:
        """The outer step: average ``anchor - params`` over the replicas (one
        all-reduce of every parameter, flattened), step the anchor, restart every
        replica from it."""
        deltas = [a - p.detach() for a, p in zip(self.anchor, self.params)]
        flat = torch.cat([d.reshape(-1) for d in deltas])
        if self.par.dp_size > 1:
            dist.all_reduce(flat, group=self.par.dp_group)
        flat /= self.par.dp_size
        averaged = list(torch.split(flat, [d.numel() for d in deltas]))
        outer_update(self.anchor, [g.view_as(a) for g, a in zip(averaged, self.anchor)],
                     self.outer)
        for p, a in zip(self.params, self.anchor):
            p.copy_(a)

    def state_dict(self) -> dict[str, Any]:
        return {"inner": self.inner.state_dict(), "outer": self.outer.state_dict(),
                "anchor": [a.clone() for a in self.anchor], "steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state["inner"])
        with torch.no_grad():
            for a, saved in zip(self.anchor, state["anchor"]):
                a.copy_(saved)
        self.outer.load_state_dict(state["outer"])
        self.steps = int(state["steps"])


class DiLoCo(DataParallelRows):
    """Local SGD / DiLoCo over the data-parallel ranks of ``group`` (default: the
    world): each rank a replica training on its rows of every global batch, an outer
    step every ``inner_steps`` steps (see the module docstring).

    Args:
        inner_steps: ``H``, inner steps between outer steps.
        outer_lr, outer_momentum: the outer SGD (Nesterov when the momentum is > 0);
            DiLoCo's 0.7 and 0.9 by default, local SGD's 1 and 0.
        group: the replicas' process group.

    Taught in: Chapter 15, "DiLoCo".
    """

    def __init__(self, inner_steps: int, outer_lr: float = 0.7,
                 outer_momentum: float = 0.9, *, group: Any = None) -> None:
        _check(inner_steps, outer_lr, outer_momentum)
        self.inner_steps, self.outer_lr = inner_steps, outer_lr
        self.outer_momentum = outer_momentum
        super().__init__(group)
        self.name = f"diloco/H{inner_steps}"

    def make_optimizer(self, wrapped: nn.Module, optimizer_class: type,
                       **kwargs: Any) -> OuterStepping:
        params = [p for p in wrapped.parameters() if p.requires_grad]
        return OuterStepping(optimizer_class(params, **kwargs), params, self)

    def check_accumulation(self, micro_batches: int) -> None:
        """Accumulation inside an inner step is the replica's own business: any
        number of micro-batches, the outer step counts optimizer steps."""


def simulate_diloco(model: nn.Module, batches: Callable[[int], Batch], steps: int,
                    n_replicas: int, inner_steps: int, outer_lr: float = 0.7,
                    outer_momentum: float = 0.9,
                    optimizer_class: type = torch.optim.AdamW,
                    **optimizer_kwargs: Any) -> dict[str, Any]:
    """DiLoCo on one process: ``n_replicas`` copies of ``model``, each trained by the
    one loop on its rows of ``batches(k)`` (``rows_of_rank``) for ``inner_steps``
    steps at a time with its own inner optimizer, then the outer step on their
    averaged pseudo-gradients (summed in replica order).

    Returns:
        ``{"params": the anchor by name after ``steps`` (a multiple of
        ``inner_steps``), "losses": each step's mean over the replicas,
        "max_delta_sum": the largest entry of the summed pseudo-gradients'
        magnitudes over the outer steps, "max_param": the largest anchor entry}``
        (what a rounding bound needs).

    Taught in: Chapter 15, "DiLoCo".
    """
    import copy

    _check(inner_steps, outer_lr, outer_momentum)
    if steps % inner_steps:
        raise ValueError(f"steps={steps} must be a multiple of inner_steps="
                         f"{inner_steps} (the simulation ends on an outer step)")
    replicas = [copy.deepcopy(model) for _ in range(n_replicas)]
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    anchor = [p.detach().clone() for p in model.parameters() if p.requires_grad]
    outer = _outer_optimizer(anchor, outer_lr, outer_momentum)
    states = [TrainState(wrapped=r, optimizer=optimizer_class(
        [p for p in r.parameters() if p.requires_grad], **optimizer_kwargs))
        for r in replicas]
    losses = [0.0] * steps
    max_delta = 0.0
    for start in range(0, steps, inner_steps):
        for r, state in enumerate(states):
            def mine(k: int, r: int = r, start: int = start) -> Batch:
                return rows_of_rank(batches(start + k), r, n_replicas)
            config = RunConfig(inner_steps, optimizer_class=optimizer_class,
                               optimizer_kwargs=dict(optimizer_kwargs),
                               record_grads=False, record_params=False)
            run: RunResult = run_steps(Parallelism(), None, mine, config, state)
            for k, loss in enumerate(run.losses):
                losses[start + k] += loss / n_replicas
        with torch.no_grad():
            deltas = [[a - p.detach() for a, p in zip(
                anchor, (q for q in s.wrapped.parameters() if q.requires_grad))]
                for s in states]
            summed = [sum(ds[i] for ds in deltas) for i in range(len(anchor))]
            max_delta = max(max_delta, max(
                sum(ds[i].abs() for ds in deltas).max().item()
                for i in range(len(anchor))))
            outer_update(anchor, [s / n_replicas for s in summed], outer)
            for s in states:
                for p, a in zip((q for q in s.wrapped.parameters() if q.requires_grad),
                                anchor):
                    p.copy_(a)
    return {"params": {n: a.detach().cpu().clone() for n, a in zip(names, anchor)},
            "losses": losses, "max_delta_sum": max_delta,
            "max_param": max(a.abs().max().item() for a in anchor)}
