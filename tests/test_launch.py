"""The launch layer: spawn returns per-rank values, failures name their rank, hangs end."""

from __future__ import annotations

import textwrap
import threading
import time

import pytest
import torch
import torch.distributed as dist

from dtlib.runtime import dist as ddist, launch, supervise


def _rank_and_sum() -> tuple[int, int, float, str]:
    world = ddist.world()
    t = torch.tensor([float(world.rank + 1)])
    dist.all_reduce(t)
    return world.rank, world.world_size, t.item(), world.backend


def _raise_on_rank_one() -> None:
    if dist.get_rank() == 1:
        raise ValueError("rank one refuses")
    dist.barrier()


def _deadlock() -> None:
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1))  # the others never call it
    else:
        time.sleep(600)


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_spawn_returns_each_ranks_value(world_size: int) -> None:
    values = launch.spawn(_rank_and_sum, world_size, stream=False)
    expected_sum = world_size * (world_size + 1) / 2
    assert values == [(r, world_size, expected_sum, "gloo") for r in range(world_size)]


def test_spawn_names_the_failing_rank_and_its_exception() -> None:
    with pytest.raises(launch.LaunchError) as info:
        launch.spawn(_raise_on_rank_one, 3, stream=False)
    assert info.value.rank == 1
    assert "rank 1 failed" in str(info.value)
    assert "ValueError: rank one refuses" in str(info.value)


def test_spawn_deadlock_reports_each_rank(no_leftovers: None) -> None:
    start = time.monotonic()
    with pytest.raises(launch.LaunchTimeout) as info:
        launch.spawn(_deadlock, 2, timeout=3, stream=False)
    assert time.monotonic() - start < 15
    report = info.value.report
    assert "rank 0: in all_reduce" in report[0] and "test_launch.py line" in report[0]
    assert "never joined" in report[1] and "time.sleep(600)" in report[1]


def test_the_hang_report_speaks_the_learners_language(no_leftovers: None,
                                                       monkeypatch) -> None:
    # A Chinese learner copy sets DTLIB_LANG=zh_CN (dtlib.runtime.i18n.use): the report
    # is the same facts in Chinese, the code and the names as they are.
    monkeypatch.setenv("DTLIB_LANG", "zh_CN")
    with pytest.raises(launch.LaunchTimeout) as info:
        launch.spawn(_deadlock, 2, timeout=3, stream=False)
    text = str(info.value)
    report = info.value.report
    assert "各 rank 当时所在的位置" in text and "集合通信不匹配" in text, text
    assert "rank 0：在 all_reduce 中" in report[0] and "test_launch.py 第" in report[0]
    assert "从未与其他 rank 会合" in report[1] and "time.sleep(600)" in report[1]
    assert "Where each rank was" not in text


def test_spawn_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="nproc=0"):
        launch.spawn(_rank_and_sum, 0)
    with pytest.raises(ValueError, match="timeout"):
        launch.spawn(_rank_and_sum, 2, timeout=-1)
    with pytest.raises(ValueError, match="not callable"):
        launch.spawn(42, 2)
    lock = threading.Lock()
    with pytest.raises(ValueError, match="cannot be sent to the ranks"):
        launch.spawn(lambda: lock.locked(), 2)


def test_spawn_sends_a_closure_by_value() -> None:
    offset = 100
    assert launch.spawn(lambda k: dist.get_rank() * k + offset, 2, 10) == [100, 110]


def _script(tmp_path, body: str) -> str:
    path = tmp_path / "script.py"
    path.write_text(textwrap.dedent(body))
    return str(path)


HELLO = """
    import torch, torch.distributed as dist
    from dtlib.runtime import dist as ddist
    world = ddist.init()
    t = torch.tensor([world.rank + 1.0], device=world.device)
    dist.all_reduce(t)
    print("backend", world.backend)
    print("partial", end="")     # text and newline arrive as separate writes
    print(f" line of rank {world.rank}: sum={t.item():.0f}")
"""


def test_torchrun_streams_whole_prefixed_lines(tmp_path, capsys) -> None:
    """Also the backend agreement through torchrun's env:// rendezvous and store
    (test_backend checks it for spawned worlds; the code is the same at any size)."""
    result = launch.torchrun(_script(tmp_path, HELLO), nproc=2, timeout=90)
    assert result.returncode == 0
    out = capsys.readouterr().out
    for r in range(2):
        assert f"[rank {r}] partial line of rank {r}: sum=3" in out.splitlines()
        assert result.outputs[r].splitlines()[-1] == f"partial line of rank {r}: sum=3"
        assert result.outputs[r].splitlines()[-2] == "backend gloo"


DEADLOCK = """
    import time, torch, torch.distributed as dist
    from dtlib.runtime import dist as ddist
    time.sleep(3)  # a slow start-up: the timeout must not count it
    world = ddist.init()
    t = torch.ones(1)
    if world.rank == 0:
        dist.all_reduce(t)
    else:
        time.sleep(600)
"""


# Three ranks (two waiting elsewhere): the report's per-rank lines are the same code for
# any count, and a two-rank hang is already reported through spawn above.
@pytest.mark.parametrize("nproc", [3])
def test_torchrun_deadlock_is_stopped_and_reported(tmp_path, nproc, no_leftovers) -> None:
    script = _script(tmp_path, DEADLOCK)
    start = time.monotonic()
    with pytest.raises(launch.LaunchTimeout) as info:
        # The 4 s count from the moment the last rank joined, so the import of torch
        # (up to 15 s for several ranks on a loaded two-core machine) and the 3 s sleep
        # before joining never eat into them.
        launch.torchrun(script, nproc=nproc, timeout=4, stream=False)
    elapsed = time.monotonic() - start
    assert 3 + 4 < elapsed < supervise.STARTUP_S + 4 + 15, elapsed
    assert "4 s after every rank had joined the world" in str(info.value)
    report = info.value.report
    assert report[0].startswith("rank 0: in all_reduce at script.py line 8")
    for r in range(1, nproc):
        assert report[r].startswith(f"rank {r}: at script.py line 10: time.sleep(600)")
    assert "collective mismatch" in str(info.value)


def test_spawn_script_runs_the_script_in_torchruns_environment(tmp_path, capsys,
                                                               no_leftovers) -> None:
    """The script torchrun runs above, on ranks forked from the warm server: the same
    lines and values; a hang is reported at the script's own lines (as torchrun's
    report below), counted from the moment every rank joined (not the 3 s sleep)."""
    result = launch.spawn_script(_script(tmp_path, HELLO + "    result = world.rank\n"),
                                 nproc=2, timeout=60)
    assert result.values == [0, 1]
    for r in range(2):
        assert result.outputs[r].splitlines() == ["backend gloo",
                                                 f"partial line of rank {r}: sum=3"]
    assert f"[rank 1] partial line of rank 1: sum=3" in capsys.readouterr().out
    with pytest.raises(launch.LaunchTimeout) as info:
        launch.spawn_script(_script(tmp_path, DEADLOCK), nproc=2, timeout=2,
                            stream=False)
    report = info.value.report
    assert report[0].startswith("rank 0: in all_reduce at script.py line 8"), report
    assert report[1].startswith("rank 1: at script.py line 10: time.sleep(600)")
    with pytest.raises(ValueError, match="no such script"):
        launch.spawn_script(tmp_path / "missing.py", nproc=2)


RAISES = """
    import torch.distributed as dist
    from dtlib.runtime import dist as ddist
    world = ddist.init()
    if world.rank == 2:
        raise RuntimeError("bad shard on rank two")
    dist.barrier()
"""


def test_torchrun_names_failing_rank_with_traceback(tmp_path, no_leftovers) -> None:
    with pytest.raises(launch.LaunchError) as info:
        launch.torchrun(_script(tmp_path, RAISES), nproc=3, timeout=60, stream=False)
    assert info.value.rank == 2
    msg = str(info.value)
    assert "rank 2 failed (RuntimeError: bad shard on rank two)" in msg
    assert 'script.py", line 6' in msg


def test_torchrun_rejects_bad_arguments(tmp_path) -> None:
    with pytest.raises(ValueError, match="no such script"):
        launch.torchrun(tmp_path / "missing.py", nproc=2)
    with pytest.raises(ValueError, match="nproc"):
        launch.torchrun(_script(tmp_path, HELLO), nproc=-2)


def _tensor_of_rank() -> torch.Tensor:
    return torch.full((3,), float(dist.get_rank()))


def test_spawn_returns_tensors_by_value() -> None:
    values = launch.spawn(_tensor_of_rank, 2, stream=False)
    assert [v.tolist() for v in values] == [[0.0] * 3, [1.0] * 3]
