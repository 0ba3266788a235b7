"""Every tensor a rank creates lives on the rank's device (NCCL's first rule), on a CPU.

:mod:`device_check` makes the world's device ``meta`` while gloo still runs on the CPU,
marks every tensor made without ``device=`` as *host* (where it would land on a GPU
node), and records each collective or point-to-point call given a host tensor and each
compute op mixing host and device tensors. The rank functions of chapters 2-6 and the
benchmarks (what the GPU suite runs), and the ``%%torchrun`` cells of chapters 0 and 2
that are meant to succeed (all in one spawned world, then the capstone), must produce
no record. The first test shows the check fails on the mistakes it is for. What it cannot see is said in :mod:`device_check`'s
docstring; the cells that fail on purpose (a deadlock, a crash) are not run.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist

import device_check
from dtlib.runtime import launch
from dtlib.runtime.dist import world

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def mistakes() -> dict[str, list[str]]:
    """On every rank: each classic mistake, run under the rules, and the right way."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    out = {}
    start = len(device_check.violations)

    def since() -> list[str]:
        nonlocal start
        new = device_check.violations[start:]
        start = len(device_check.violations)
        return new

    t = torch.zeros(3)  # no device: on a GPU node this is a CPU tensor
    dist.all_reduce(t)
    out["factory"] = since()
    x = torch.ones(2, 3, device=world().device)
    _ = x + torch.ones(2, 3)
    out["mix"] = since()
    _ = DDP(torch.nn.Linear(3, 3))
    out["ddp"] = since()
    dist.all_reduce(torch.ones(2, device="cpu"))  # "cpu" by name: the host on a GPU
    out["explicit_cpu"] = since()
    buf = torch.empty(3, device=world().device)
    dist.broadcast(buf, src=0)
    dist.all_reduce(torch.zeros(2, 3, device=x.device) + x)  # follows x's device
    _ = DDP(torch.nn.Linear(3, 3).to(world().device))
    total = torch.zeros((), device=world().device) + x.sum() * torch.tensor(2.0)
    dist.all_reduce(total)
    out["right"] = since()
    return out


@pytest.mark.parametrize("world_size", [2])
def test_the_check_catches_each_mistake(world_size):
    for r in launch.spawn(device_check.checked, world_size, mistakes, timeout=90):
        got = r["value"]
        assert any("dist.all_reduce got a tensor" in v for v in got["factory"])
        assert any("'add' mixes" in v for v in got["mix"])
        assert any("DDP was given" in v for v in got["ddp"])
        assert any("dist.all_reduce got a tensor" in v for v in got["explicit_cpu"])
        assert got["right"] == []  # the right way raises nothing (0-d scalars mix)


def book_rank_code() -> dict:
    """On every rank: the rank functions of chapters 2-6 and of the benchmarks."""
    from dtlib.bench import collectives as bench_coll, launch as bench_launch
    from dtlib.chapters.ch02_collectives import runs as ch02
    from dtlib.chapters.ch06_pipeline_parallel import runs as ch06

    # At four ranks only what has more roles than at two: a ring with more than one
    # neighbour pair, and pipeline stages in the middle (neither first nor last).
    ch02.ring_trace_states()
    # The tracer front end (torch.export) refuses to trace under a function mode.
    m = dist.get_world_size()  # torch's 1F1B needs m >= stages
    pp = ch06.compare_all(ch06.PP_GPT, batch=2 * m, n_microbatches=m, steps=1,
                          variants=("ours-gpipe", "ours-1f1b", "torch-gpipe",
                                 "torch-1f1b"))
    ch06.timeline_rank(ch06.PP_GPT, 2 * m, m, repeats=1)
    if dist.get_world_size() > 2:  # the rest does not depend on the world size:
        return {"loss_diff": max(pp[i]["loss_diff"] for i in pp if i != "ref_losses")}
    ch02.primitive_states()
    ch02.training_step_comms()
    bench_coll.time_collectives([4096], list(bench_coll.OPS), budget=0.01)
    bench_launch.hello()
    # chapters 3, 4 and 5 (what the GPU suite runs on NCCL) once, two steps each.
    from dtlib.bench.zero import train_rank
    from dtlib.chapters.ch03_data_parallel import runs as ch03
    from dtlib.chapters.ch05_tensor_parallel.runs import train_tp

    for variant in ch03.VARIANTS:
        ch03.train_replica(ch03.TINY, variant, 2, 2)
    ch03.record_timeline(ch03.TINY, 2, 0.01, 1)
    for impl, stage, bf16 in (("zero", 1, False), ("zero", 2, False),
                              ("zero", 3, False), ("fsdp2", 3, True)):
        train_rank(impl, stage, "gpt", steps=2, bf16=bf16)
    for impl in ("ours", "dtensor"):
        train_tp(ch03.TINY, impl, 4, 2)
    return {"loss_diff": max(pp[i]["loss_diff"] for i in pp if i != "ref_losses")}


@pytest.mark.parametrize("world_size", [2, 4])
def test_book_rank_code_keeps_every_tensor_on_the_device(world_size):
    results = launch.spawn(device_check.checked, world_size, book_rank_code,
                           timeout=240, stream=False)
    for r in results:
        assert r["violations"] == []
        assert r["value"]["loss_diff"] < 1e-5  # the rules changed no number


def torchrun_cells(notebook: str) -> list[str]:
    """The ``%%torchrun`` and ``%%ranks`` cells of ``notebook`` meant to succeed."""
    with open(os.path.join(ROOT, "notebooks", notebook)) as f:
        cells = json.load(f)["cells"]
    return ["".join(c["source"]).split("\n", 1)[1] for c in cells
            if "".join(c["source"]).startswith(("%%torchrun", "%%ranks"))
            and "raises-exception" not in c.get("metadata", {}).get("tags", [])]


def cells_and_capstone(cells: dict[str, list[str]], argvs: dict[str, list[str]]
                       ) -> dict[str, list]:
    """On every rank: each ``%%torchrun`` cell in a fresh namespace, then the capstone
    (``python -m dtlib.train ARGV``) for each strategy; the violations of each.

    A cell's ``ddist.init()`` returns the world this rank already joined, so one launch
    runs them all: the device rules do not depend on the launcher.
    """
    from dtlib.train import loop

    out: dict[str, list] = {}
    start = len(device_check.violations)
    for name, sources in cells.items():
        out[name] = []
        for k, source in enumerate(sources):
            exec(compile(source, f"<{name} cell {k}>", "exec"), {"__name__": "__main__"})
            out[name].append(device_check.violations[start:])
            start = len(device_check.violations)
    for name, argv in argvs.items():
        loop.main(argv)  # trains, and saves a checkpoint at step 2
        out[name] = [device_check.violations[start:]]
        start = len(device_check.violations)
    return out


NOTEBOOKS = ["00_hello_distributed.ipynb", "02_collectives.ipynb"]
STRATEGIES = ["ddp", "fsdp"]


@pytest.fixture(scope="module")
def placement(tmp_path_factory) -> list[dict[str, list]]:
    from dtlib.bench.launch import HELLO

    ckpt = tmp_path_factory.mktemp("ckpt")
    cells = {nb: torchrun_cells(nb) for nb in NOTEBOOKS}
    cells[NOTEBOOKS[0]].append(HELLO)
    argvs = {s: ["--steps", "3", "--micro-batch", "2", "--dataset-size", "64",
                 "--log-every", "3", "--save-every", "2", "--strategy", s,
                 "--ckpt-dir", str(ckpt / s)] for s in STRATEGIES}
    results = launch.spawn(device_check.checked, 2, cells_and_capstone, cells, argvs,
                           timeout=240, stream=False)
    return [r["value"] for r in results]


@pytest.mark.parametrize("notebook", NOTEBOOKS)
def test_torchrun_cells_keep_every_tensor_on_the_device(notebook, placement):
    assert torchrun_cells(notebook), f"{notebook} has no %%torchrun cell that succeeds"
    for rank, found in enumerate(placement):
        assert len(found[notebook]) >= len(torchrun_cells(notebook))
        for k, cell in enumerate(found[notebook]):
            assert cell == [], f"cell {k} of {notebook}, rank {rank}: {cell}"


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_capstone_keeps_every_tensor_on_the_device(strategy, placement):
    for rank, found in enumerate(placement):  # training, and a checkpoint at step 2
        assert found[strategy] == [[]], f"capstone {strategy}, rank {rank}"
