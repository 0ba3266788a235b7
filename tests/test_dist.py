"""dtlib.runtime.dist: one place chooses backend and device, and validates its environment."""

from __future__ import annotations

import pytest
import torch

from dtlib.runtime import dist as ddist, launch
from dtlib.runtime.device_memory import memory_stats


def test_gloo_is_chosen_on_a_cpu_machine(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("DTLIB_BACKEND", raising=False)
    assert ddist.choose_backend(0) == "gloo"


def test_nccl_is_chosen_when_local_rank_has_a_gpu(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.delenv("DTLIB_BACKEND", raising=False)
    assert ddist.choose_backend(1) == "nccl"
    assert ddist.choose_backend(2) == "gloo"  # no GPU for local rank 2
    assert ddist.choose_backend(1, "gloo") == "gloo"  # overridable


def test_backend_errors_name_the_argument(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="backend='mpi'.*allowed"):
        ddist.choose_backend(0, "mpi")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        ddist.choose_backend(0, "nccl")


def test_environment_is_validated(monkeypatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "5")
    with pytest.raises(ValueError, match="RANK=5 must be < WORLD_SIZE=2"):
        ddist.world()
    monkeypatch.setenv("RANK", "x")
    with pytest.raises(ValueError, match="RANK='x' is not an integer"):
        ddist.world()


def _world() -> ddist.World:
    return ddist.world()


def test_init_in_every_rank_reports_its_world() -> None:
    worlds = launch.spawn(_world, 2, stream=False)
    assert [(w.rank, w.world_size, w.backend, w.device.type) for w in worlds] == [
        (0, 2, "gloo", "cpu"), (1, 2, "gloo", "cpu")]


def test_a_lone_process_is_a_world_of_one(monkeypatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    world = ddist.init(timeout=30)
    try:
        t = torch.ones(3)
        torch.distributed.all_reduce(t)
        assert world == ddist.World(0, 0, 1, "gloo", torch.device("cpu"))
        assert t.tolist() == [1.0, 1.0, 1.0]
        assert ddist.world_info()["initialized"] is True
    finally:
        ddist.destroy()
    with pytest.raises(ValueError, match="timeout=-1"):
        ddist.init(timeout=-1)


def test_memory_stats_on_cpu_names_current_and_peak() -> None:
    before = memory_stats("cpu")
    block = torch.ones(64, 2**20 // 4 * 1)  # 64 MiB
    block += 1
    after = memory_stats("cpu")
    assert after.device == "cpu" and after.reserved_bytes is None
    assert after.peak_bytes >= after.current_bytes > 0
    assert after.current_bytes - before.current_bytes > 32 * 2**20
    assert "peak" in str(after)
    with pytest.raises(ValueError, match="device=meta"):
        memory_stats("meta")


def test_rprint_prints_on_rank_zero_only(capsys, monkeypatch) -> None:
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("DTLIB_LAUNCHED", raising=False)
    ddist.rprint("hidden")
    ddist.rprint("shown", all_ranks=True)
    assert capsys.readouterr().out == "[rank 1] shown\n"
