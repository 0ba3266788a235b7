"""From-scratch collectives equal torch's; the cost model; the chapter's checkers."""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.distributed as dist

from dtlib import collectives as col
from dtlib.collectives import cost_model as comm_cost
from dtlib.runtime import launch
from dtlib.exercises import WrongAnswer, collectives as ex

SIZES = (1, 3, 8, 10, 17)  # includes sizes below and not divisible by world sizes


def _inputs(rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + numel)
    if dtype.is_floating_point:
        return torch.randn(numel, generator=g, dtype=dtype)
    return torch.randint(-50, 50, (numel,), generator=g, dtype=dtype)


def _forgets_own_values(t: torch.Tensor, group: object = None) -> torch.Tensor:
    """A defective all-reduce: rank 1's result lacks rank 1's own values."""
    mine = t.clone()
    dist.all_reduce(t, group=group)
    if dist.get_rank(group) == 1:
        t.sub_(mine)
    return t


def _sum_bound(x: torch.Tensor, group: object) -> torch.Tensor | None:
    """How far two sums of the group's ``x`` may differ, element by element.

    Integers add exactly: None (the check is equality). In floating point, a sum of
    n terms in any order is within (n - 1) u sum|x_i| of the exact sum (u = eps / 2,
    the unit roundoff; Higham, Accuracy and Stability, eq. 4.4), so two orders (the
    ring's and gloo's) are within (n - 1) eps sum|x_i| of each other. One rank: 0.
    """
    if not x.dtype.is_floating_point:
        return None
    n = dist.get_world_size(group)
    abs_sum = x.abs()
    dist.all_reduce(abs_sum, group=group)
    return (n - 1) * torch.finfo(x.dtype).eps * abs_sum


def _compare_all(group: dist.ProcessGroup | None = None,
                 all_reduces: dict | None = None) -> list[str]:
    """Run every from-scratch collective against torch's on ``group`` (this rank is a
    member; None: the world); return failures as text. ``all_reduces`` replaces the
    all-reduces checked (name -> function), to show that a defect is caught."""
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    failures: list[str] = []
    all_reduces = all_reduces or {"ring_all_reduce": col.ring_all_reduce,
                                  "naive_all_reduce": col.naive_all_reduce}

    def check(name: str, got: torch.Tensor, want: torch.Tensor,
              bound: torch.Tensor | None = None) -> None:
        # Copies (gathers, broadcasts) and integer sums are exact; a float sum is
        # within the bound of _sum_bound.
        if got.shape != want.shape or got.dtype != want.dtype:
            failures.append(f"{name} n={n} rank={rank}: {got.shape} {got.dtype} "
                            f"!= {want.shape} {want.dtype}")
        elif bound is None and not torch.equal(got, want):
            failures.append(f"{name} n={n} rank={rank}: {got} != {want}")
        elif bound is not None and not bool(((got - want).abs() <= bound).all()):
            worst = ((got - want).abs() - bound).max().item()
            failures.append(f"{name} n={n} rank={rank}: beyond the bound by {worst}")

    for dtype in (torch.int64, torch.float32):
        for numel in SIZES:
            x = _inputs(rank, numel, dtype).reshape(-1, 1) if numel % 2 else \
                _inputs(rank, numel, dtype).reshape(2, -1)   # 2-D shapes too
            want = x.clone()
            dist.all_reduce(want, group=group)
            bound = _sum_bound(x, group)
            for name, fn in all_reduces.items():
                got = x.clone()
                fn(got, group=group)
                check(f"{name} {dtype} numel={numel}", got, want, bound)
            shard = col.ring_reduce_scatter(x, group=group)
            check(f"ring_reduce_scatter {dtype} numel={numel}", shard,
                  want.flatten().tensor_split(n)[rank],
                  None if bound is None else bound.flatten().tensor_split(n)[rank])
            gathered = col.ring_all_gather(x, group=group)
            parts = [torch.empty_like(x) for _ in range(n)]
            dist.all_gather(parts, x, group=group)
            check(f"ring_all_gather {dtype} numel={numel}", gathered, torch.cat(parts))
            for src_g in {0, n - 1}:
                src = src_g if group is None else dist.get_global_rank(group, src_g)
                got, want_b = x.clone(), x.clone()
                col.tree_broadcast(got, src=src, group=group)
                dist.broadcast(want_b, src=src, group=group)
                check(f"tree_broadcast src={src} {dtype} numel={numel}", got, want_b)
    # A non-contiguous tensor is summed in place too.
    t = torch.arange(12.0).reshape(3, 4).t()
    ref = t.clone()
    dist.all_reduce(ref, group=group)
    bound = _sum_bound(t, group)
    col.ring_all_reduce(t, group=group)
    check("ring_all_reduce non-contiguous", t, ref, bound)
    # reduce-scatter equals torch's when numel divides by n.
    x = _inputs(rank, 4 * n, torch.int64)
    out = torch.empty(4, dtype=torch.int64)
    # torch 2.13's name, the old one (deprecated there) where it is missing
    rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    rs(out, x, group=group)
    check("ring_reduce_scatter vs reduce_scatter_single", col.ring_reduce_scatter(
        x, group=group), out)
    return failures


# The groups one launch of 8 ranks checks, one after the other: the world, groups of
# 1, 2 and 3 ranks in order, and groups whose ranks are listed out of order (rank 1, 3
# and 0 of the world are ranks 0, 1 and 2 of the group: a collective must use group
# ranks, not global ones).
GROUPS = {"world of 8": None, "1 rank": [0], "2 ranks": [1, 2], "3 ranks": [3, 4, 5],
          "4 ranks, out of order": [7, 5, 6, 4], "3 ranks, out of order": [1, 3, 0]}
RING_NUMEL = 1000


def _every_group() -> dict[str, object]:
    """Every check of this file that needs ranks, on one world of 8."""
    made = {name: dist.new_group(ranks) if ranks is not None else None
            for name, ranks in GROUPS.items()}  # every rank creates every group
    out: dict[str, object] = {}
    for name, ranks in GROUPS.items():   # the same order on every rank: no deadlock
        if ranks is None or dist.get_rank() in ranks:
            out[name] = _compare_all(made[name])
    out["ring bytes"] = _ring_bytes(RING_NUMEL)
    return out


@pytest.fixture(scope="module")
def eight_ranks() -> list[dict[str, object]]:
    """One launch of 8 ranks whose results every multi-rank test here reads."""
    return launch.spawn(_every_group, 8, stream=False, timeout=180)


@pytest.mark.parametrize("group", list(GROUPS))
def test_from_scratch_collectives_equal_torch(eight_ranks: list[dict],
                                              group: str) -> None:
    ranks = GROUPS[group] or range(8)
    seen = [r[group] for rank, r in enumerate(eight_ranks) if rank in ranks]
    assert len(seen) == len(ranks)
    for failures in seen:
        assert failures == []


def _ring_bytes(numel: int) -> tuple[int, int]:
    from dtlib.collectives.accounting import count_comms

    with count_comms() as log:
        col.ring_all_reduce(torch.ones(numel))
    return log.total_bytes("send"), log.total_bytes("recv")


def test_ring_sends_2_n_minus_1_over_n_of_the_bytes(eight_ranks: list[dict]) -> None:
    for r in eight_ranks:
        sent, received = r["ring bytes"]
        assert sent == received == comm_cost.bytes_sent_per_rank(
            "all_reduce", 4 * RING_NUMEL, 8)


def test_a_wrong_collective_is_reported() -> None:
    """The comparison fails on a defect: an all-reduce that leaves out one rank's
    own values (off by O(1), where the float bound is about 1e-6)."""
    failures = launch.spawn(_compare_all, 2, None, {"broken": _forgets_own_values},
                            stream=False)
    assert failures[0] == [], failures[0]
    assert failures[1] and all(f.startswith("broken ") for f in failures[1])
    assert len(failures[1]) == 2 * len(SIZES)   # every size, integers and floats


def test_argument_validation() -> None:
    with pytest.raises(ValueError, match="tensor=list"):
        col.ring_all_reduce([1, 2])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="world_size=0"):
        col.chunk_bounds(10, 0)
    with pytest.raises(ValueError, match="op='all_to_all'"):
        comm_cost.bus_bandwidth_factor("all_to_all", 4)
    assert col.chunk_bounds(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert col.chunk_bounds(2, 4) == [(0, 1), (1, 2), (2, 2), (2, 2)]


def test_cost_model() -> None:
    assert comm_cost.bus_bandwidth_factor("all_reduce", 4) == 1.5
    assert comm_cost.bus_bandwidth_factor("all_gather", 4) == 0.75
    assert comm_cost.bus_bandwidth_factor("broadcast", 8) == 1.0
    assert comm_cost.cost_terms("ring", "all_reduce", 4) == (6.0, 1.5, 0.75)
    assert comm_cost.cost_terms("tree", "broadcast", 5) == (3.0, 3.0, 0.0)
    t = comm_cost.collective_time("ring", "all_reduce", 1e6, 4, 1e-5, 1e-9)
    assert math.isclose(t, 6e-5 + 1.5e-3)
    # The fit recovers the alpha and beta that generated exact data.
    sizes = [2.0 ** k for k in range(10, 26, 2)]
    times = [comm_cost.collective_time("ring", "all_reduce", s, 4, 2e-5, 3e-10)
             for s in sizes]
    alpha, beta = comm_cost.fit_alpha_beta(sizes, times, "all_reduce", 4)
    assert math.isclose(alpha, 2e-5, rel_tol=1e-6) and math.isclose(beta, 3e-10,
                                                                    rel_tol=1e-6)
    cross = comm_cost.latency_bandwidth_crossover("all_reduce", 4, alpha, beta)
    assert math.isclose(6 * alpha, 1.5 * cross * beta, rel_tol=1e-9)



def _fit_records(alpha: float, beta: float, noise: float = 0.0) -> tuple[list, list]:
    """The measured and fit records bench.collectives would write for data that
    follow alpha and beta exactly (noise: every other time multiplied by 1 + noise)."""
    from dtlib.bench import collectives as bench

    records = [{"op": "all_reduce", "variant": v, "bytes": 4 * 2 ** k, "world_size": 4,
                "time_s": comm_cost.collective_time("ring", "all_reduce", 4 * 2 ** k, 4,
                                                    alpha, beta) * (1 + noise * (k % 2)),
                "busbw_GBps": 1.0}
               for v in ("torch", "ring") for k in range(8, 24)]
    return records, bench.fits(records)


def test_the_fit_paragraph_is_written_in_each_language() -> None:
    """Chapter 2 glues its fit paragraph once per language; the Chinese one is Chinese
    whether the fit is trusted or not (its reasons too), with the same numbers."""
    from dtlib.chapters.ch02_collectives import figures
    from dtlib.runtime.i18n import glue_in_each_language, speaking

    for noise, english in ((0.0, "The fit gives"), (3.0, "cannot be trusted")):
        measured, fits = _fit_records(2e-5, 3e-10, noise)
        glued: dict = {}
        glue_in_each_language(lambda k, v, display: glued.__setitem__(k, v), "x",
                              lambda: figures.fit_summary(fits, measured))
        assert set(glued) == {"x", "x__zh_CN"}
        assert english in glued["x"] and not re.search("[\u4e00-\u9fff]", glued["x"])
        zh = glued["x__zh_CN"]
        assert "拟合" in zh and english not in zh
        assert sorted(re.findall(r"\d+", glued["x"])) == sorted(re.findall(r"\d+", zh))
        if noise:  # the reason is translated, not the English one of the records
            assert fits[0]["why"].split(" ")[0] in glued["x"]
            assert "中位数" in zh
    with speaking("zh_CN"):  # the language a run had does not leak into the records
        assert "拟合" in figures.fit_summary(fits, measured)
    # A learner copy shows its own language's value, and the English where it has none.
    from dtlib.exercises import lab

    lab.GLUED.clear()
    lab.GLUED.update(glued, y="only English")
    with speaking("zh_CN"):
        assert str(lab.glued("x")) == glued["x__zh_CN"]
        assert str(lab.glued("y")) == "only English"
    with speaking("en"):
        assert str(lab.glued("x")) == glued["x"]
    lab.GLUED.clear()


GOOD_ALL_GATHER = '''
def my_all_gather(tensor, group=None):
    rank, n = dist.get_rank(), dist.get_world_size()
    k = tensor.numel()
    out = torch.empty((n * tensor.shape[0], *tensor.shape[1:]), dtype=tensor.dtype)
    flat = out.view(-1)
    flat[rank * k:(rank + 1) * k] = tensor.reshape(-1)
    for step in range(n - 1):
        s, r = (rank - step) % n, (rank - step - 1) % n
        works = [dist.isend(flat[s * k:(s + 1) * k].clone(), (rank + 1) % n),
                 dist.irecv(flat[r * k:(r + 1) * k], (rank - 1) % n)]
        for w in works:
            w.wait()
    return out
'''

WRONG_ORDER = GOOD_ALL_GATHER.replace("s, r = (rank - step) % n, (rank - step - 1) % n",
                                      "s, r = (rank - step) % n, (rank + step + 1) % n")
USES_TORCH = '''
def my_all_gather(tensor, group=None):
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, tensor)
    return torch.cat(parts)
'''


def test_all_gather_checker_accepts_right_and_rejects_wrong(capsys) -> None:
    ex.check_ring_all_gather(GOOD_ALL_GATHER, world_sizes=(1, 3, 4))
    assert "Correct" in capsys.readouterr().out
    with pytest.raises(WrongAnswer, match="expected"):
        ex.check_ring_all_gather(WRONG_ORDER, world_sizes=(3,))
    with pytest.raises(WrongAnswer, match="send/recv"):
        ex.check_ring_all_gather(USES_TORCH, world_sizes=(2,))


def test_bytes_checker_accepts_right_and_rejects_wrong(capsys) -> None:
    ex.check_bytes_sent(lambda nbytes, n: 2 * (n - 1) / n * nbytes)
    assert "Correct" in capsys.readouterr().out
    with pytest.raises(WrongAnswer, match="predicted"):
        ex.check_bytes_sent(lambda nbytes, n: 2 * nbytes)


def test_a_glued_word_reads_in_each_language_and_an_unknown_one_is_refused() -> None:
    from dtlib.runtime.i18n import WORDS, glue_word

    glued: dict = {}
    put = lambda k, v, display: glued.__setitem__(k, v)  # noqa: E731
    glue_word(put, "v", "within {d:.0e}", d=3e-7)
    assert glued == {"v": "within 3e-07", "v__zh_CN": "相差在 3e-07 以内"}
    for word in WORDS:  # every word has a Chinese of its own
        glue_word(put, "w", word, d=1.0)
        assert glued["w__zh_CN"] != glued["w"] and re.search("[\u4e00-\u9fff]",
                                                              glued["w__zh_CN"])
    with pytest.raises(ValueError, match="word="):
        glue_word(put, "x", "identical")
