"""Checkers for Chapter 5, "Tensor parallel"."""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any, Callable

import torch
import torch.nn.functional as F

from dtlib.collectives.accounting import count_comms
from dtlib.collectives.cost_model import cost_terms
from dtlib.exercises import WrongAnswer, check_close, checker, passed, run_on_ranks
from dtlib.tensor_parallel.gpt import block_tp_numbers
from dtlib.tensor_parallel.layers import full_linear, tp_rank, tp_size
from dtlib.runtime.i18n import N_, _


#: What ``check_tp_numbers`` switches off while the learner's function runs.
_TP_NUMBERS_FORBIDS = {
    'dtlib.tensor_parallel.gpt:block_tp_numbers': N_("the checker's truth"),
    'dtlib.tensor_parallel.gpt:parallel_param_count': N_("the book's own count"),
    'dtlib.collectives.cost_model:cost_terms': N_("the book's formula"),
    'dtlib.collectives.cost_model:bytes_sent_per_rank': N_("the book's formula"),
}


@checker(forbids=_TP_NUMBERS_FORBIDS)
def check_tp_numbers(predict: Callable[[int, int, int, int], dict[str, Any]],
                     cases: tuple[tuple[int, int, int, int], ...] = (
                         (64, 4, 16, 2), (96, 3, 7, 3), (1024, 8, 512, 4),
                         (12288, 1, 2048, 8)),
                     seed: int | None = None) -> None:
    """Check ``predict(h, b, s, tp)`` -> ``{"params_per_rank", "allreduce_bytes",
    "ring_send_bytes"}``.

    For one transformer block of the book's GPT (qkv, proj, fc, fc_proj split; fp32):
    the parameters one rank stores in those four layers, the bytes of the messages it
    all-reduces in one training step (forward + backward), and the bytes it sends when
    those all-reduces run as rings (``2 (tp - 1) / tp`` of each message). The truth is
    :func:`dtlib.tensor_parallel.gpt.block_tp_numbers`, which the tests check against
    real ranks, and :func:`dtlib.collectives.cost_model.cost_terms`. Beyond
    ``cases``, three are drawn from ``seed`` (tp from 1 to 8, odd ones included).
    """
    rng = random.Random(seed)
    drawn = []
    for _draw in range(3):
        tp = rng.randint(1, 8)
        drawn.append((tp * 8 * rng.randint(1, 64), rng.randint(1, 16),
                      rng.randint(1, 4096), tp))
    for h, b, s, tp in (*cases, *drawn):
        got = predict(h, b, s, tp)
        truth = block_tp_numbers(h, b, s, tp)
        if not isinstance(got, Mapping):
            raise WrongAnswer(_("predict must return a dict, got {type}").format(
                                  type=type(got).__name__))
        where = f"h={h}, b={b}, s={s}, tp={tp}"
        check_close(f"{where}: params_per_rank", got.get("params_per_rank"),
                    truth["params_per_rank"], hint=(
                        _("list the four layers' weights and biases and ask of each: "
                          "split over the tp ranks, or whole on every rank? A row "
                          "layer's bias is added after the sum ('Memory per rank')")))
        check_close(f"{where}: allreduce_bytes", got.get("allreduce_bytes"),
                    truth["allreduce_bytes"], hint=(
                        _("count the f and g operators in one block, and the shape "
                          "and dtype of the tensor each one all-reduces, in forward "
                          "and in backward ('Two ways to split a matmul')")))
        # float arithmetic on integers below 2**53 and one ratio: a few ulps apart
        check_close(f"{where}: ring_send_bytes", got.get("ring_send_bytes"),
                    truth["allreduce_bytes"] * cost_terms("ring", "all_reduce", tp)[1],
                    rel=1e-9, hint=(
                        _("a message is not what travels: in a ring all-reduce each "
                          "rank sends 2(N-1)/N of the message, a reduce-scatter then "
                          "an all-gather ('An all-gather that is not needed')")))
    passed(_("your formulas match the tensor-parallel block on {n_cases} "
             "shapes").format(n_cases=len(cases)))


# ---- build it: a column-parallel linear layer with f, on real ranks ------------------

_COL_IN, _COL_OUT, _COL_BATCH = 8, 16, 3


def _column_on_rank(fn: Callable[..., torch.Tensor]) -> dict[str, Any]:
    """On every rank: the learner's column-parallel forward on this rank's rows of one
    full layer, then backward of ``(out * upstream_slice).sum()``."""
    n, r = tp_size(), tp_rank()
    full = full_linear(_COL_IN, _COL_OUT, seed=1)
    lo, hi = r * _COL_OUT // n, (r + 1) * _COL_OUT // n
    w = full.weight[lo:hi].detach().clone().requires_grad_()  # (h_out/tp, h_in)
    b = full.bias[lo:hi].detach().clone().requires_grad_()  # (h_out/tp,)
    x = torch.randn(_COL_BATCH, _COL_IN, generator=torch.Generator().manual_seed(0))
    x.requires_grad_()  # (b, h_in), the same on every rank
    upstream = torch.randn(_COL_BATCH, _COL_OUT,
                           generator=torch.Generator().manual_seed(1))[:, lo:hi]
    with count_comms() as forward:
        out = fn(x, w, b)
    if not isinstance(out, torch.Tensor) or out.shape != (_COL_BATCH, hi - lo):
        return {"shape": tuple(out.shape) if isinstance(out, torch.Tensor) else None,
                "rows": (lo, hi)}
    with count_comms() as backward:
        (out * upstream).sum().backward()
    return {"shape": tuple(out.shape), "rows": (lo, hi), "out": out.detach(),
            "x_grad": x.grad, "w_grad": w.grad, "b_grad": b.grad,
            "forward_ops": [r.op for r in forward.records],
            "backward_ops": [(r.op, r.numel) for r in backward.records]}


def _column_reference(rows: tuple[int, int] | None = None) -> dict[str, torch.Tensor]:
    """One process: the full layer, or (``rows``) only those output rows."""
    full = full_linear(_COL_IN, _COL_OUT, seed=1)
    lo, hi = rows or (0, _COL_OUT)
    x = torch.randn(_COL_BATCH, _COL_IN, generator=torch.Generator().manual_seed(0))
    x.requires_grad_()
    upstream = torch.randn(_COL_BATCH, _COL_OUT,
                           generator=torch.Generator().manual_seed(1))
    out = F.linear(x, full.weight[lo:hi], full.bias[lo:hi])
    (out * upstream[:, lo:hi]).sum().backward()
    return {"out": out.detach(), "x_grad": x.grad, "w_grad": full.weight.grad[lo:hi],
            "b_grad": full.bias.grad[lo:hi]}


# Reordering a float32 sum of n terms moves it by at most ~n * 2**-24 of the terms'
# magnitudes; here the longest reordered sum is x.grad's over the _COL_OUT output
# columns (split in tp partial sums, then all-reduced). Relative to the largest
# element, 4 * _COL_OUT * 2**-24 leaves room for a few such sums on the path and is
# still ~1e5 times smaller than a missing f (half the gradient gone).
_REL = 4 * _COL_OUT * 2.0 ** -24


def _close(a: Any, b: torch.Tensor) -> bool:
    if not (isinstance(a, torch.Tensor) and a.shape == b.shape):
        return False
    return (a - b).abs().max().item() <= _REL * b.abs().max().item()


#: What ``check_column_parallel`` switches off while the learner's function runs.
_COLUMN_PARALLEL_FORBIDS = {
    'dtlib.tensor_parallel.mappings:copy_to_tp': N_("the book's own f"),
    'dtlib.tensor_parallel.mappings:CopyToParallelRegion.forward':
        N_("the book's own f"),
    'dtlib.tensor_parallel.mappings:reduce_from_tp': N_("the book's g"),
    'dtlib.tensor_parallel.layers:ColumnParallelLinear.forward':
        N_("the book's own column-parallel layer"),
}


@checker(forbids=_COLUMN_PARALLEL_FORBIDS)
def check_column_parallel(fn: Callable[..., torch.Tensor],
                          world_sizes: tuple[int, ...] | None = None,
                          seed: int | None = None) -> None:
    """Check ``fn(x, weight_shard, bias_shard) -> out_shard``: a column-parallel linear.

    On each of ``world_sizes`` real ranks (default 2, 4 and one drawn from 3 and 5,
    where the rows split unevenly), ``x`` is the whole input (the same on every rank)
    and the shards are this rank's rows of one full ``nn.Linear``. The output slice,
    ``x``'s gradient and the shards' gradients must equal one process's.
    """
    if world_sizes is None:
        world_sizes = (2, 4, random.Random(seed).choice((3, 5)))
    full = _column_reference()
    for n in world_sizes:
        ranks = run_on_ranks(_column_on_rank, fn, n, what=_(
                "your column-parallel layer"))
        for r, res in enumerate(ranks):
            lo, hi = res["rows"]
            where = _("tp={n}, rank {r}").format(n=n, r=r)
            if "out" not in res:
                raise WrongAnswer(_("{where}: the output has shape {res_shape}; a "
                                    "column-parallel layer returns this rank's slice, "
                                    "(batch, h_out / tp) = ({col_batch}, "
                                    "{value}).").format(
                                      where=where, res_shape=res['shape'],
                                      col_batch=_COL_BATCH, value=hi - lo))
            if not _close(res["out"], full["out"][:, lo:hi]):
                raise WrongAnswer(
                    _("{where}: the output slice differs from one process's columns "
                      "{lo}:{hi}.").format(where=where, lo=lo, hi=hi), _(
                              "in forward a column-parallel layer needs no "
                              "communication: f is the identity there ('Two ways to "
                              "split a matmul')."))
            if res["x_grad"] is None:
                raise WrongAnswer(_("{where}: x.grad is None: the output does not "
                                    "depend on x through autograd (a detach, or "
                                    "no_grad?).").format(where=where))
            if _close(res["x_grad"], _column_reference((lo, hi))["x_grad"]) and n > 1:
                raise WrongAnswer(
                    _("{where}: x.grad holds only this rank's share of the input "
                      "gradient: the contribution of its own output columns.").format(
                        where=where),
                    _("the input is used by every rank's columns, so its gradient is "
                      "the sum over ranks. Which operator sums in backward and does "
                      "nothing in forward, and where must it sit? ('Two ways to split "
                      "a matmul')"))
            if not _close(res["x_grad"], full["x_grad"]):
                raise WrongAnswer(_("{where}: x.grad differs from one "
                                    "process's.").format(where=where),
                                  _("in backward, f sums the ranks' input gradients "
                                    "once; nothing else may touch them"))
            if not (_close(res["w_grad"], full["w_grad"][lo:hi]) and
                    _close(res["b_grad"], full["b_grad"][lo:hi])):
                raise WrongAnswer(_("{where}: the weight or bias shard's gradient "
                                    "differs from one process's rows.").format(
                                      where=where))
            # The method: f is the identity in forward and one all-reduce of the
            # input's gradient in backward (the recorder sees every spelling).
            if res["forward_ops"] and n > 1:
                raise WrongAnswer(
                    _("{where}: your forward communicates ({res_forward_ops}), and "
                      "gets the right numbers anyway: f's forward is the identity, a "
                      "column-parallel forward sends nothing.").format(
                        where=where, res_forward_ops=res['forward_ops']))
            if n > 1 and res["backward_ops"] != [("all_reduce", _COL_BATCH * _COL_IN)]:
                raise WrongAnswer(
                    _("{where}: backward issued {value} (op, elements): f all-reduces "
                      "x's gradient once, {col_batch} x {col_in} elements, and "
                      "nothing else.").format(
                        where=where, value=res['backward_ops'] or 'nothing',
                        col_batch=_COL_BATCH, col_in=_COL_IN))
    passed(_("your column-parallel layer with f equals one process on {world_sizes} "
             "ranks: output slices, input and weight gradients").format(
               world_sizes=list(world_sizes)))
