"""Checkers for Chapter 12, "Long sequences"."""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any, Callable

import torch
import torch.distributed as dist

from dtlib.context_parallel.volume import cp_volume
from dtlib.exercises import WrongAnswer, check_close, checker, passed, run_on_ranks
from dtlib.runtime.dist import world
from dtlib.runtime.i18n import N_, _


#: What ``check_cp_volume`` switches off while the learner's function runs.
_CP_VOLUME_FORBIDS = {
    'dtlib.context_parallel.volume:cp_volume': N_("the checker's truth"),
}


@checker(forbids=_CP_VOLUME_FORBIDS)
def check_cp_volume(predict: Callable[[int, int, int, int], dict[str, Any]],
                    cases: tuple[tuple[int, int, int, int], ...] = (
                        (1, 16, 32, 2), (2, 4096, 1024, 4), (1, 131072, 8192, 16)),
                    seed: int | None = None) -> None:
    """Check ``predict(b, s, h, cp)`` -> ``{"ring", "ulysses"}``: bytes one rank sends
    in the *forward* pass of one attention layer (fp32, as many K/V heads as query
    heads), ring attention vs DeepSpeed-Ulysses. The truth is
    :func:`dtlib.context_parallel.cp_volume`, checked against real ranks in the tests.

    Args:
        predict: the learner's function.
        cases: ``(b, s, h, cp)`` to try, the page's shapes and others.
        seed: draws three more (1 to 8 ranks, odd ones included).
    Returns:
        None (prints "Correct" or raises :class:`WrongAnswer`).

    Taught in: Chapter 12, "Ring or all-to-all?".
    """
    rng = random.Random(seed)
    drawn = []
    for _draw in range(3):
        cp = rng.randint(1, 8)
        drawn.append((rng.randint(1, 8), 2 * cp * rng.randint(1, 256),
                      cp * rng.randint(1, 256), cp))
    for b, s, h, cp in (*cases, *drawn):
        got = predict(b, s, h, cp)
        if not isinstance(got, Mapping):
            raise WrongAnswer(_("predict must return a dict, got {type}").format(
                                  type=type(got).__name__))
        truth = cp_volume(b, s, h, cp, n_heads=cp)
        where = f"b={b}, s={s}, h={h}, cp={cp}"
        check_close(f"{where}: ring", got.get("ring"), truth.ring_forward, hint=(
            _("a rank passes on K and V (each b x s/cp x h) once per hop, and a block "
              "needs cp - 1 hops to visit every other rank")))
        check_close(f"{where}: ulysses", got.get("ulysses"), truth.ulysses_forward,
                    hint=(_("four all-to-alls (q, k, v in; the output back), each of "
                            "a b x s/cp x h tensor of which a rank keeps 1/cp")))
    passed(_("ring attention sends 2(cp-1) b (s/cp) h values per layer, Ulysses 4 b "
             "(s/cp) h (cp-1)/cp: at a fixed sequence the ring's volume rises toward "
             "2bsh while Ulysses' falls as 1/cp"))


# ---- build it: attention over a sequence split across ranks, on real ranks ----------

#: Three ranks: a ring of two is also a swap (rank ^ 1 is its neighbour both ways),
#: and there a block passed once too often comes home, which softmax cannot see.
RING_WORLD = 3
# (batch, heads, full sequence, head dim): the first splits 12 tokens into 3 x 4, the
# second has an odd head count and 6 tokens per rank. q is scaled up so that softmax
# is peaked and the pieces' log-sum-exps differ: a plain average of per-block
# outputs is then far from the truth.
_RING_SHAPES = ((2, 2, 12, 4), (1, 3, 18, 8))
_Q_SCALE = 3.0


def _full_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    scores = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    return torch.softmax(scores, dim=-1) @ v


def ring_step_on_rank(attend: Callable[..., torch.Tensor], content_seed: int = 0
                      ) -> list[dict[str, Any]]:
    """On one rank: full float64 q, k, v from ``content_seed`` (drawn per check and
    never shown to ``attend``: the other ranks' blocks cannot be rebuilt, only
    received), this rank's contiguous
    piece of the sequence passed to ``attend(q, k, v)``, and the rows of full
    (non-causal) attention it must return.

    Args:
        attend: the learner's function.
    Returns:
        Per shape of ``_RING_SHAPES``: ``got`` (what ``attend`` returned, or a
        description of it), ``want`` (this rank's rows of full attention).

    Taught in: Chapter 12, "Context parallelism: ring attention" (its exercise).
    """
    rank, n, device = dist.get_rank(), dist.get_world_size(), world().device
    out = []
    for i, (b, a, s, d) in enumerate(_RING_SHAPES):
        gen = torch.Generator().manual_seed(content_seed + 100 + i)
        q, k, v = (torch.randn(b, a, s, d, generator=gen, dtype=torch.float64)
                   for _ in range(3))
        q = q * _Q_SCALE
        want = _full_attention(q, k, v).chunk(n, dim=2)[rank]
        local = [t.chunk(n, dim=2)[rank].contiguous().to(device) for t in (q, k, v)]
        got = attend(*local)
        if isinstance(got, torch.Tensor):
            got = got.detach().cpu()
        else:
            got = f"a {type(got).__name__}"
        out.append({"shape": (b, a, s, d), "got": got, "want": want})
    return out


# In float64 each output element is a softmax-weighted sum over the s keys, reached
# through a max, an exp, a sum and a division, or (ring) through one log-sum-exp merge
# per block: a few roundings per term, each ~2**-53 of the largest term. 16 * s *
# 2**-53 relative to the largest output element covers that with room; a float32
# detour (2**-24) is 1e8 times larger, a missing block or a wrong merge of order 1.
def _ring_bound(want: torch.Tensor) -> float:
    return 16 * want.shape[2] * 2 ** -53 * want.abs().max().item()


def judge_ring_step(ranks: list[list[dict[str, Any]]]) -> None:
    """Raise :class:`WrongAnswer` unless every rank returned its rows of full
    attention, in the inputs' dtype and to float64 rounding.

    Args:
        ranks: each rank's :func:`ring_step_on_rank` records.
    Returns:
        None.

    Taught in: Chapter 12, "Context parallelism: ring attention" (its exercise).
    """
    for r, records in enumerate(ranks):
        for rec in records:
            got, want = rec["got"], rec["want"]
            where = f"rank {r}, (b, a, s, d) = {rec['shape']}"
            if isinstance(got, str):
                raise WrongAnswer(_("{where}: attend returned {got}, not a "
                                    "tensor.").format(where=where, got=got))
            if got.shape != want.shape:
                raise WrongAnswer(_("{where}: the output has shape {shape}; return "
                                    "this rank's query rows, the shape of "
                                    "its q.").format(
                                      where=where, shape=tuple(got.shape)))
            if got.dtype != want.dtype:
                raise WrongAnswer(_("{where}: the output is {dtype}, the inputs "
                                    "{dtype2}: keep the inputs' dtype.").format(
                                      where=where, dtype=got.dtype,
                                      dtype2=want.dtype))
            err = (got - want).abs().max().item()
            if err <= _ring_bound(want):
                continue
            if err <= 1e-5 * want.abs().max().item():
                raise WrongAnswer(
                    _("{where}: close to full attention, but only to about float32 "
                      "precision, on float64 inputs.").format(where=where), _(
                              "some buffer or intermediate is float32: allocate with "
                              "the inputs' dtype (or "
                              "torch.promote_types(torch.float32, q.dtype))"))
            raise WrongAnswer(
                _("{where}: differs from full attention over the whole "
                  "sequence.").format(where=where),
                _("every query attends to every key, this rank's and the other "
                  "ranks': bring the other K/V blocks here (a ring of send/recv, or "
                  "an all-gather), scale the scores by 1/sqrt(d), and merge the "
                  "blocks' results with their log-sum-exps, not by averaging"))


#: What ``check_ring_step`` switches off while the learner's function runs.
_RING_STEP_FORBIDS = {
    'dtlib.exercises.long_sequences:_full_attention': N_("the checker's truth"),
    'dtlib.context_parallel.ring_attention:ring_attention':
        N_("the book's own ring attention"),
    'dtlib.context_parallel.ring_attention:RingAttention.forward':
        N_("the book's own ring attention"),
    'dtlib.context_parallel.ring_attention:ring_exchange':
        N_("the book's own ring step"),
    'dtlib.context_parallel.ulysses:ulysses_attention': N_("the book's own Ulysses"),
}


@checker(forbids=_RING_STEP_FORBIDS)
def check_ring_step(attend: Callable[..., torch.Tensor],
                    seed: int | None = None) -> None:
    """Check ``attend(q, k, v) -> out`` on 3 real ranks: each rank holds a contiguous
    piece of the sequence, ``(b, a, s / cp, d)`` for each of q, k and v (float64), and
    returns its rows of full non-causal softmax attention over the whole sequence.

    Args:
        attend: the learner's function; a ring of point-to-point sends with an
            online softmax, or an all-gather of K and V, both pass.
        seed: draws q, k and v's values (default: fresh each call).
    Returns:
        None (prints "Correct" or raises :class:`WrongAnswer`).

    Taught in: Chapter 12, "Context parallelism: ring attention".
    """
    content_seed = random.Random(seed).randrange(2 ** 31)  # q, k and v's values
    ranks = run_on_ranks(ring_step_on_rank, attend, RING_WORLD, content_seed,
                         what=_("your attend"))
    judge_ring_step(ranks)
    passed(_("on {ring_world} ranks, for {n__ring_shapes} shapes, each rank's rows "
             "equal full attention over the whole sequence").format(
               ring_world=RING_WORLD, n__ring_shapes=len(_RING_SHAPES)))
