"""One backend per world: every rank agrees, and too few GPUs never means a hang.

CUDA is mocked (``torch.cuda.is_available`` / ``device_count``), so these run on a CPU.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dtlib.runtime import dist as ddist, launch


def gpus(monkeypatch, n: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    monkeypatch.delenv("DTLIB_BACKEND", raising=False)


@pytest.mark.parametrize("n_gpus", [1, 2, 3])
def test_more_ranks_than_gpus_puts_every_rank_on_gloo(monkeypatch, n_gpus):
    gpus(monkeypatch, n_gpus)
    # Every rank of a 4-rank launch decides the same, even those that have a GPU.
    assert {ddist.choose_backend(r, local_world_size=4) for r in range(4)} == {"gloo"}
    assert f"4 ranks on this machine but {n_gpus} GPUs" in ddist.too_few_gpus(4)


def test_as_many_gpus_as_ranks_is_nccl_everywhere(monkeypatch):
    gpus(monkeypatch, 4)
    assert {ddist.choose_backend(r, local_world_size=4) for r in range(4)} == {"nccl"}
    assert {ddist.choose_backend(r, local_world_size=2) for r in range(2)} == {"nccl"}
    assert ddist.too_few_gpus(4) is None
    gpus(monkeypatch, 0)
    assert ddist.choose_backend(0, local_world_size=4) == "gloo"
    assert ddist.too_few_gpus(4) is None  # a CPU machine: nothing to explain


def test_launch_without_n_starts_one_rank_per_gpu(monkeypatch):
    for n, want in ((0, 4), (1, 1), (3, 3), (8, 8)):
        gpus(monkeypatch, n)
        assert launch.default_nproc() == want


def test_ranks_that_disagree_fail_at_once_saying_why():
    store = dist.HashStore()
    store.set("dtlib/backend/1", "gloo")  # rank 1 already chose gloo
    with pytest.raises(RuntimeError, match=r"different backends.*'gloo': \[1\].*"
                                           r"'nccl': \[0\]"):
        ddist.agree_backend(store, 0, 2, "nccl")
    store = dist.HashStore()
    store.set("dtlib/backend/1", "gloo")
    ddist.agree_backend(store, 0, 2, "gloo")  # agreement passes


def backend_of_world() -> str:
    return ddist.world().backend


@pytest.mark.parametrize("world_size", [2, 4])
def test_spawned_worlds_agree(world_size):
    """A spawned world agrees on one backend; a torchrun world's agreement is checked
    by test_launch's streaming run (same code, the rendezvous is env://)."""
    assert launch.spawn(backend_of_world, world_size, timeout=60) == \
        ["gloo"] * world_size


def test_sync_waits_for_cuda_and_is_free_on_cpu(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(
        str(device)))
    ddist.sync("cpu")
    assert calls == []
    ddist.sync("cuda:1")
    assert calls == ["cuda:1"]
