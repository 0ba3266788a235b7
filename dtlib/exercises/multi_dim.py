"""Checkers for Chapter 11, "Parallelism in several dimensions".

Each checker computes its expectation itself, from the chapter's formulas, on inputs
beyond the ones the page shows: an answer that copies the page's measured numbers, or
the dict the book's run prints, fails on the others.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from dtlib.exercises import WrongAnswer, check_close, checker, passed, run_on_ranks
from dtlib.planner.published import TABLE4_LLAMA3, Llama3Row
from dtlib.runtime.dist import world
from dtlib.runtime.i18n import N_, _

_FP32 = 4  # bytes per element: the chapter's runs are float32


@checker
def check_predict_bytes(predict: Callable[..., dict[str, Any]],
                        cases: tuple[tuple[int, int, int, int, int, int], ...] = (
                            (2, 16, 32, 16, 2, 9248), (4, 128, 256, 32, 4, 123456),
                            (1, 8, 16, 6, 3, 77), (12, 2048, 768, 64, 8, 10 ** 7)),
                        seed: int | None = None) -> None:
    """Check ``predict(n_layers, seq_len, hidden, batch, dp, local_numel)`` ->
    ``{"tp": ..., "dp": ...}``: the bytes one rank of *our* tensor-inside-data
    parallel layout all-reduces in one training step on its tp line and on its dp
    line (fp32; ``batch`` is the global batch, ``local_numel`` the parameters this
    rank holds).

    The truth is the chapter's formula, which its cell asserts equal to the recorded
    collectives: tp, the g and f all-reduces of every block, forward and backward, of
    this replica's ``batch / dp`` rows; dp, every local gradient once.

    Args:
        predict: the learner's function.
        cases: ``(n_layers, seq_len, hidden, batch, dp, local_numel)`` to try.
        seed: draws three more (1 to 8 replicas, odd ones included).
    Returns:
        None (prints "Correct" or raises :class:`WrongAnswer`).

    Taught in: Chapter 11, "What crosses each dimension".
    """
    rng = random.Random(seed)
    drawn = []
    for _draw in range(3):
        dp = rng.randint(1, 8)
        drawn.append((rng.randint(1, 48), rng.randint(1, 4096), rng.randint(1, 4096),
                      dp * rng.randint(1, 16), dp, rng.randint(1, 10 ** 9)))
    for n_layers, s, h, batch, dp, numel in (*cases, *drawn):
        got = predict(n_layers, s, h, batch, dp, numel)
        if not isinstance(got, Mapping):
            raise WrongAnswer(_("predict must return a dict, got {type}").format(
                                  type=type(got).__name__))
        where = (_("n_layers={n_layers}, seq_len={s}, hidden={h}, batch={batch}, "
                   "dp={dp}, local_numel={numel}").format(
                     n_layers=n_layers, s=s, h=h, batch=batch, dp=dp, numel=numel))
        check_close(f"{where}: tp", got.get("tp"),
                    4 * n_layers * (batch // dp) * s * h * _FP32, hint=(
                        _("per block, g and f all-reduce one activation each in "
                          "forward and again in backward; the activation holds this "
                          "replica's rows only, not the whole batch")))
        check_close(f"{where}: dp", got.get("dp"), numel * _FP32, hint=(
            _("data parallelism all-reduces each gradient this rank holds once per "
              "step: how does that depend on the batch?")))
    passed(_("your formulas hold on {n_cases} shapes: tp traffic grows with the rows "
             "each replica runs, dp traffic only with the parameters").format(
               n_cases=len(cases)))


def _synthetic(n_gpus: int, pp: int, dp: int, seq_len: int, m: int) -> Llama3Row:
    # A row shaped like Table 4's, for the checker only (tp 8, cp 1; the numbers
    # the exercise does not use are zero).
    return Llama3Row(n_gpus, 8, 1, pp, dp, seq_len, m, 0, 0, 0)


# Rows beyond the page's: a bound met with equality (p = 5, m = 4, v = 5 gives
# exactly 20 %), rows where the layer cap v * p <= 126 leaves no v, and a row that
# needs no interleaving. Around the cap (p = 42: v <= 3): one whose answer is the cap
# itself (m = 70 needs v = 3), one that needs one chunk more than the cap allows
# (m = 60 needs v = 4), and one with more stages than layers (p = 127: no v at all).
_EXTRA_ROWS = (_synthetic(160, 5, 4, 4096, 4), _synthetic(4032, 63, 8, 8192, 2),
               _synthetic(2688, 42, 8, 2048, 3), _synthetic(512, 2, 32, 2048, 64),
               _synthetic(1024, 8, 16, 4096, 4), _synthetic(5376, 42, 16, 4096, 70),
               _synthetic(2688, 42, 8, 8192, 60), _synthetic(16256, 127, 16, 4096, 700))
_LAYERS = 126  # Llama 3 405B: a stage holds at least one of its 126 layers


def _smallest_v(row: Llama3Row) -> int | None:
    # exact arithmetic: (p - 1) / (v m) <= 1/5  <=>  5 (p - 1) <= v m
    return next((v for v in range(1, _LAYERS // row.pp + 1)
                 if 5 * (row.pp - 1) <= v * row.batch_per_dp), None)


#: What ``check_smallest_v`` switches off while the learner's function runs.
_SMALLEST_V_FORBIDS = {
    'dtlib.exercises.multi_dim:_smallest_v': N_("the checker's truth"),
}


@checker(forbids=_SMALLEST_V_FORBIDS)
def check_smallest_v(smallest_v: Callable[[Sequence[Llama3Row]], dict[Any, Any]],
                     rows: Sequence[Llama3Row] = TABLE4_LLAMA3 + _EXTRA_ROWS,
                     seed: int | None = None) -> None:
    """Check ``smallest_v(rows)`` -> ``{(n_gpus, seq_len): v or None}``: per row, the
    smallest number of model chunks per GPU with an interleaved bubble
    ``(p - 1) / (v * m)`` of at most 20 %, where ``m`` is the row's sequences per
    replica and ``v * p <= 126``; None where no ``v`` works.

    Args:
        smallest_v: the learner's function.
        rows: the rows to try (Table 4's and others).
        seed: draws four more rows (1 to 130 stages, 1 to 200 micro-batches).
    Returns:
        None (prints "Correct" or raises :class:`WrongAnswer`).

    Taught in: Chapter 11, "The planner against Llama 3".
    """
    rng = random.Random(seed)
    drawn = []
    for i in range(4):
        pp, dp = rng.randint(1, 130), rng.randint(1, 32)
        drawn.append(_synthetic(8 * pp * dp, pp, dp, 1000 + i, rng.randint(1, 200)))
    for part in (tuple(TABLE4_LLAMA3), (*rows, *drawn)):
        got = smallest_v(part)
        if not isinstance(got, Mapping):
            raise WrongAnswer(_("smallest_v must return a dict, got {type}").format(
                                  type=type(got).__name__))
        for row in part:
            key, want = (row.n_gpus, row.seq_len), _smallest_v(row)
            where = f"{key} (p={row.pp}, m={row.batch_per_dp})"
            if key not in got:
                raise WrongAnswer(_("no entry for {where}: key the dict by (n_gpus, "
                                    "seq_len)").format(where=where))
            v = got[key]
            if want is None and v is not None:
                raise WrongAnswer(
                    _("{where}: you return v={v!r}, but no v meets both "
                      "conditions.").format(where=where, v=v),
                    _("a stage holds at least one layer: v * p may not exceed 126"))
            if want is not None and v != want:
                raise WrongAnswer(
                    _("{where}: v={v!r} is not the smallest v that meets both "
                      "conditions.").format(where=where, v=v), _(
                              "'at most 20 %' includes 20 % itself; try each v from 1 "
                              "up and stop at the first that works"))
    passed(_("the interleaving each of {n_rows} configurations needs").format(
               n_rows=len(rows)))


# ---- build it: the tp and dp groups of a rank grid, on real ranks -------------------

GRID_WORLD = 4
_GRIDS = ((2, 2), (1, 4))  # (dp, tp): the page's grid, and one tp group of all ranks
_DRAWN_GRIDS = ((2, 3), (3, 2), (1, 6), (6, 1))  # one of them, on 6 ranks


def _members(group: Any) -> list[int] | str:
    if not isinstance(group, dist.ProcessGroup):
        return _("a {type}, not a ProcessGroup").format(type=type(group).__name__)
    return sorted(dist.get_process_group_ranks(group))


def grid_groups_on_rank(build: Callable[[int, int], Any],
                        grids: tuple[tuple[int, int], ...] = _GRIDS
                        ) -> list[dict[str, Any]]:
    """On one rank: call ``build(dp, tp)`` for each of ``grids`` (every rank, the
    same order), record the members of the two groups it returns, and the sum an
    all-reduce of ``rank + 1`` gives over each.

    Args:
        build: the learner's function, returning ``(tp_group, dp_group)``.
        grids: ``(dp, tp)`` pairs whose product is the world size.
    Returns:
        One record per grid: ``dp_size``, ``tp_size``, ``rank`` and, per group
        (``tp``, ``dp``), its members (or what it is instead of a group) and the
        all-reduced sum (``tp_sum``, ``dp_sum``).

    Taught in: Chapter 11, "A rank grid by hand" (its exercise).
    """
    rank, out = dist.get_rank(), []
    for dp, tp in grids:
        got = build(dp, tp)
        rec: dict[str, Any] = {"dp_size": dp, "tp_size": tp, "rank": rank}
        if not (isinstance(got, tuple) and len(got) == 2):
            rec["error"] = _("returned {type}, not (tp_group, dp_group)").format(
                type=type(got).__name__)
            out.append(rec)
            continue
        for name, group in zip(("tp", "dp"), got):
            rec[name] = _members(group)
        for name, group in zip(("tp", "dp"), got):  # same order on every rank
            if isinstance(rec[name], list) and rank in rec[name]:
                x = torch.tensor([float(rank + 1)], device=world().device)
                dist.all_reduce(x, group=group)
                rec[f"{name}_sum"] = x.item()
        out.append(rec)
    return out


def judge_grid_groups(ranks: list[list[dict[str, Any]]]) -> None:
    """Raise :class:`WrongAnswer` unless every rank's groups are its row (tp) and
    column (dp) of ``torch.arange(world).view(dp, tp)`` and the all-reduces over them
    give those ranks' sums.

    Args:
        ranks: each rank's :func:`grid_groups_on_rank` records.
    Returns:
        None.

    Taught in: Chapter 11, "A rank grid by hand" (its exercise).
    """
    for records in ranks:
        for rec in records:
            dp, tp, rank = rec["dp_size"], rec["tp_size"], rec["rank"]
            where = _("dp={dp}, tp={tp}, rank {rank}").format(dp=dp, tp=tp, rank=rank)
            if "error" in rec:
                raise WrongAnswer(f"{where}: {rec['error']}.")
            grid = torch.arange(dp * tp).view(dp, tp)
            row, col = divmod(rank, tp)
            want = {"tp": grid[row].tolist(), "dp": grid[:, col].tolist()}
            for name in ("tp", "dp"):
                got = rec[name]
                if isinstance(got, str):
                    raise WrongAnswer(_("{where}: the {name} group is {got}.").format(
                                          where=where, name=name, got=got),
                                      _("dist.new_group(ranks) returns a group"))
                if got != want[name]:
                    raise WrongAnswer(
                        _("{where}: the {name} group holds ranks {got}.").format(
                            where=where, name=name, got=got),
                        _("lay the ranks out as arange(world).view(dp, tp): a tp "
                          "group is a row (the last dimension varies fastest), a dp "
                          "group a column ('A rank grid by hand')"))
                total = sum(r + 1 for r in want[name])
                if rec.get(f"{name}_sum") != total:
                    raise WrongAnswer(
                        _("{where}: an all-reduce of rank + 1 over the {name} group "
                          "gave {get!r}, not the sum over its ranks.").format(
                            where=where, name=name, get=rec.get(f'{name}_sum')),
                        _("create every line's group on every rank, in the same "
                          "order, and keep the ones this rank belongs to"))


#: What ``check_grid_groups`` switches off while the learner's function runs.
_GRID_GROUPS_FORBIDS = {
    'torch.distributed.device_mesh:init_device_mesh':
        N_("torch builds the grid for you"),
    'torch.distributed.device_mesh:DeviceMesh.__init__':
        N_("torch builds the grid for you"),
    'dtlib.parallel_nd.grid:build_grid_groups': N_("the book's own grid"),
    'dtlib.parallel_nd.dims:ParallelDims.grid': N_("the book's own grid"),
    'dtlib.parallel_nd.dims:ParallelDims.mesh': N_("the book's own mesh"),
}


@checker(forbids=_GRID_GROUPS_FORBIDS)
def check_grid_groups(build: Callable[[int, int], Any],
                      seed: int | None = None) -> None:
    """Check ``build(dp, tp) -> (tp_group, dp_group)`` on real ranks: the process
    groups of this rank's row and column of the ``(dp, tp)`` rank grid, for the grids
    2 x 2 and 1 x 4 on 4 ranks (created in that order on every rank), then for one
    grid of 6 ranks drawn from ``seed`` (2 x 3, 3 x 2, 1 x 6, 6 x 1: odd lines).

    Args:
        build: the learner's function, with ``dist.new_group``; a ``DeviceMesh``
            (``init_device_mesh``) is switched off: building the grid is the exercise.
    Returns:
        None (prints "Correct" or raises :class:`WrongAnswer`).

    Taught in: Chapter 11, "A rank grid by hand".
    """
    drawn = random.Random(seed).choice(_DRAWN_GRIDS)
    for world_size, grids in ((GRID_WORLD, _GRIDS), (6, (drawn,))):
        ranks = run_on_ranks(grid_groups_on_rank, build, world_size, grids,
                             what=_("your build_groups"))
        judge_grid_groups(ranks)
    passed(_("on {grid_world} and 6 ranks your groups are the rows (tp) and columns "
             "(dp) of each of {value} grids, and all-reduce over exactly "
             "those ranks").format(grid_world=GRID_WORLD, value=len(_GRIDS) + 1))
