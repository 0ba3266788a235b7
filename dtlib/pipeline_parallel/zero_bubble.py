"""Pipeline parallelism, part 4: a backward in two halves, B and W.

A stage's backward computes two things: the gradient of its *input*, which the
previous stage is waiting for, and the gradients of its *weights*, which nobody waits
for until the optimizer step. Zero Bubble pipeline parallelism (Qi et al., 2024) runs
them apart: ``B`` (input gradient) as soon as the output gradient arrives, ``W``
(weight gradients) later, in a slot where the stage would otherwise idle.

The split, from scratch:

- :func:`weight_sites` records, during a stage's forward, the output ``o`` of every
  module call that owns trainable parameters (``nn.Linear``, ``nn.LayerNorm``,
  ``nn.Embedding``).
- :func:`backward_input` is ``B``: one ``torch.autograd.grad`` from the stage's output
  to its input *and* to every recorded ``o``. Asked only for those, autograd skips each
  weight's gradient kernel; it keeps the graph (``retain_graph=True``) and returns the
  gradient of every ``o``: what ``W`` needs.
- :func:`backward_weight` is ``W``: for each recorded module, ``autograd.grad(o,
  its parameters, dL/do)``, added into ``.grad`` as the fused backward would. Each
  module's gradient comes from the same kernel on the same operands as in the fused
  backward, so on one process the gradients are bit-identical to ``loss.backward()``.

What the deferred ``W`` keeps: the micro-batch's graph (the activations its forward
saved: it is not freed at ``B``) and, new, ``dL/do`` for every recorded output
(:attr:`DeferredW.nbytes`). For the book's GPT that is ``11 h`` values per token per
block (ln1 ``h``, qkv ``3h``, proj ``h``, ln2 ``h``, fc ``4h``, fc_proj ``h``), plus
the embeddings' and the head's outputs on the first and last stage
(:func:`gpt_w_bytes`).

Taught in: Chapter 6, "Splitting the backward".
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import torch
import torch.nn as nn

__all__ = ["Site", "DeferredW", "weight_sites", "backward_input", "backward_weight",
           "gpt_w_bytes"]


@dataclass
class Site:
    """One module call that owns trainable parameters: its name, those parameters
    (its own, not its children's) and the output of the call."""

    name: str
    params: list[nn.Parameter]
    output: torch.Tensor


@dataclass
class DeferredW:
    """What ``W`` of one micro-batch needs: each site with ``dL/d(output)``."""

    sites: list[tuple[Site, torch.Tensor]] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        """Bytes of the output gradients held for ``W`` (the graph's saved
        activations, kept too, are the forward's and not counted here)."""
        return sum(g.numel() * g.element_size() for _, g in self.sites)


@contextmanager
def weight_sites(module: nn.Module) -> Iterator[list[Site]]:
    """Record the parameter-owning module calls of one forward of ``module``.

    Usage: ``with weight_sites(stage) as sites: out = stage(x)``.

    Raises:
        ValueError: a parameter reached by two calls (a tied or reused module): its
            weight gradient cannot be taken per call, since autograd would follow the
            second call's graph back into the first.
        TypeError: a parameter-owning module returned something other than a tensor.
    """
    sites: list[Site] = []
    names = {m: n or type(module).__name__ for n, m in module.named_modules()}
    seen: dict[int, str] = {}

    def record(mod: nn.Module, args: object, output: object) -> None:
        params = [p for p in mod.parameters(recurse=False) if p.requires_grad]
        if not params:
            return
        name = names.get(mod, type(mod).__name__)
        if not isinstance(output, torch.Tensor):
            raise TypeError(f"module {name} ({type(mod).__name__}) returned "
                            f"{type(output).__name__}: a weight site must return one "
                            "tensor")
        for p in params:
            if id(p) in seen:
                raise ValueError(
                    f"module {name}: a parameter already used by {seen[id(p)]} in this "
                    "forward (tied or reused weights); split the backward only of a "
                    "stage whose every parameter is used by one module call")
            seen[id(p)] = name
        sites.append(Site(name, params, output))

    handles = [m.register_forward_hook(record) for m in module.modules()
               if any(p.requires_grad for p in m.parameters(recurse=False))]
    try:
        yield sites
    finally:
        for h in handles:
            h.remove()


def backward_input(out: torch.Tensor, grad: torch.Tensor | None,
                   x: torch.Tensor | None, sites: list[Site]
                   ) -> tuple[torch.Tensor | None, DeferredW]:
    """``B``: the gradient of the stage's input ``x``, and what ``W`` will need.

    Args:
        out: the stage's output (the loss on the last stage).
        grad: ``dL/d(out)`` (None when ``out`` is the scalar loss).
        x: the stage's input (None, or a tensor that does not require grad, on the
            first stage: no input gradient is computed).
        sites: the :func:`weight_sites` recorded during this micro-batch's forward.
    Returns:
        ``(dL/dx or None, DeferredW)``.
    """
    live = [s for s in sites if s.output.requires_grad]
    want_x = x is not None and x.requires_grad
    wants = ([x] if want_x else []) + [s.output for s in live]
    if not out.requires_grad or not wants:
        return None, DeferredW()
    grads = torch.autograd.grad(out, wants, grad, retain_graph=True,
                                allow_unused=True)
    x_grad = grads[0] if want_x else None
    site_grads = grads[1:] if want_x else grads
    return x_grad, DeferredW([(s, g) for s, g in zip(live, site_grads)
                              if g is not None])


def backward_weight(deferred: DeferredW) -> None:
    """``W``: every site's weight gradients, added into ``.grad`` (as the fused
    backward's accumulation does: set when None, else added in place)."""
    for site, g in deferred.sites:
        got = torch.autograd.grad(site.output, site.params, g, retain_graph=True,
                                  allow_unused=True)
        for p, gp in zip(site.params, got):
            if gp is None:
                continue
            if p.grad is None:
                p.grad = gp.detach()
            else:
                p.grad += gp
    deferred.sites.clear()


def gpt_w_bytes(hidden: int, seq_len: int, batch: int, n_blocks: int, *,
                first: bool = False, last: bool = False, vocab: int = 0,
                itemsize: int = 4) -> int:
    """Bytes of output gradients one micro-batch's deferred ``W`` holds on a stage
    of the book's GPT (``n_blocks`` blocks, plus the embeddings on the first stage and
    the final LayerNorm and head on the last).

    Per token per block ``11 h`` values: ln1 ``h``, qkv ``3h``, proj ``h``, ln2 ``h``,
    fc ``4h``, fc_proj ``h``. The token embedding adds ``h`` per token, the position
    embedding ``h`` per position (its output has no batch dimension), ln_f ``h`` and
    the head ``vocab`` per token.
    """
    tokens = batch * seq_len
    values = 11 * hidden * tokens * n_blocks
    if first:
        values += hidden * tokens + hidden * seq_len
    if last:
        values += (hidden + vocab) * tokens
    return values * itemsize
