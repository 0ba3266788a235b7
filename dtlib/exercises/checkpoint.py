"""Checkers for Chapter 9, "Checkpointing and resume".

Both checkers run the learner's answer for real: the chosen state keys through a real
crash-and-resume, the save function on real files with a real crash in the middle.
"""

from __future__ import annotations

import hashlib
import os
import stat
import tempfile
from typing import Any, Callable, Iterable
from unittest import mock

import torch

from dtlib.checkpoint.drill import (CrashDuringSave, SimulatedCrash, fsdp_model,
                                    fsdp_train, train_run)
from dtlib.checkpoint.sharded import dcp_load_full
from dtlib.checkpoint.state import STATE_KEYS
from dtlib.exercises import WrongAnswer, checker, passed
from dtlib.models.run import full_tensor
from dtlib.runtime import launch
from dtlib.runtime.i18n import N_, _

_STRAIGHT: dict[int, torch.Tensor] = {}


@checker
def check_resume_keys(keys: Iterable[str], total_steps: int = 10,
                      stop_at: int = 3) -> None:
    """Check that restoring only ``keys`` (from :data:`dtlib.checkpoint.STATE_KEYS`)
    resumes :func:`dtlib.checkpoint.drill.train_run` bit for bit.

    The run is trained ``total_steps`` straight, and again with a crash after
    ``stop_at`` steps and a resume that restores ``keys`` only. The crash comes
    inside the first epoch (the chapter's comes after 7 steps, in the second): every
    key but ``rng_cuda`` changes the run there too.
    """
    keys = set(keys)
    unknown = keys - set(STATE_KEYS)
    if unknown:
        raise WrongAnswer(_("unknown keys {unknown}; choose from {state_keys}").format(
                              unknown=sorted(unknown), state_keys=STATE_KEYS))
    if total_steps not in _STRAIGHT:
        _STRAIGHT[total_steps] = train_run(total_steps)["params"]
    straight = _STRAIGHT[total_steps]
    with tempfile.TemporaryDirectory() as d:
        train_run(total_steps, d, save_every=stop_at, stop_at=stop_at)
        resumed = train_run(total_steps, d, resume=True, restore=keys)["params"]
    if not torch.equal(straight, resumed):
        diff = (straight - resumed).abs().max().item()
        raise WrongAnswer(
            _("restoring {keys} gives a different run: the final parameters differ by "
              "up to {diff:.3g}. Hint: list everything a training step reads that "
              "changes from step to step: the weights, what the optimizer remembers, "
              "the learning rate's schedule, which samples come next, and every "
              "random generator that dropout, cropping and noise draw from.").format(
                keys=sorted(keys), diff=diff))
    passed(_("restoring {keys} resumes the run bit for bit").format(keys=sorted(keys)))


def _digest(path: str) -> str | None:
    """SHA-256 of the file at ``path``, None when there is none."""
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except FileNotFoundError:
        return None


def _fingerprint(st: os.stat_result) -> tuple[int, int, int, int]:
    """What changes when a file is written: its identity, size and modification."""
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def _watched_save(save: Callable[[Any, str], Any], obj: Any, path: str
                  ) -> list[str]:
    """Run ``save(obj, path)`` with ``os.fsync``, ``os.replace`` and ``os.rename``
    watched; return what is wrong with how it put ``path`` in place (empty: nothing).

    At each rename onto ``path`` the source must be another file in ``path``'s
    directory, fsynced as it is now (same inode, size and modification time: nothing
    written after the fsync, the buffer flushed before it), and ``path`` must still
    hold what it held before the save began (the old checkpoint never opened). After
    the rename the directory itself must be fsynced, or the rename may not survive a
    power cut. ``os.fdatasync`` counts as an fsync wherever ``os.fsync`` does.
    """
    before = _digest(path)
    synced: set[tuple[int, int, int, int]] = set()
    problems: list[str] = []
    onto_path = []
    real_replace, real_rename, real_fsync = os.replace, os.rename, os.fsync
    real_fdatasync = getattr(os, "fdatasync", os.fsync)
    folder = os.stat(os.path.dirname(os.path.abspath(path)))
    dir_synced = [False]  # the directory fsynced after the (last) rename onto path

    def note_sync(fd: int) -> None:
        st = os.fstat(fd)
        synced.add(_fingerprint(st))
        if stat.S_ISDIR(st.st_mode) and onto_path and \
                (st.st_dev, st.st_ino) == (folder.st_dev, folder.st_ino):
            dir_synced[0] = True

    def spy_fsync(fd: int) -> None:
        real_fsync(fd)
        note_sync(fd)

    def spy_fdatasync(fd: int) -> None:
        real_fdatasync(fd)
        note_sync(fd)

    def judge(src: Any, dst: Any) -> None:
        src, dst = os.path.abspath(os.fspath(src)), os.path.abspath(os.fspath(dst))
        if dst != os.path.abspath(path):
            return
        onto_path.append(src)
        dir_synced[0] = False
        if src == dst:
            problems.append(_("path was renamed onto itself: the data went straight "
                              "into the final file, so a crash tears it"))
        elif os.path.dirname(src) != os.path.dirname(dst):
            problems.append(_("the temporary file {src} is not in the checkpoint's "
                              "directory: os.replace is atomic only within one file "
                              "system").format(src=src))
        elif os.path.exists(src) and _fingerprint(os.stat(src)) not in synced:
            problems.append(_("the temporary file was not fsynced, with its data "
                              "flushed, before the rename (an fsync after the rename, "
                              "or before the last write, leaves a power cut free to "
                              "empty the new checkpoint)"))
        if _digest(dst) != before:
            problems.append(_("the final path was written before the rename: the old "
                              "checkpoint was already gone while the new one was "
                              "being written"))

    def spy_replace(src: Any, dst: Any, *a: Any, **k: Any) -> None:
        judge(src, dst)
        real_replace(src, dst, *a, **k)

    def spy_rename(src: Any, dst: Any, *a: Any, **k: Any) -> None:
        judge(src, dst)
        real_rename(src, dst, *a, **k)

    with mock.patch("os.replace", spy_replace), \
            mock.patch("os.rename", spy_rename), \
            mock.patch("os.fsync", spy_fsync), \
            mock.patch("os.fdatasync", spy_fdatasync, create=True):
        save(obj, path)
    if not onto_path:
        problems.append(_("path was not put in place by a rename (os.replace(tmp, "
                          "path) or os.rename(tmp, path))"))
    elif not problems and not dir_synced[0]:
        problems.append(_("the directory was not fsynced after the rename: the rename "
                          "is a change to the directory, and until the directory is "
                          "on disk a power cut can undo it"))
    return problems


def _open_fds() -> set[str] | None:
    """This process's open file descriptors (None where /proc cannot tell)."""
    try:
        return set(os.listdir("/proc/self/fd"))
    except OSError:
        return None


def _side_effects(umask: int, fds: set[str] | None, path: str) -> list[str]:
    """What ``save`` changed besides ``path``: the umask, descriptors left open, and
    the checkpoint's permissions (a plain ``open(path, "wb")`` gives ``0o666`` less
    the umask; ``mkstemp`` makes its file ``0o600``)."""
    problems = []
    now = os.umask(umask)
    if now != umask:
        problems.append(_("save() left the process's umask at {now:#o} (it was "
                          "{umask:#o}): put back what os.umask returned").format(
                            now=now, umask=umask))
    after = _open_fds()
    if fds is not None and after is not None and len(after - fds) > 0:
        problems.append(_("save() left {n_value} file descriptor(s) open: close every "
                          "os.open (in a finally), or a long run runs out").format(
                            n_value=len(after - fds)))
    if os.path.exists(path):
        mode = stat.S_IMODE(os.stat(path).st_mode)
        want = 0o666 & ~umask
        if mode != want:
            problems.append(_("the checkpoint's permissions are {mode:#o}, where a "
                              "plain open(path, 'wb') gives {want:#o} (0o666 less the "
                              "umask): mkstemp makes its file private, so chmod it "
                              "before the rename").format(mode=mode, want=want))
    return problems


#: What ``check_atomic_save`` switches off while the learner's function runs.
_ATOMIC_SAVE_FORBIDS = {
    'dtlib.checkpoint.state:atomic_save': N_("the book's own atomic save"),
    'dtlib.checkpoint.state:save_checkpoint': N_("the book's own save"),
}


@checker(forbids=_ATOMIC_SAVE_FORBIDS)
def check_atomic_save(save: Callable[[Any, str], Any]) -> None:
    """Check ``save(obj, path)``: afterwards ``path`` holds ``obj``; a crash during the
    write leaves the previous ``path`` intact; the data goes to a temporary file in
    ``path``'s directory (never to ``path`` itself), flushed and fsynced, which a
    rename then moves onto ``path`` (``os.replace``, or ``os.rename``, which POSIX also
    makes atomic; ``Path.replace``/``Path.rename`` call them), after which the directory
    is fsynced (``os.fsync`` or ``os.fdatasync``). Saves onto a new path and onto an
    existing one, with tensors of two sizes. A save leaves nothing else changed: the
    umask, no descriptor left open, the file with the permissions ``open`` would give
    it; a crashed save raises and leaves no file behind."""
    umask = os.umask(0o022)
    os.umask(umask)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "step00000001.pt")
        for step, numel in ((1, 6), (2, 1 << 16)):  # a new file, then over it
            good = {"step": step, "w": torch.arange(float(numel))}
            fds = _open_fds()
            problems = _watched_save(save, good, path)
            problems += _side_effects(umask, fds, path)
            if problems:
                raise WrongAnswer(f"save #{step}: " + "; ".join(problems) + ".",
                                  _("write to tempfile.mkstemp(dir=<path's "
                                    "directory>), flush, os.fsync, os.replace(tmp, "
                                    "path), then fsync the directory (os.open(dir, "
                                    "os.O_RDONLY))"))
            try:
                back = torch.load(path, weights_only=True)
            except Exception as exc:
                raise WrongAnswer(_("after save(obj, path), torch.load(path, "
                                    "weights_only=True) fails: {exc!r}").format(
                                      exc=exc)) from None
            if back["step"] != step or not torch.equal(back["w"], good["w"]):
                raise WrongAnswer(_("the file at path does not hold the object saved"))
        try:
            save({"step": 3, "w": torch.zeros(6), "x": CrashDuringSave()}, path)
        except SimulatedCrash:
            pass
        else:
            raise WrongAnswer(
                _("a save that crashed in the middle returned as if it had worked: "
                  "the caller believes a checkpoint was written."), _(
                          "clean up in `except BaseException:`, then `raise` the "
                          "error again"))
        left = sorted(set(os.listdir(d)) - {os.path.basename(path)})
        if left:
            raise WrongAnswer(
                _("a save that crashed in the middle left {left} behind in the "
                  "checkpoint's directory: every crash leaves one more file, and one "
                  "named like a checkpoint is a torn checkpoint for whoever "
                  "resumes.").format(left=left),
                _("remove the temporary file when the write fails (os.unlink in "
                  "`except BaseException:`), then raise again"))
        try:
            after = torch.load(path, weights_only=True)
        except Exception as exc:
            raise WrongAnswer(
                _("a crash in the middle of save() destroyed the previous checkpoint: "
                  "loading it now fails with {type}. Hint: never open the final path "
                  "for writing; write elsewhere, then rename.").format(
                    type=type(exc).__name__)) from None
        if after["step"] != 2:
            raise WrongAnswer(
                _("after a crashed save, path no longer holds the old state"))
    passed(_("save() is atomic: the old checkpoint survives a crash mid-write"))


# ---- build it: a sharded save and resume of a 2-rank FSDP2 run ----------------------

def _full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter gathered whole (a collective on every rank)."""
    return {n: full_tensor(p.detach()).cpu().clone()
            for n, p in model.named_parameters()}


def _sharded_resume_on_rank(answers: list[tuple[Callable[..., Any], ...]],
                            root: str, total: int, stop: int) -> list[dict[str, Any]]:
    """On every rank: the uninterrupted run, then per answer a run saved by the
    learner's ``save`` after ``stop`` steps, loaded by its ``load`` into a fresh job
    with other weights and an empty optimizer, and trained to ``total``."""
    par, model, opt = fsdp_model(seed=0)
    fsdp_train(par, model, opt, 0, total)
    straight = _full_params(model)
    out = []
    for i, (save, load) in enumerate(answers):
        directory = os.path.join(root, f"answer{i}")
        par, model, opt = fsdp_model(seed=0)
        fsdp_train(par, model, opt, 0, stop)
        saved = _full_params(model)
        save(model, opt, directory)
        del model, opt  # the job "crashes": nothing survives but the directory
        par, model, opt = fsdp_model(seed=1)
        load(model, opt, directory)
        loaded = _full_params(model)
        fsdp_train(par, model, opt, stop, total - stop)
        out.append({"straight": straight, "saved": saved, "loaded": loaded,
                    "resumed": _full_params(model), "directory": directory})
    return out


def _one_process_read(directory: str, saved: dict[str, torch.Tensor]
                      ) -> dict[str, torch.Tensor] | str:
    """The model's tensors read back by one process without a process group, as a
    job of another world size would read them, or why that is impossible."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        stored = FileSystemReader(directory).read_metadata().state_dict_metadata
    except Exception as exc:  # no .metadata: not a DCP checkpoint
        return _("it has no DCP metadata ({type})").format(type=type(exc).__name__)
    keys = {}
    for name in saved:
        match = [k for k in stored if k == name or k.endswith("." + name)]
        if len(match) != 1:
            return _("no single entry in it holds the parameter {name!r}").format(
                       name=name)
        keys[match[0]] = name
    template = {k: torch.empty_like(saved[n]) for k, n in keys.items()}
    dcp_load_full(directory, template)
    return {n: template[k] for k, n in keys.items()}


def _first_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]
                      ) -> str | None:
    """The first tensor that is not bit-for-bit equal, with its largest difference."""
    for name in a:
        if name not in b or not torch.equal(a[name], b[name]):
            diff = ((a[name] - b[name]).abs().max().item() if name in b
                    and a[name].shape == b[name].shape else float("nan"))
            return _("{name} (max abs difference {diff:.3g})").format(
                       name=name, diff=diff)
    return None


def _verdict(res: dict[str, Any]) -> WrongAnswer | None:
    """What is wrong with one answer's run (None: nothing)."""
    wrong = _first_difference(res["saved"], res["loaded"])
    if wrong:
        return WrongAnswer(
            _("after load the fresh job's weights are not the saved ones: "
              "{wrong}.").format(wrong=wrong),
            _("a rank holds only its shard: every rank must save and every rank must "
              "load (dcp.save / dcp.load), and the loaded state dict must be put back "
              "into the model (set_state_dict)"))
    read = _one_process_read(res["directory"], res["saved"])
    if isinstance(read, str) or _first_difference(res["saved"], read):
        why = read if isinstance(read, str) else (
            _("its tensors differ: ") + str(_first_difference(res["saved"], read)))
        return WrongAnswer(
            _("one process cannot read the checkpoint's model back: {why}. A "
              "checkpoint that only the same 2 ranks can read cannot resume on "
              "another world size.").format(why=why),
            _("save with torch.distributed.checkpoint (dcp.save), which writes the "
              "global layout of every tensor to .metadata"))
    wrong = _first_difference(res["straight"], res["resumed"])
    if wrong:
        return WrongAnswer(
            _("the weights load, but the resumed run is not the uninterrupted one: "
              "{wrong}.").format(wrong=wrong),
            _("AdamW's moments and step count are training state too: save and load "
              "the optimizer's state dict with the model's"))
    return None


def judge_sharded_resume(answers: list[tuple[Callable[..., Any], Callable[..., Any]]],
                         total_steps: int = 2, stop_at: int = 1
                         ) -> list[WrongAnswer | None]:
    """Run several ``(save, load)`` answers in one 2-rank launch (see
    :func:`check_sharded_resume`) and judge each.

    Args:
        answers: ``(save, load)`` pairs; none may raise (a rank that fails stops
            the launch, and the launch's report becomes the WrongAnswer of all).
        total_steps: steps of the uninterrupted run.
        stop_at: the step after which each answer saves.
    Returns:
        Per answer, the WrongAnswer it earns, or None when it is right.

    Taught in: Chapter 9, "Sharded state".
    """
    if not 0 < stop_at < total_steps:
        raise ValueError(f"stop_at={stop_at} must be in (0, total_steps="
                         f"{total_steps})")
    with tempfile.TemporaryDirectory() as root:
        def rank_main() -> list[dict[str, Any]]:
            return _sharded_resume_on_rank(answers, root, total_steps, stop_at)

        try:
            ranks = launch.spawn(rank_main, 2, timeout=120, stream=False)
        except launch.LaunchError as exc:
            failed = WrongAnswer(
                _("your save or load failed on a rank:\n{exc}").format(exc=exc),
                _("every rank calls get_state_dict(model, optimizer), then "
                  "dcp.save({{'model': ..., 'optim': ...}}, checkpoint_id=directory); "
                  "load builds the same dict from the fresh job, dcp.load(...) fills "
                  "it in place, set_state_dict puts it back"))
            return [failed] * len(answers)
        return [_verdict(res) for res in ranks[0]]


#: What ``check_sharded_resume`` switches off while the learner's function runs.
_SHARDED_RESUME_FORBIDS = {
    'dtlib.checkpoint.sharded:save_sharded': N_("the book's own sharded save"),
    'dtlib.checkpoint.sharded:load_sharded': N_("the book's own sharded load"),
    'dtlib.checkpoint.sharded:load_full': N_("the book's own load"),
    'dtlib.checkpoint.sharded:dcp_load_full': N_("the checker's one-process read"),
    'dtlib.checkpoint.safe_dcp:safe_dcp_load': N_("the book's own load"),
    'dtlib.checkpoint.state:save_checkpoint': N_("the book's own save"),
    'dtlib.checkpoint.state:load_checkpoint': N_("the book's own load"),
}


@checker(forbids=_SHARDED_RESUME_FORBIDS)
def check_sharded_resume(save: Callable[[Any, Any, str], Any],
                         load: Callable[[Any, Any, str], Any], total_steps: int = 2,
                         stop_at: int = 1) -> None:
    """Check ``save(model, optimizer, directory)`` and ``load(model, optimizer,
    directory)`` on 2 real ranks of an FSDP2 job (every parameter and AdamW moment a
    DTensor shard).

    The run trains ``total_steps`` straight; again, saved after ``stop_at`` steps,
    loaded into a fresh job with other weights and an empty optimizer, and trained to
    the end. The loaded weights must be the saved ones, the resumed run the straight
    one, bit for bit, and one process without a process group (a job of another world
    size) must read every parameter back from the directory.
    """
    wrong = judge_sharded_resume([(save, load)], total_steps, stop_at)[0]
    if wrong is not None:
        raise wrong
    passed(_("every rank saves its shards with DCP, a fresh 2-rank job resumes bit "
             "for bit, and one process reads the same checkpoint"))
