"""Ranks that do not call the same collectives: a rank that finished is reported as
finished (never as failed or died), the waiting rank with its collective and line."""

from __future__ import annotations

import textwrap
import time

import pytest
import torch
import torch.distributed as dist

from dtlib.runtime import launch

SKIP = """
    import time, torch, torch.distributed as dist
    from dtlib.runtime import dist as ddist
    world = ddist.init()
    t = torch.ones(1)
    if world.rank == 0:
        dist.all_reduce(t)
    {after}
    print("done", world.rank)
"""


def _skip_and_exit() -> int:
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1))
    return dist.get_rank()


def _skip_and_sleep() -> None:
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1))
    else:
        time.sleep(600)


def _raise_on_one() -> None:
    if dist.get_rank() == 1:
        raise ValueError("rank one refuses")
    dist.barrier()


# Three ranks (two finished, one waiting); two ranks go through spawn below, where the
# report is built by the same code.
@pytest.mark.parametrize("nproc", [3])
def test_torchrun_names_finished_ranks_and_the_waiting_one(tmp_path, nproc,
                                                           no_leftovers) -> None:
    script = tmp_path / "skip.py"
    script.write_text(textwrap.dedent(SKIP.format(after="")))
    with pytest.raises(launch.CollectiveMismatch) as info:
        launch.torchrun(script, nproc=nproc, timeout=60, stream=False)
    err = info.value
    assert err.rank is None and err.finished == list(range(1, nproc))
    assert "rank 0: in all_reduce at skip.py line 7: dist.all_reduce(t)" in err.report[0]
    for r in range(1, nproc):
        assert err.report[r].startswith(f"rank {r}: finished without calling all_reduce")
    text = str(err)
    assert "failed" not in text and "died" not in text


def test_spawn_skip_and_exit_is_finished_not_dead(no_leftovers) -> None:
    with pytest.raises(launch.CollectiveMismatch) as info:
        launch.spawn(_skip_and_exit, 2, timeout=60, stream=False)
    err = info.value
    assert err.finished == [1]
    assert "rank 0: in all_reduce at test_launch_mismatch.py line" in err.report[0]
    assert err.report[0].split(": ", 2)[2].startswith("dist.all_reduce(torch.ones(1))")
    assert "rank 1: finished without calling all_reduce" in err.report[1]


def test_spawn_skip_and_sleep_times_out_naming_both_places(no_leftovers) -> None:
    with pytest.raises(launch.LaunchTimeout) as info:
        launch.spawn(_skip_and_sleep, 2, timeout=3, stream=False)
    report = info.value.report
    assert "rank 0: in all_reduce" in report[0] and "dist.all_reduce(" in report[0]
    assert "rank 1: at test_launch_mismatch.py line" in report[1]
    assert "time.sleep(600)" in report[1]
    assert "never joined" in report[1]


def test_a_raising_rank_is_the_cause_and_the_waiting_rank_is_placed(no_leftovers) -> None:
    with pytest.raises(launch.LaunchError) as info:
        launch.spawn(_raise_on_one, 2, timeout=60, stream=False)
    err = info.value
    assert not isinstance(err, launch.CollectiveMismatch)
    assert err.rank == 1 and "ValueError: rank one refuses" in str(err)
    assert "rank 1 failed" in str(err) and "rank 0 failed" not in str(err)
