"""Chapters 8 and 9: the build-on-ranks checkers reject each kind of wrong answer and
accept the valid alternatives.

Ranks are expensive on two cores: each test group shares one launch (several answers
judged in one 2-rank job where the checker allows it).
"""

from __future__ import annotations

import io
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (get_model_state_dict,
                                                     get_state_dict,
                                                     set_model_state_dict,
                                                     set_state_dict)

from dtlib.exercises import WrongAnswer
from dtlib.exercises.accumulation import check_loss_scale_on_ranks
from dtlib.exercises.checkpoint import (check_atomic_save, check_sharded_resume,
                                        judge_sharded_resume)


# ---- Chapter 8: the normaliser through one all-gather is accepted ----

def _scale_by_all_gather(local_tokens):
    mine = torch.tensor([sum(local_tokens)])
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return dist.get_world_size() / float(torch.cat(every).sum())


def _page_table():
    from dtlib.exercises.accumulation import SCALE_CASES, _scale_truth

    cases = list(SCALE_CASES) + [tuple(tuple(7 * r + k + 1 for k in range(3))
                                       for r in range(n)) for n in (2, 3, 4, 5)]
    return {(len(c), c[r]): _scale_truth([list(x) for x in c])
            for c in cases for r in range(len(c))}


_TABLE = _page_table()


def _scale_from_a_table(local_tokens):
    """Every case the checker used to try, looked up; one all-reduce as a decoy."""
    decoy = torch.ones(1)
    dist.all_reduce(decoy)
    return _TABLE.get((dist.get_world_size(), tuple(local_tokens)), 1.0)


def test_loss_scale_draws_counts_no_table_knows() -> None:
    with pytest.raises(WrongAnswer, match="token counts"):
        check_loss_scale_on_ranks(_scale_from_a_table)


def test_loss_scale_accepts_all_gather(capsys) -> None:
    check_loss_scale_on_ranks(_scale_by_all_gather, world_sizes=(2,))
    assert "Correct" in capsys.readouterr().out


# ---- Chapter 9: atomic save, judged by what it does to the files ----

def _sync_dir(path, sync="fsync"):
    fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        getattr(os, sync)(fd)
    finally:
        os.close(fd)


def _save_pathlib_rename(obj, path):
    from pathlib import Path

    tmp = Path(path).with_suffix(".part")
    try:
        with open(tmp, "wb") as f:  # open's permissions: no chmod needed
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        tmp.unlink()  # a crashed save leaves nothing behind
        raise
    tmp.rename(path)  # calls os.rename
    _sync_dir(path)


def _written_and_synced(obj, path, sync="fsync"):
    """The temporary file, written, flushed and synced (``os.<sync>``), renamed onto
    ``path``; the directory left unsynced."""
    tmp = path + ".part"
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            getattr(os, sync)(f.fileno())
    except BaseException:
        os.unlink(tmp)
        raise
    os.replace(tmp, path)


def _save_fdatasync(obj, path):
    # valid: fdatasync writes the data (and the size) as fsync does
    _written_and_synced(obj, path, "fdatasync")
    _sync_dir(path, "fdatasync")


def _save_no_directory_sync(obj, path):
    _written_and_synced(obj, path)  # the rename may be lost: the directory never synced


def _save_directory_synced_first(obj, path):
    _sync_dir(path)  # before the rename: it does not cover it
    _save_no_directory_sync(obj, path)


def _save_onto_itself(obj, path):
    buf = io.BytesIO()
    torch.save(obj, buf)  # a crash here leaves the old file alone...
    with open(path, "wb") as f:  # ...but this truncates it
        f.write(buf.getvalue())
        f.flush()
        os.fsync(f.fileno())
    os.replace(path, path)


def _save_fsync_after_rename(obj, path):
    tmp = path + ".part"
    with open(tmp, "wb") as f:
        torch.save(obj, f)
    os.replace(tmp, path)
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)  # too late: the rename may reach the disk before the data
    os.close(fd)


def _save_unflushed(obj, path):
    buf = io.BytesIO()
    torch.save(obj, buf)
    tmp = path + ".part"
    with open(tmp, "wb") as f:
        f.write(buf.getvalue()[:100])
        os.fsync(f.fileno())  # the tail below is still in Python's buffer
        f.write(buf.getvalue()[100:])
    os.replace(tmp, path)


def _save_final_first(obj, path):
    buf = io.BytesIO()
    torch.save(obj, buf)
    with open(path, "wb") as f:  # the old checkpoint is gone from here on
        f.write(buf.getvalue())
    _save_pathlib_rename(obj, path)


def _save_other_directory(obj, path):
    fd, tmp = tempfile.mkstemp()  # /tmp: maybe another file system
    with os.fdopen(fd, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _save_leaves_part(obj, path):
    # right until a save crashes: then its torn .part file stays, named like the
    # checkpoint
    tmp = path + ".part"
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _sync_dir(path)


def _save_swallows_crash(obj, path):
    try:
        _save_pathlib_rename(obj, path)
    except Exception:  # the caller never learns the checkpoint was not written
        pass


def _save_private(obj, path):
    # mkstemp's file is 0600, renamed as it is: nobody else can read the checkpoint
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)))
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        os.unlink(tmp)
        raise
    os.replace(tmp, path)
    _sync_dir(path)


def _save_umask_zero(obj, path):
    os.umask(0)  # meant to be put back, never is
    _save_pathlib_rename(obj, path)


def _save_fd_left_open(obj, path):
    _save_pathlib_rename(obj, path)
    os.fsync(os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY))  # never closed


@pytest.mark.parametrize("save", [_save_pathlib_rename, _save_fdatasync])
def test_atomic_save_accepts_path_rename_and_fdatasync(save, capsys) -> None:
    check_atomic_save(save)
    assert "Correct" in capsys.readouterr().out


@pytest.mark.parametrize("save, message", [
    (_save_onto_itself, "renamed onto itself"),
    (_save_fsync_after_rename, "not fsynced"),
    (_save_unflushed, "not fsynced, with its data flushed"),
    (_save_final_first, "final path was written before the rename"),
    (_save_other_directory, "not in the checkpoint's directory"),
    (_save_no_directory_sync, "directory was not fsynced after the rename"),
    (_save_directory_synced_first, "directory was not fsynced after the rename"),
    (_save_leaves_part, r"crashed in the middle left \['step00000001.pt.part'\]"),
    (_save_swallows_crash, "returned as if it had worked"),
    (_save_private, "permissions are 0o600"),
    (_save_umask_zero, "left the process's umask at 0o0"),
    (_save_fd_left_open, "left 1 file descriptor"),
])
def test_atomic_save_rejects(save, message) -> None:
    umask = os.umask(0o022)
    try:
        with pytest.raises(WrongAnswer, match=message):
            check_atomic_save(save)
    finally:
        os.umask(umask)


# ---- Chapter 9: a sharded save and resume on 2 ranks ----

def _dcp_save(model, optimizer, directory):
    msd, osd = get_state_dict(model, optimizer)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=directory)


def _dcp_load(model, optimizer, directory):
    msd, osd = get_state_dict(model, optimizer)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=directory)
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])


def _dcp_model_only(model, optimizer, directory):
    dcp.save({"model": get_state_dict(model, optimizer)[0]}, checkpoint_id=directory)


def _dcp_load_model_only(model, optimizer, directory):
    state = {"model": get_model_state_dict(model)}
    dcp.load(state, checkpoint_id=directory)
    set_model_state_dict(model, state["model"])


def _per_rank_save(model, optimizer, directory):
    os.makedirs(directory, exist_ok=True)
    torch.save({"m": model.state_dict(), "o": optimizer.state_dict()},
               os.path.join(directory, f"rank{dist.get_rank()}.pt"))


def _per_rank_load(model, optimizer, directory):
    state = torch.load(os.path.join(directory, f"rank{dist.get_rank()}.pt"),
                       weights_only=False)
    model.load_state_dict(state["m"])
    optimizer.load_state_dict(state["o"])


def _load_without_set(model, optimizer, directory):
    msd, osd = get_state_dict(model, optimizer)
    state = {"model": {k: v.clone() for k, v in msd.items()}, "optim": osd}
    dcp.load(state, checkpoint_id=directory)  # fills copies the model never sees


@pytest.fixture(scope="module")
def sharded_verdicts():
    """One 2-rank launch judges every answer that does not raise."""
    answers = {"dcp": (_dcp_save, _dcp_load),
               "model_only": (_dcp_model_only, _dcp_load_model_only),
               "per_rank": (_per_rank_save, _per_rank_load),
               "not_set": (_dcp_save, _load_without_set),
               "rank0": (_rank0_save, _rank0_load)}
    # the checker's 2 steps, saved after 1: AdamW has moments to lose, the launch
    # stays short
    return dict(zip(answers, judge_sharded_resume(list(answers.values()))))


def test_sharded_resume_accepts_dcp(sharded_verdicts) -> None:
    assert sharded_verdicts["dcp"] is None


@pytest.mark.parametrize("name, message", [
    ("model_only", "resumed run is not the uninterrupted one"),
    ("per_rank", "one process cannot read the checkpoint's model back"),
    ("not_set", "weights are not the saved ones"),
    ("rank0", "weights are not the saved ones"),
])
def test_sharded_resume_rejects(sharded_verdicts, name, message) -> None:
    assert sharded_verdicts[name] is not None
    assert message in str(sharded_verdicts[name])


def _rank0_save(model, optimizer, directory):
    os.makedirs(directory, exist_ok=True)
    if dist.get_rank() == 0:  # ERRATA 40: rank 0 writes only the shards it holds
        torch.save({n: p.to_local() for n, p in model.named_parameters()},
                   os.path.join(directory, "model.pt"))
    dist.barrier()


def _rank0_load(model, optimizer, directory):
    saved = torch.load(os.path.join(directory, "model.pt"), weights_only=True)
    with torch.no_grad():  # every rank gets rank 0's shards
        for n, p in model.named_parameters():
            p.to_local().copy_(saved[n])


def test_sharded_resume_checker_raises_the_verdict(monkeypatch, capsys) -> None:
    """The checker is the judge's verdict on one answer (no launch here)."""
    import dtlib.exercises.checkpoint as ckpt

    monkeypatch.setattr(ckpt, "judge_sharded_resume",
                        lambda answers, *a: [WrongAnswer("the resumed run differs")])
    with pytest.raises(WrongAnswer, match="the resumed run differs"):
        check_sharded_resume(_dcp_save, _dcp_load)
    monkeypatch.setattr(ckpt, "judge_sharded_resume", lambda answers, *a: [None])
    check_sharded_resume(_dcp_save, _dcp_load)
    assert "Correct" in capsys.readouterr().out
