"""Checkers for Chapter 9, "Checkpointing and resume".

Both checkers run the learner's answer for real: the chosen state keys through a real
crash-and-resume, the save function on real files with a real crash in the middle.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any, Callable, Iterable
from unittest import mock

import torch

from dtlib.checkpoint.state import STATE_KEYS
from dtlib.chapters.ch09_checkpointing.runs import (CrashDuringSave, SimulatedCrash,
                                                    train_run)
from dtlib.exercises import WrongAnswer, checker, passed

_STRAIGHT: dict[int, torch.Tensor] = {}


@checker
def check_resume_keys(keys: Iterable[str], total_steps: int = 10,
                      stop_at: int = 7) -> None:
    """Check that restoring only ``keys`` (from :data:`dtlib.checkpoint.STATE_KEYS`)
    resumes :func:`dtlib.chapters.ch09_checkpointing.runs.train_run` bit for bit.

    The run is trained ``total_steps`` straight, and again with a crash after
    ``stop_at`` steps and a resume that restores ``keys`` only.
    """
    keys = set(keys)
    unknown = keys - set(STATE_KEYS)
    if unknown:
        raise WrongAnswer(f"unknown keys {sorted(unknown)}; choose from {STATE_KEYS}")
    if total_steps not in _STRAIGHT:
        _STRAIGHT[total_steps] = train_run(total_steps)["params"]
    straight = _STRAIGHT[total_steps]
    with tempfile.TemporaryDirectory() as d:
        train_run(total_steps, d, save_every=stop_at, stop_at=stop_at)
        resumed = train_run(total_steps, d, resume=True, restore=keys)["params"]
    if not torch.equal(straight, resumed):
        diff = (straight - resumed).abs().max().item()
        raise WrongAnswer(
            f"restoring {sorted(keys)} gives a different run: the final parameters "
            f"differ by up to {diff:.3g}. Hint: list everything a training step reads "
            "that changes from step to step: the weights, what the optimizer "
            "remembers, the learning rate's schedule, which samples come next, and "
            "every random generator that dropout, cropping and noise draw from.")
    passed(f"restoring {sorted(keys)} resumes the run bit for bit")


@checker
def check_atomic_save(save: Callable[[Any, str], Any]) -> None:
    """Check ``save(obj, path)``: afterwards ``path`` holds ``obj``; a crash during the
    write leaves the previous ``path`` intact; the temporary file is fsynced, lives
    in ``path``'s directory and is moved into place by a rename (``os.replace``, or
    ``os.rename``, which POSIX also makes atomic; ``Path.replace``/``Path.rename`` call
    them)."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "step00000001.pt")
        good = {"step": 1, "w": torch.arange(6.0)}
        replaced: list[tuple[str, str]] = []
        synced: list[int] = []
        real_replace, real_rename, real_fsync = os.replace, os.rename, os.fsync

        def spy_replace(src: Any, dst: Any, *a: Any, **k: Any) -> None:
            replaced.append((os.fspath(src), os.fspath(dst)))
            real_replace(src, dst, *a, **k)

        def spy_rename(src: Any, dst: Any, *a: Any, **k: Any) -> None:
            replaced.append((os.fspath(src), os.fspath(dst)))
            real_rename(src, dst, *a, **k)

        def spy_fsync(fd: int) -> None:
            synced.append(fd)
            real_fsync(fd)

        with mock.patch("os.replace", spy_replace), \
                mock.patch("os.rename", spy_rename), \
                mock.patch("os.fsync", spy_fsync):
            save(good, path)
        try:
            back = torch.load(path, weights_only=True)
        except Exception as exc:
            raise WrongAnswer(f"after save(obj, path), torch.load(path, weights_only="
                              f"True) fails: {exc!r}") from None
        if back["step"] != 1 or not torch.equal(back["w"], good["w"]):
            raise WrongAnswer("the file at path does not hold the object saved")
        try:
            save({"step": 2, "w": torch.zeros(6), "x": CrashDuringSave()}, path)
        except SimulatedCrash:
            pass
        try:
            after = torch.load(path, weights_only=True)
        except Exception as exc:
            raise WrongAnswer(
                "a crash in the middle of save() destroyed the previous checkpoint: "
                f"loading it now fails with {type(exc).__name__}. Hint: never open the "
                "final path for writing; write elsewhere, then rename.") from None
        if after["step"] != 1:
            raise WrongAnswer(
                "after a crashed save, path no longer holds the old state")
        if not any(dst == path for _, dst in replaced):
            raise WrongAnswer("path was not put in place by a rename "
                              "(os.replace(tmp, path) or os.rename(tmp, path))")
        src = next(s for s, dst in replaced if dst == path)
        if os.path.dirname(os.path.abspath(src)) != os.path.dirname(path):
            raise WrongAnswer(
                f"the temporary file {src} is not in the checkpoint's directory: "
                "os.replace is atomic only within one file system")
        if not synced:
            raise WrongAnswer("os.fsync was never called: after a power cut the "
                              "renamed file may be empty. Flush and fsync before "
                              "os.replace.")
    passed("save() is atomic: the old checkpoint survives a crash mid-write")
