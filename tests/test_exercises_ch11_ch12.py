"""Chapters 11 and 12's checkers: each rejects the kinds of wrong answer it must and
accepts the valid alternatives. The build-on-ranks checkers are tried on many answers
in one launch each (the rank-side half each checker launches, then the judging half it
applies), and end to end on one wrong and one right answer."""

from __future__ import annotations

import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist

from dtlib.exercises import WrongAnswer
from dtlib.exercises import long_sequences as ls
from dtlib.exercises import multi_dim as md
from dtlib.planner.published import TABLE4_LLAMA3
from dtlib.runtime import launch
from dtlib.runtime.dist import world

# The answers below travel to the ranks by value, as a notebook's do: the ranks then
# import only what the answers use (torch, the checkers), not this module and pytest,
# which costs each of 4 ranks a second on a loaded machine.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

# ---- chapter 11: bytes per dimension ------------------------------------------------


def _bytes_solution(n_layers, seq_len, hidden, batch, dp, local_numel):
    return {"tp": 4 * n_layers * (batch // dp) * seq_len * hidden * 4,
            "dp": 4 * local_numel}


def _bytes_page_copy(n_layers, seq_len, hidden, batch, dp, local_numel):
    # the page's own assert expression: twice the measured 8-sequence traffic, the
    # measured gradients (the values the chapter's run records for its GPT)
    return {"tp": 2 * 4 * 2 * 4 * 16 * 32 * 4, "dp": 4 * 9248}


def _bytes_whole_batch(n_layers, seq_len, hidden, batch, dp, local_numel):
    return {"tp": 4 * n_layers * batch * seq_len * hidden * 4, "dp": 4 * local_numel}


def _bytes_dp_grows(n_layers, seq_len, hidden, batch, dp, local_numel):
    return {"tp": 4 * n_layers * (batch // dp) * seq_len * hidden * 4,
            "dp": 4 * local_numel * batch // 8}


def test_predict_bytes_accepts_the_formula(capsys) -> None:
    md.check_predict_bytes(_bytes_solution)
    assert "Correct" in capsys.readouterr().out


@pytest.mark.parametrize("wrong", [_bytes_page_copy, _bytes_whole_batch,
                                   _bytes_dp_grows])
def test_predict_bytes_rejects(wrong) -> None:
    with pytest.raises(WrongAnswer):
        md.check_predict_bytes(wrong)


# ---- chapter 11: interleaving -------------------------------------------------------


def _v_solution(rows, strict=False, cap=True):
    out = {}
    for r in rows:
        m, top = r.batch_per_dp, (126 // r.pp if cap else 10 ** 4)
        bubbles = [(v, (r.pp - 1) / (v * m)) for v in range(1, top + 1)]
        ok = [v for v, b in bubbles if (b < 0.2 if strict else b <= 0.2)]
        out[(r.n_gpus, r.seq_len)] = ok[0] if ok else None
    return out


def _v_alternative(rows):
    # a closed form, ceil(5 (p - 1) / m), in integers, then the layer cap
    out = {}
    for r in rows:
        v = max(1, -(-5 * (r.pp - 1) // r.batch_per_dp))
        out[(r.n_gpus, r.seq_len)] = v if v * r.pp <= 126 else None
    return out


def _v_page_dict(rows):
    return {(8192, 8192): 3, (16384, 8192): 5, (16384, 131072): 5}


def test_smallest_v_accepts_a_loop_and_a_closed_form(capsys) -> None:
    md.check_smallest_v(_v_solution)
    md.check_smallest_v(_v_alternative)
    assert capsys.readouterr().out.count("Correct") == 2


@pytest.mark.parametrize("wrong", [_v_page_dict,
                                   lambda rows: _v_solution(rows, strict=True),
                                   lambda rows: _v_solution(rows, cap=False)],
                         ids=["page-dict", "strict-bound", "no-layer-cap"])
def test_smallest_v_rejects(wrong) -> None:
    assert _v_page_dict(TABLE4_LLAMA3) == _v_solution(TABLE4_LLAMA3)  # page rows pass
    with pytest.raises(WrongAnswer):
        md.check_smallest_v(wrong)


# ---- chapter 11: tp and dp groups on 4 ranks ----------------------------------------


def _my_groups(grid):
    # every rank creates every row's group (tp), then every column's (dp)
    rank, mine = dist.get_rank(), {}
    for name, lines in (("tp", grid.tolist()), ("dp", grid.t().tolist())):
        for line in lines:
            group = dist.new_group(line)
            if rank in line:
                mine[name] = group
    return mine["tp"], mine["dp"]


def groups_by_hand(dp, tp):
    return _my_groups(torch.arange(dp * tp).view(dp, tp))


def groups_from_mesh(dp, tp):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(world().device.type, (dp, tp), mesh_dim_names=("dp", "tp"))
    return mesh.get_group("tp"), mesh.get_group("dp")


def groups_swapped(dp, tp):  # tp groups along the columns: tp not the fastest dim
    return _my_groups(torch.arange(dp * tp).view(tp, dp).t())


def groups_world(dp, tp):
    return dist.group.WORLD, dist.group.WORLD


def groups_as_lists(dp, tp):
    rank = dist.get_rank()
    row, col = divmod(rank, tp)
    return [row * tp + j for j in range(tp)], [i * tp + col for i in range(dp)]


GROUP_ANSWERS = {"by_hand": groups_by_hand, "mesh": groups_from_mesh,
                 "swapped": groups_swapped,
                 "world": groups_world, "lists": groups_as_lists}


def _run_answers(on_rank, answers):
    return {k: on_rank(fn) for k, fn in answers.items()}


def _launch(on_rank, answers, world_size):
    """One launch for many answers: each rank runs the checker's rank-side half on
    each answer in turn (the same collectives in the same order on every rank)."""
    ranks = launch.spawn(lambda: _run_answers(on_rank, answers), world_size,
                         stream=False, timeout=120)
    return {k: [r[k] for r in ranks] for k in answers}


@pytest.fixture(scope="module")
def group_runs():
    return _launch(md.grid_groups_on_rank, GROUP_ANSWERS, md.GRID_WORLD)


@pytest.mark.parametrize("name", ["by_hand", "mesh"])
def test_grid_groups_accepts(group_runs, name) -> None:
    md.judge_grid_groups(group_runs[name])


@pytest.mark.parametrize("name", ["swapped", "world", "lists"])
def test_grid_groups_rejects(group_runs, name) -> None:
    with pytest.raises(WrongAnswer):
        md.judge_grid_groups(group_runs[name])


def test_grid_groups_checker_end_to_end(capsys) -> None:
    with pytest.raises(WrongAnswer, match="tp group holds ranks"):
        md.check_grid_groups(groups_swapped)
    md.check_grid_groups(groups_by_hand)
    assert "Correct" in capsys.readouterr().out


def groups_for_four_ranks_only(dp, tp):
    """The page's two grids written out: right wherever the checker used to look."""
    rows, cols = {(2, 2): ([[0, 1], [2, 3]], [[0, 2], [1, 3]]),
                  (1, 4): ([[0, 1, 2, 3]], [[0], [1], [2], [3]])}[(dp, tp)]
    rank, mine = dist.get_rank(), {}
    for name, lines in (("tp", rows), ("dp", cols)):
        for line in lines:
            group = dist.new_group(line)
            if rank in line:
                mine[name] = group
    return mine["tp"], mine["dp"]


def test_grid_groups_tries_a_grid_of_six_ranks() -> None:
    with pytest.raises(WrongAnswer, match="on 6 ranks"):
        md.check_grid_groups(groups_for_four_ranks_only)


# ---- chapter 12: one attention step over a split sequence, on 2 ranks ---------------


def _merge(o, lse, o_b, lse_b):
    new = torch.logaddexp(lse, lse_b)
    return o * torch.exp(lse - new) + o_b * torch.exp(lse_b - new), new


def _block(q, k, v):
    s = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    lse = torch.logsumexp(s, dim=-1, keepdim=True)
    return torch.exp(s - lse) @ v, lse


def attend_ring(q, k, v, work_dtype=None):
    rank, n = dist.get_rank(), dist.get_world_size()
    if work_dtype is not None:
        q, k, v = q.to(work_dtype), k.to(work_dtype), v.to(work_dtype)
    kv = torch.stack([k, v])
    o, lse = _block(q, k, v)
    for _ in range(n - 1):
        nxt = torch.empty_like(kv)
        reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, kv, (rank + 1) % n),
                                       dist.P2POp(dist.irecv, nxt, (rank - 1) % n)])
        for req in reqs:
            req.wait()
        kv = nxt
        o, lse = _merge(o, lse, *_block(q, kv[0], kv[1]))
    return o


def attend_allgather(q, k, v):  # torch's default rotate method, as Llama 3 trained
    n = dist.get_world_size()
    ks, vs = [torch.empty_like(k) for _ in range(n)], [torch.empty_like(v) for _ in
                                                       range(n)]
    dist.all_gather(ks, k)
    dist.all_gather(vs, v)
    return _block(q, torch.cat(ks, dim=2), torch.cat(vs, dim=2))[0]


def attend_local(q, k, v):
    return _block(q, k, v)[0]


def attend_average(q, k, v):  # every block, merged by a plain mean
    n = dist.get_world_size()
    ks, vs = [torch.empty_like(k) for _ in range(n)], [torch.empty_like(v) for _ in
                                                       range(n)]
    dist.all_gather(ks, k)
    dist.all_gather(vs, v)
    return sum(_block(q, a, b)[0] for a, b in zip(ks, vs)) / n


def attend_unscaled(q, k, v):
    return attend_allgather(q * q.shape[-1] ** 0.5, k, v)


def attend_float32(q, k, v):
    return attend_ring(q, k, v, work_dtype=torch.float32).to(q.dtype)


ATTEND_ANSWERS = {"ring": attend_ring, "allgather": attend_allgather,
                  "local": attend_local, "average": attend_average,
                  "unscaled": attend_unscaled, "float32": attend_float32}


@pytest.fixture(scope="module")
def attend_runs():
    return _launch(ls.ring_step_on_rank, ATTEND_ANSWERS, ls.RING_WORLD)


@pytest.mark.parametrize("name", ["ring", "allgather"])
def test_ring_step_accepts(attend_runs, name) -> None:
    ls.judge_ring_step(attend_runs[name])


@pytest.mark.parametrize("name, message", [
    ("local", "differs from full attention"), ("average", "differs from full"),
    ("unscaled", "differs from full"), ("float32", "float32 precision")])
def test_ring_step_rejects(attend_runs, name, message) -> None:
    with pytest.raises(WrongAnswer, match=message):
        ls.judge_ring_step(attend_runs[name])


def test_ring_step_checker_end_to_end(capsys) -> None:
    with pytest.raises(WrongAnswer, match="differs from full attention"):
        ls.check_ring_step(attend_local)
    ls.check_ring_step(attend_allgather)
    assert "Correct" in capsys.readouterr().out


# ---- chapter 12: bytes of ring and Ulysses ------------------------------------------


def _volume(b, s, h, cp, hops=None, keep=True):
    local = b * (s // cp) * h
    ring = 2 * local * (cp - 1 if hops is None else hops)
    ulysses = 4 * local * (cp - 1) // cp if keep else 4 * local
    return {"ring": 4 * ring, "ulysses": 4 * ulysses}


def test_cp_volume_accepts_the_formula(capsys) -> None:
    ls.check_cp_volume(_volume)
    assert "Correct" in capsys.readouterr().out


@pytest.mark.parametrize("wrong", [
    lambda b, s, h, cp: _volume(b, s, h, cp, hops=cp),  # one hop too many
    lambda b, s, h, cp: _volume(b, s, h, cp, keep=False),  # sends what it keeps
    lambda b, s, h, cp: {k: v // 4 for k, v in _volume(b, s, h, cp).items()},
], ids=["cp-hops", "ulysses-keeps-nothing", "elements-not-bytes"])
def test_cp_volume_rejects(wrong) -> None:
    with pytest.raises(WrongAnswer):
        ls.check_cp_volume(wrong)
