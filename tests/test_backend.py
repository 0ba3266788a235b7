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


SCRIPT = """
import torch, torch.distributed as dist
from dtlib.runtime import dist as ddist
world = ddist.init()
t = torch.ones(1, device=world.device)
dist.all_reduce(t)
print("backend", world.backend, "sum", int(t.item()))
"""


@pytest.mark.parametrize("world_size", [2, 4])
def test_spawned_and_torchrun_worlds_agree(world_size, tmp_path):
    assert launch.spawn(backend_of_world, world_size, timeout=60) == \
        ["gloo"] * world_size
    if world_size == 2:
        return  # torchrun's env:// path is the same code at any size: once, at 4
    script = tmp_path / "hello.py"
    script.write_text(SCRIPT)  # env:// rendezvous, then the agreement through its store
    out = launch.torchrun(script, nproc=world_size, timeout=90, stream=False)
    assert len(out.outputs) == world_size
    for text in out.outputs.values():
        assert f"backend gloo sum {world_size}" in text


def test_sync_waits_for_cuda_and_is_free_on_cpu(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(
        str(device)))
    ddist.sync("cpu")
    assert calls == []
    ddist.sync("cuda:1")
    assert calls == ["cuda:1"]
