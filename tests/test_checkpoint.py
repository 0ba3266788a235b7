"""Chapter 9: the whole training state, atomic writes, safe loads, sharded checkpoints.

Every resume is compared with the uninterrupted run with ``torch.equal`` (tolerance
zero): same ops in the same order on the same data must give the same bits.
"""

from __future__ import annotations

import os
import random
import re

import numpy as np
import pytest
import torch

from dtlib.runtime import launch
from dtlib.checkpoint.state import (STATE_KEYS, atomic_save, checkpoint_path,
                                    latest_checkpoint, list_checkpoints,
                                    load_checkpoint, rng_state, set_rng_state)
from dtlib.chapters.ch09_checkpointing.runs import (CrashDuringSave, SimulatedCrash,
                                                    crafted_checkpoint,
                                                    ddp_resume_proof,
                                                    seed_resume_step, seed_save_name,
                                                    train_run)
from dtlib.data_parallel.sampling import ResumableSampler
from dtlib.exercises import WrongAnswer, checkpoint as ex
from dtlib.models.gpt import build_gpt
from dtlib.chapters.ch09_checkpointing.sharded_runs import (FSDP_CFG, fsdp_load_both,
                                                            fsdp_save_both)
from dtlib.checkpoint.sharded import dcp_load_full, load_full

TOTAL, STOP = 10, 7  # 5 batches per epoch: the crash falls inside the second epoch


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny model: threads only contend on a loaded machine
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def straight():
    torch.set_num_threads(1)
    return train_run(TOTAL)


def _crash_and_resume(tmp_path, **resume_kwargs):
    train_run(TOTAL, str(tmp_path), save_every=STOP, stop_at=STOP)
    return train_run(TOTAL, str(tmp_path), resume=True, **resume_kwargs)


# ---- naming (ERRATA 36) --------------------------------------------------------------

def test_one_name_for_saving_and_finding(tmp_path):
    assert latest_checkpoint(tmp_path) is None
    for step in (3, 12, 100):
        torch.save({"step": step}, checkpoint_path(tmp_path, step))
    (tmp_path / ".tmp-abc.part").write_bytes(b"half a file")  # an unfinished write
    assert [s for s, _ in list_checkpoints(tmp_path)] == [3, 12, 100]
    assert latest_checkpoint(tmp_path) == checkpoint_path(tmp_path, 100)
    with pytest.raises(ValueError, match="step=-1"):
        checkpoint_path(tmp_path, -1)


def test_seed_names_never_resume(tmp_path):
    torch.save({"step": 40}, tmp_path / seed_save_name(epoch=1, step=40))
    assert seed_resume_step(str(tmp_path), epoch=2) == 0  # the defect: silent restart
    assert latest_checkpoint(tmp_path) is None  # and our scheme does not see it either
    torch.save({"step": 40}, checkpoint_path(tmp_path, 40))
    assert torch.load(latest_checkpoint(tmp_path), weights_only=True)["step"] == 40


# ---- atomic writes (ERRATA 38) -------------------------------------------------------

def test_naive_save_crash_corrupts_previous(tmp_path):
    path = checkpoint_path(tmp_path, 1)
    torch.save({"w": torch.ones(3)}, path)
    with pytest.raises(SimulatedCrash):
        torch.save({"w": torch.zeros(3), "x": CrashDuringSave()}, path)
    with pytest.raises(Exception):
        torch.load(path, weights_only=True)


def test_atomic_save_keeps_previous(tmp_path):
    path = checkpoint_path(tmp_path, 1)
    atomic_save({"w": torch.ones(3)}, path)
    with pytest.raises(SimulatedCrash):
        atomic_save({"w": torch.zeros(3), "x": CrashDuringSave()}, path)
    assert torch.equal(torch.load(path, weights_only=True)["w"], torch.ones(3))
    assert os.listdir(tmp_path) == [os.path.basename(path)]  # temp file cleaned up


# ---- safe loading (ERRATA 39) --------------------------------------------------------

def test_weights_only_refuses_code(tmp_path):
    marker = tmp_path / "marker"
    path = crafted_checkpoint(str(tmp_path / "evil.pt"), str(marker))
    with pytest.raises(Exception, match="(?i)weights_only|unsupported|global"):
        torch.load(path, weights_only=True)
    assert not marker.exists()
    torch.load(path, weights_only=False)
    assert marker.exists()  # the unsafe load ran the file's code


def test_rng_state_roundtrip_weights_only(tmp_path):
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    atomic_save(rng_state(), tmp_path / "rng.pt")
    want = (random.random(), np.random.rand(), torch.rand(1))
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    got = (random.random(), np.random.rand(), torch.rand(1))
    assert got[:2] == want[:2] and torch.equal(got[2], want[2])


# ---- sampler: resume by arithmetic, not by replay (ERRATA 37) ------------------------

@pytest.mark.parametrize("world_size", [1, 3])
def test_sampler_resumes_mid_epoch(world_size):
    for rank in range(world_size):
        s = ResumableSampler(10, rank=rank, world_size=world_size, seed=3)
        s.set_epoch(2)
        full = list(s)
        s2 = ResumableSampler(10, rank=rank, world_size=world_size, seed=3)
        s2.load_state_dict({"epoch": 2, "position": 2, "seed": 3})
        assert list(s2) == full[2:]
    s = ResumableSampler(10, seed=3)
    assert list(s) != (s.set_epoch(1) or list(s))  # a new order each epoch
    with pytest.raises(ValueError, match="rank=2"):
        ResumableSampler(10, rank=2, world_size=2)


# ---- the proof (ERRATA 37) -----------------------------------------------------------

def test_resume_is_bit_exact(tmp_path, straight):
    resumed = _crash_and_resume(tmp_path)
    assert resumed["start_step"] == STOP
    assert torch.equal(resumed["params"], straight["params"])
    assert resumed["lr"] == straight["lr"]


@pytest.mark.parametrize("missing", ["sampler", "scheduler", "rng_torch", "rng_python",
                                     "rng_numpy", "optimizer"])
def test_partial_restore_diverges(tmp_path, straight, missing):
    keys = set(STATE_KEYS) - {missing}
    resumed = _crash_and_resume(tmp_path, restore=keys)
    assert not torch.equal(resumed["params"], straight["params"])


def test_replay_is_exact_but_loads_skipped_batches(tmp_path, straight):
    arith = _crash_and_resume(tmp_path)
    replay = train_run(TOTAL, str(tmp_path), resume=True, replay=True)
    assert torch.equal(replay["params"], straight["params"])
    assert replay["loads"] - arith["loads"] == 2 * 4  # 2 batches of 4 into epoch 1


def test_load_rejects_bad_keys_and_world_size(tmp_path):
    train_run(2, str(tmp_path), save_every=2)
    model = build_gpt()
    with pytest.raises(ValueError, match="restore"):
        load_checkpoint(latest_checkpoint(tmp_path), model, restore={"weights"})
    state = torch.load(latest_checkpoint(tmp_path), weights_only=True)
    state["world_size"] = 2
    torch.save(state, checkpoint_path(tmp_path, 3))
    with pytest.raises(ValueError, match="2 ranks"):
        load_checkpoint(latest_checkpoint(tmp_path), model)


def _good_and_bad(root: str) -> tuple[dict, dict]:
    """On each of the ranks, in one launch: the proof with the whole state restored,
    and with the RNG and sampler states left out."""
    good = ddp_resume_proof(os.path.join(root, "a"), TOTAL, STOP)
    bad = ddp_resume_proof(os.path.join(root, "b"), TOTAL, STOP,
                           ("model", "optimizer", "scheduler"))
    return good, bad


def test_ddp_resume_two_ranks(tmp_path):
    ranks = launch.spawn(_good_and_bad, 2, str(tmp_path), stream=False, timeout=240)
    good, bad = [r[0] for r in ranks], [r[1] for r in ranks]
    assert all(r["equal"] for r in good)
    # the two ranks hold the same (all-reduced) model, and it is the straight run's
    assert torch.equal(good[0]["resumed"], good[1]["resumed"])
    assert not any(r["equal"] for r in bad)


# ---- sharded state (ERRATA 40) -------------------------------------------------------

def test_fsdp2_teaching_format_and_dcp_reshard(tmp_path):
    td, dd, naive = (str(tmp_path / n) for n in ("teach", "dcp", "naive.pt"))
    saved = launch.spawn(fsdp_save_both, 4, td, dd, naive, stream=False, timeout=180)
    b = saved[0]["bytes"]
    assert b["local"] < 0.3 * b["global"]  # rank 0 holds about a quarter
    assert saved[0]["naive_file_bytes"] < 0.5 * b["global"]
    full = saved[0]["full"]
    loaded = launch.spawn(fsdp_load_both, 2, td, dd, stream=False, timeout=180)
    for name in ("teach", "dcp"):
        got = loaded[0][name]
        assert set(got) == set(full)
        for k in full:
            assert torch.equal(got[k], full[k]), (name, k)
    one = load_full(td)
    assert all(torch.equal(one[k], full[k]) for k in full)
    template = {"model": build_gpt(FSDP_CFG, seed=1).state_dict()}
    dcp_load_full(dd, template)
    for k, v in template["model"].items():
        assert torch.equal(v, full["model/" + k]), k


# ---- exercise checkers ---------------------------------------------------------------

def test_check_resume_keys_accepts_all_rejects_partial():
    ex.check_resume_keys(STATE_KEYS)
    with pytest.raises(WrongAnswer, match="different run"):
        ex.check_resume_keys(["model", "optimizer", "scheduler", "sampler",
                              "rng_torch"])
    with pytest.raises(WrongAnswer, match="unknown"):
        ex.check_resume_keys(["weights"])


def test_check_atomic_save():
    from dtlib.exercises.tripwires import ShortcutTaken

    # the book's own save meets every rule of the checker (judged with its tripwires
    # off); as a learner's answer it is the exercise itself, refused
    ex.check_atomic_save.__wrapped__(atomic_save)
    with pytest.raises(ShortcutTaken, match="atomic_save"):
        ex.check_atomic_save(atomic_save)
    with pytest.raises(WrongAnswer, match="not put in place by a rename"):
        ex.check_atomic_save(lambda obj, path: torch.save(obj, path))

    def no_fsync(obj, path):
        torch.save(obj, path + ".part")
        os.replace(path + ".part", path)

    with pytest.raises(WrongAnswer, match="fsync"):
        ex.check_atomic_save(no_fsync)


# ---- safe DCP loads, damage, permissions, leftovers, equal sampler counts ------------

def _dcp_dir(path: str) -> tuple[dict, dict]:
    """A small DCP checkpoint with a manifest (one process); returns (saved,
    template)."""
    import warnings

    import torch.distributed.checkpoint as dcp

    from dtlib.checkpoint.safe_dcp import write_manifest

    torch.manual_seed(0)
    saved = {"model": {"w": torch.randn(4, 3)}, "lr": 0.25, "betas": (0.9, 0.99)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(saved, checkpoint_id=path, no_dist=True)
    write_manifest(path, world_size=1, step=3)
    return saved, {"model": {"w": torch.zeros(4, 3)}, "lr": 0.0, "betas": (0.0, 0.0)}


class _Boom:
    """A pickle that runs code when loaded: it creates the file ``marker``."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_safe_dcp_load_round_trip(tmp_path):
    from dtlib.checkpoint.safe_dcp import safe_dcp_load

    saved, template = _dcp_dir(str(tmp_path / "ck"))
    manifest = safe_dcp_load(template, str(tmp_path / "ck"), no_dist=True)
    assert manifest["world_size"] == 1 and manifest["step"] == 3
    assert torch.equal(template["model"]["w"], saved["model"]["w"])
    assert template["lr"] == 0.25 and tuple(template["betas"]) == (0.9, 0.99)


def test_crafted_dcp_metadata_is_never_unpickled(tmp_path):
    """The attack dcp.load falls for: a .metadata pickle that runs code. Refused with
    the manifest recomputed (an attacker who can write files), and without it."""
    import pickle

    from dtlib.checkpoint.safe_dcp import (CheckpointDamaged, safe_dcp_load,
                                           write_manifest)

    ck = str(tmp_path / "ck")
    _, template = _dcp_dir(ck)
    marker = str(tmp_path / "code_ran")
    with open(os.path.join(ck, ".metadata"), "wb") as f:
        pickle.dump(_Boom(marker), f)
    with pytest.raises(CheckpointDamaged, match="metadata changed"):
        safe_dcp_load(template, ck, no_dist=True)  # the manifest catches the swap
    write_manifest(ck, world_size=1, step=3)  # a forger rewrites the manifest too
    with pytest.raises(CheckpointDamaged, match="may not refer to"):
        safe_dcp_load(template, ck, no_dist=True)
    assert not os.path.exists(marker)  # no code ran
    os.remove(os.path.join(ck, "manifest.json"))
    with pytest.raises(CheckpointDamaged, match="no readable manifest"):
        safe_dcp_load(template, ck, no_dist=True)


def test_damaged_dcp_file_is_detected(tmp_path):
    from dtlib.checkpoint.safe_dcp import CheckpointDamaged, verify_manifest

    ck = str(tmp_path / "ck")
    _dcp_dir(ck)
    data = [n for n in os.listdir(ck) if n.endswith(".distcp")][0]
    with open(os.path.join(ck, data), "r+b") as f:
        f.truncate(10)
    with pytest.raises(CheckpointDamaged, match="changed since it was saved"):
        verify_manifest(ck)


def test_atomic_save_normal_permissions_and_cleans_leftovers(tmp_path):
    from dtlib.checkpoint.state import clean_leftovers

    old = os.umask(0o022)
    try:
        path = atomic_save({"x": torch.ones(1)}, tmp_path / "a.pt")
    finally:
        os.umask(old)
    assert os.stat(path).st_mode & 0o777 == 0o644  # readable by eval jobs
    (tmp_path / ".tmp-abc.part").write_bytes(b"half a checkpoint")  # a killed save
    (tmp_path / "step00000009.tmp").mkdir()  # a killed sharded save
    assert sorted(clean_leftovers(tmp_path)) == [".tmp-abc.part", "step00000009.tmp"]
    assert sorted(os.listdir(tmp_path)) == ["a.pt"]


@pytest.mark.parametrize("dataset_len,world_size", [(1, 4), (5, 4), (7, 3), (2, 2)])
def test_sampler_equal_counts_like_distributed_sampler(dataset_len, world_size):
    from torch.utils.data import DistributedSampler

    per_rank = [ResumableSampler(dataset_len, rank=r, world_size=world_size,
                                 shuffle=False) for r in range(world_size)]
    ref = [list(DistributedSampler(range(dataset_len), world_size, r, shuffle=False))
           for r in range(world_size)]
    assert [list(s) for s in per_rank] == ref
    assert all(len(r) == -(-dataset_len // world_size) for r in ref)


def test_truncated_newest_checkpoint_falls_back(tmp_path):
    from dtlib.checkpoint.state import load_latest_good

    net = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    from dtlib.checkpoint.state import save_checkpoint

    save_checkpoint(tmp_path, 3, net, opt)
    good = net.weight.detach().clone()
    with torch.no_grad():
        net.weight.add_(1)
    newest = save_checkpoint(tmp_path, 6, net, opt)
    with open(newest, "r+b") as f:
        f.truncate(100)
    with pytest.warns(UserWarning, match="step00000006.pt.*falling back"):
        got = load_latest_good(tmp_path, net, opt)
    assert got["step"] == 3 and got["path"].endswith("step00000003.pt")
    assert torch.equal(net.weight, good)


def _debug_tools() -> dict:
    """On every rank: both of Chapter 9's debugging runs, in one launch."""
    from dtlib.chapters.ch09_checkpointing.debug_runs import (detail_mismatch,
                                                              missing_rank)

    return {"detail": detail_mismatch(), "missing": missing_rank(stuck_s=1.0,
                                                                 timeout_s=0.2)}


def test_debug_tools_name_the_mismatch_and_the_missing_rank():
    """ERRATA 10's collective only rank 0 calls: TORCH_DISTRIBUTED_DEBUG=DETAIL's
    checker makes it an error naming both ranks' calls, on both ranks (not a hang);
    monitored_barrier names the rank that did not arrive."""
    ranks = launch.spawn(_debug_tools, 2, stream=False, timeout=120)
    for r in ranks:
        assert "mismatch" in r["detail"].lower(), r["detail"]
        assert "OpType=REDUCE, TensorShape=[1]" in r["detail"], r["detail"]
        assert "OpType=ALLREDUCE, TensorShape=[4]" in r["detail"], r["detail"]
        assert "TensorOptions" not in r["detail"], r["detail"]
    assert re.search(r"Ranks? 1 failed to pass monitoredBarrier", ranks[0]["missing"]), \
        ranks[0]["missing"]
    assert ranks[1]["missing"] == "stuck"


def test_one_name_for_a_checkpoint_directory_too(tmp_path):
    """The capstone's directories use the same scheme as the files: built by
    checkpoint_dir, read back by step_of, and nothing else matches."""
    from dtlib.checkpoint.state import checkpoint_dir, step_of

    path = checkpoint_dir(tmp_path, 12)
    assert os.path.basename(path) == "step00000012" and step_of(path) == 12
    assert step_of(path + "/") == 12
    assert step_of("step00000012.pt") is None
    assert step_of("step00000012.pt", directory=False) == 12
    for other in ("step00000012.tmp", "step00000012.damaged-1", "step12", "superseded-1"):
        assert step_of(other) is None, other
    with pytest.raises(ValueError, match="step=-1"):
        checkpoint_dir(tmp_path, -1)
    from dtlib.checkpoint.state import list_checkpoint_dirs

    for step in (10, 3):
        os.makedirs(checkpoint_dir(tmp_path, step))
    os.makedirs(checkpoint_dir(tmp_path, 4) + ".tmp")  # a save in flight
    open(checkpoint_dir(tmp_path, 5), "w").close()  # a file of the name
    assert list_checkpoint_dirs(tmp_path) == [(3, checkpoint_dir(tmp_path, 3)),
                                              (10, checkpoint_dir(tmp_path, 10))]
