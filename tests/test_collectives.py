"""From-scratch collectives equal torch's; the cost model; the chapter's checkers."""

from __future__ import annotations

import math

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


def _compare_all(group_ranks: list[int] | None = None) -> list[str]:
    """Run every from-scratch collective against torch's; return failures as text."""
    group = dist.new_group(group_ranks) if group_ranks is not None else None
    if group_ranks is not None and dist.get_rank() not in group_ranks:
        return []
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    failures: list[str] = []

    def check(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
        try:
            # Integers exact; floats: the ring adds in another order than gloo.
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        except AssertionError as exc:
            failures.append(f"{name} n={n} rank={rank}: {exc}")

    for dtype in (torch.int64, torch.float32):
        for numel in SIZES:
            x = _inputs(rank, numel, dtype).reshape(-1, 1) if numel % 2 else \
                _inputs(rank, numel, dtype).reshape(2, -1)   # 2-D shapes too
            want = x.clone()
            dist.all_reduce(want, group=group)
            for name, fn in (("ring_all_reduce", col.ring_all_reduce),
                             ("naive_all_reduce", col.naive_all_reduce)):
                got = x.clone()
                fn(got, group=group)
                check(f"{name} {dtype} numel={numel}", got, want)
            shard = col.ring_reduce_scatter(x, group=group)
            check(f"ring_reduce_scatter {dtype} numel={numel}", shard,
                  want.flatten().tensor_split(n)[rank])
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
    col.ring_all_reduce(t, group=group)
    check("ring_all_reduce non-contiguous", t, ref)
    # reduce-scatter equals torch's when numel divides by n.
    x = _inputs(rank, 4 * n, torch.int64)
    out = torch.empty(4, dtype=torch.int64)
    dist.reduce_scatter_tensor(out, x, group=group)
    check("ring_reduce_scatter vs reduce_scatter_tensor", col.ring_reduce_scatter(
        x, group=group), out)
    return failures


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_from_scratch_collectives_equal_torch(world_size: int) -> None:
    for failures in launch.spawn(_compare_all, world_size, stream=False, timeout=120):
        assert failures == []


def test_eight_ranks() -> None:
    for failures in launch.spawn(_compare_all, 8, stream=False, timeout=180):
        assert failures == []


def test_subgroup_uses_group_ranks() -> None:
    # Ranks 1, 3 and 0 of 4 form a group in which they are 0, 1, 2.
    for failures in launch.spawn(_compare_all, 4, [1, 3, 0], stream=False, timeout=120):
        assert failures == []


def _ring_bytes(numel: int) -> tuple[int, int]:
    from dtlib.collectives.accounting import count_comms

    with count_comms(functional=False) as log:
        col.ring_all_reduce(torch.ones(numel))
    return log.total_bytes("send"), log.total_bytes("recv")


def test_ring_sends_2_n_minus_1_over_n_of_the_bytes() -> None:
    n, numel = 4, 1000
    for sent, received in launch.spawn(_ring_bytes, n, numel, stream=False):
        assert sent == received == comm_cost.bytes_sent_per_rank("all_reduce",
                                                                  4 * numel, n)


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
