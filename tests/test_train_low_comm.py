"""The capstone's Chapter 15 flags: ``--diloco H`` and ``--powersgd RANK``.

- A run stopped in the middle of an outer round (``--diloco 3``, stopped after step
  5, resumed from step 4: one inner step into the second round) continues bit for
  bit: every step's loss (the mean over both replicas) and the final parameters are
  the uninterrupted run's. The checkpoint holds each replica, the anchor, both
  optimizers and the steps taken, per rank.
- The same for ``--powersgd 2`` (its per-rank errors, factors and step count), with
  DDP's warm-up backward leaving the memory untouched.
- Both train differently from plain DDP (not vacuous).
- A resume that changes either flag, or the number of ranks, is refused, naming
  what differs, and leaves every file as it was; bad combinations of flags are
  refused before anything starts, naming the flag.
"""

from __future__ import annotations

import json
import os
import sys

import cloudpickle
import pytest
import torch.distributed as dist

from test_train_identity import hashes

from dtlib.runtime import launch
from dtlib.train.config import TrainConfig, parse_args
from dtlib.train.identity import Refusal
from dtlib.train.loop import train
from dtlib.runtime.dist import world

cloudpickle.register_pickle_by_value(sys.modules[__name__])

BASE = ["--steps", "8", "--save-every", "4", "--log-every", "4", "--dataset-size",
        "256", "--micro-batch", "2"]


def _runs(root: str, flags: list[str]) -> dict:
    """On every rank: the run straight through, then the same run stopped after step
    5 and started again (it resumes from step 4); each run's summary, rank 0's."""
    out = {}
    for name, ckpt, extra in (("straight", "a", []), ("crashed", "b", ["--stop-after",
                                                                         "5"]),
                              ("resumed", "b", [])):
        argv = [*BASE, *flags, "--ckpt-dir", os.path.join(root, ckpt), *extra]
        out[name] = json.loads(json.dumps(train(parse_args(argv), world())))
    return out


@pytest.fixture(scope="module")
def low_comm_runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("low_comm")
    runs = {}
    for name, flags in (("diloco", ["--diloco", "3"]),
                        ("powersgd", ["--powersgd", "2", "--powersgd-start", "2"]),
                        ("ddp", [])):
        where = str(root / name)
        runs[name] = {**launch.spawn(_runs, 2, where, flags, stream=False,
                                     timeout=300)[0], "root": where}
    return runs


@pytest.mark.parametrize("name", ["diloco", "powersgd"])
def test_a_run_resumed_mid_round_is_the_same_run(low_comm_runs, name) -> None:
    runs = low_comm_runs[name]
    straight, crashed, resumed = runs["straight"], runs["crashed"], runs["resumed"]
    assert crashed["end_step"] == 5 and resumed["start_step"] == 4
    assert resumed["param_sha256"] == straight["param_sha256"]
    assert resumed["losses"] == {k: v for k, v in straight["losses"].items()
                                 if int(k) > 4}
    assert crashed["losses"]["5"] == resumed["losses"]["5"]  # redone identically
    # not DDP: another trajectory from the same start
    assert straight["param_sha256"] != low_comm_runs["ddp"]["straight"]["param_sha256"]


def _refused(argv: list[str]) -> str:
    """On every rank: the run's refusal (each rank refuses alike), or ''."""
    try:
        train(parse_args(argv), world())
    except Refusal as exc:
        dist.barrier()
        return str(exc)
    return ""


def test_a_resume_that_changes_the_method_or_the_ranks_is_refused(
        low_comm_runs) -> None:
    ckpt = os.path.join(low_comm_runs["diloco"]["root"], "a")
    before = hashes(ckpt)
    for flags, named in ((["--diloco", "4"], "--diloco"),
                         ([], "--diloco"),
                         (["--powersgd", "2", "--powersgd-start", "2"], "--powersgd")):
        text = launch.spawn(_refused, 2, [*BASE, *flags, "--ckpt-dir", ckpt],
                            stream=False, timeout=120)[0]
        assert named in text and "low_comm" in text, (flags, text)
    # the same global batch on one rank (two micro-batches): only the ranks differ
    text = launch.spawn(_refused, 1, [*BASE, "--accum-steps", "2", "--diloco", "3",
                                      "--ckpt-dir", ckpt], stream=False,
                        timeout=120)[0]
    assert "written by 2 ranks" in text and "not 1" in text, text
    assert hashes(ckpt) == before  # nothing on disk changed


def test_bad_combinations_name_the_flag() -> None:
    with pytest.raises(ValueError, match="diloco=2 needs strategy='ddp'"):
        TrainConfig(diloco=2, strategy="fsdp")
    with pytest.raises(ValueError, match="powersgd=2 needs strategy='ddp'"):
        TrainConfig(powersgd=2, strategy="fsdp")
    with pytest.raises(ValueError, match="diloco=2 and powersgd=1 are both set"):
        TrainConfig(diloco=2, powersgd=1)
    with pytest.raises(ValueError, match="diloco=2 with precision='fp16'"):
        TrainConfig(diloco=2, precision="fp16")
    with pytest.raises(ValueError, match="powersgd_start=1"):
        TrainConfig(powersgd=2, powersgd_start=1)
    with pytest.raises(ValueError, match="diloco=-1"):
        TrainConfig(diloco=-1)
