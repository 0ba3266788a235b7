"""Watching launched ranks: their output, their deaths, their stacks; and cleaning up.

:mod:`dtlib.runtime.launch` starts processes; this module is what it uses to supervise them:
whole lines of each rank's output with a ``[rank k]`` prefix, the first rank to fail
(not the peers that merely lost their connection to it), where every rank was when a
launch timed out, and killing the whole process tree afterwards.

Taught in: Chapter 0, "Hello, distributed".
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import psutil

from dtlib.runtime import diagnose, worker


def threads_per_rank(nproc: int) -> int:
    """CPU threads each rank may use so ``nproc`` ranks do not oversubscribe the cores."""
    return max(1, (os.cpu_count() or 1) // nproc)


class LaunchError(RuntimeError):
    """A rank failed. ``rank`` is the first failing rank, ``outputs`` every rank's text."""

    def __init__(self, message: str, rank: int | None = None,
                 outputs: dict[int, str] | None = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.outputs = outputs or {}

    def _render_traceback_(self) -> list[str]:
        # IPython shows this instead of the launcher's own frames: in a notebook the
        # message (failing rank, its traceback, or where each rank hung) is the story.
        return [f"{type(self).__name__}: {self}"]


class LaunchTimeout(LaunchError):
    """The launch ran past its timeout; ``report`` says where each rank was."""

    def __init__(self, message: str, report: list[str],
                 outputs: dict[int, str] | None = None) -> None:
        super().__init__(message, None, outputs)
        self.report = report


@dataclass
class LaunchResult:
    """What a finished launch left: exit code, each rank's output, return values."""

    returncode: int
    outputs: dict[int, str]
    wall_s: float
    values: list[Any] = field(default_factory=list)


class Supervisor:
    """Tails per-rank logs, watches processes, and cleans up. Shared by both launchers."""

    def __init__(self, nproc: int, stream: bool, label: str | None) -> None:
        self.nproc = nproc
        self.stream = stream
        self.label = label
        self.log_dir = tempfile.mkdtemp(prefix="dtlib-launch-")
        self._offsets = [0] * nproc
        self._partial = [b""] * nproc
        self.outputs: dict[int, list[str]] = {r: [] for r in range(nproc)}
        self.deaths: dict[int, float] = {}

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(DTLIB_LOG_DIR=self.log_dir, DTLIB_LAUNCHED="1", PYTHONUNBUFFERED="1")
        # Marks every process of this launch, so a test suite can find exactly its own
        # leftovers on a machine where other launches run too.
        env.setdefault("DTLIB_LAUNCH_OWNER", str(os.getpid()))
        env.setdefault("OMP_NUM_THREADS", str(threads_per_rank(self.nproc)))
        return env

    def pump(self, final: bool = False) -> None:
        """Print every complete new line of every rank; on ``final`` the rest too."""
        for r in range(self.nproc):
            path = os.path.join(self.log_dir, f"rank{r}.log")
            try:
                with open(path, "rb") as f:
                    f.seek(self._offsets[r])
                    data = f.read()
            except FileNotFoundError:
                continue
            self._offsets[r] += len(data)
            buf = self._partial[r] + data
            *lines, rest = buf.split(b"\n")
            if final and rest:
                lines, rest = lines + [rest], b""
            self._partial[r] = rest
            for line in lines:
                text = line.decode(errors="replace").rstrip("\r")
                self.outputs[r].append(text)
                if self.stream:
                    print(f"[rank {r}] {text}", flush=True)

    def texts(self) -> dict[int, str]:
        return {r: "\n".join(lines) for r, lines in self.outputs.items()}

    def rank_pids(self) -> dict[int, int]:
        pids = {}
        for r in range(self.nproc):
            try:
                with open(os.path.join(self.log_dir, f"rank{r}.pid")) as f:
                    pid = int(f.read().strip() or 0)
            except (OSError, ValueError):
                continue
            if pid > 0:  # an empty file: the rank is still writing it
                pids[r] = pid
        return pids

    def collect_stacks(self, wait_s: float = 2.0) -> dict[int, str]:
        """Ask every live rank for its Python stack (SIGUSR1, see dtlib.runtime.worker)."""
        pids = {r: p for r, p in self.rank_pids().items() if psutil.pid_exists(p)}
        for pid in pids.values():
            try:
                os.kill(pid, worker.STACK_SIGNAL)
            except OSError:
                pass
        stacks: dict[int, str] = {}
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and len(stacks) < len(pids):
            time.sleep(0.05)
            for r in pids:
                with open(os.path.join(self.log_dir, f"rank{r}.stack")) as f:
                    text = f.read()
                if "File" in text:
                    stacks[r] = text
        time.sleep(0.1)  # let a multi-thread dump finish writing
        for r in stacks:
            with open(os.path.join(self.log_dir, f"rank{r}.stack")) as f:
                stacks[r] = f.read()
        return stacks

    def timeout_error(self, timeout: float, script: str | None) -> LaunchTimeout:
        pids = self.rank_pids()
        stacks = self.collect_stacks()
        report = [
            diagnose.describe_hung_rank(r, stacks.get(r), r in pids and _alive(pids[r]),
                                        script, self.label)
            for r in range(self.nproc)
        ]
        mismatch = diagnose.mismatch_summary(stacks, script)
        msg = (f"launch timed out after {timeout:g} s; the ranks were stopped.\n"
               "Where each rank was:\n  " + "\n  ".join(report) + "\n"
               + (mismatch + "\n" if mismatch else "") + diagnose.HANG_HINT)
        return LaunchTimeout(msg, report, self.texts())

    def failure(self, rank: int | None, cause: str) -> LaunchError:
        texts = self.texts()
        exc = diagnose.read_exception(self.log_dir, rank) if rank is not None else None
        if exc is not None:
            detail = diagnose.tail(exc["traceback"])
        else:
            detail = diagnose.tail(texts.get(rank, "")) if rank is not None else ""
        who = f"rank {rank} failed ({cause})" if rank is not None else f"launch failed ({cause})"
        return LaunchError(f"{who}; the other ranks were stopped.\n{detail}", rank, texts)

    def watch(self) -> None:
        """Note when each rank is first seen dead (to tell cause from echo later)."""
        for r, pid in self.rank_pids().items():
            if r not in self.deaths and not _alive(pid):
                self.deaths[r] = time.time()

    def root_cause_error(self, exit_codes: dict[int, int]) -> LaunchError:
        """The :class:`LaunchError` naming the rank that failed first."""
        self.pump(final=True)
        exceptions = {r: e for r in range(self.nproc)
                      if (e := diagnose.read_exception(self.log_dir, r)) is not None}
        rank, cause = diagnose.root_cause(exceptions, self.deaths, exit_codes)
        return self.failure(rank, cause)

    def close(self) -> None:
        shutil.rmtree(self.log_dir, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def kill_tree(pids: list[int]) -> None:
    """SIGKILL each pid and all its descendants, then reap them.

    torchrun starts each worker in a new session, so killing a process group would miss
    them: the whole tree is listed first, then killed.
    """
    procs: list[psutil.Process] = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            procs += [p, *p.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=5)


