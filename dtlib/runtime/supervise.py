"""Watching launched ranks: their output, their deaths, their stacks; and cleaning up.

:mod:`dtlib.runtime.launch` starts processes; this module is what it uses to supervise
them: whole lines of each rank's output with a ``[rank k]`` prefix, the first rank to
fail (not the peers that merely lost their connection to it), where every rank was when
a launch timed out, and killing the whole process tree afterwards.

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
from dtlib.runtime.i18n import _


#: Seconds a launch may spend starting (importing torch, joining the world) before its
#: timeout starts counting. See :meth:`Supervisor.past_deadline`.
STARTUP_S = 60.0


def threads_per_rank(nproc: int) -> int:
    """CPU threads each rank may use so ``nproc`` ranks do not oversubscribe the
    cores."""
    return max(1, (os.cpu_count() or 1) // nproc)


class LaunchError(RuntimeError):
    """A rank failed. ``rank`` is the first failing rank, ``outputs`` every rank's
    text."""

    def __init__(self, message: str, rank: int | None = None,
                 outputs: dict[int, str] | None = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.outputs = outputs or {}

    def _render_traceback_(self) -> list[str]:
        # IPython shows this instead of the launcher's own frames: in a notebook the
        # message (failing rank, its traceback, or where each rank hung) is the story.
        return [f"{type(self).__name__}: {self}"]


class CollectiveMismatch(LaunchError):
    """Some ranks finished while others waited in a collective they never called.

    ``finished`` lists the ranks that returned normally; ``report`` says where each
    rank was. No rank is to blame by itself, so ``rank`` is None.
    """

    def __init__(self, message: str, report: list[str], finished: list[int],
                 outputs: dict[int, str] | None = None) -> None:
        super().__init__(message, None, outputs)
        self.report = report
        self.finished = finished


class LaunchTimeout(LaunchError):
    """The launch ran past its timeout; ``report`` says where each rank was.

    ``startup_s`` is how long the ranks took from the launch until every one had
    joined the world (the moment the timeout counts from), None if some never did.
    """

    def __init__(self, message: str, report: list[str],
                 outputs: dict[int, str] | None = None,
                 startup_s: float | None = None) -> None:
        super().__init__(message, None, outputs)
        self.report = report
        self.startup_s = startup_s


@dataclass
class LaunchResult:
    """What a finished launch left: exit code, each rank's output, return values."""

    returncode: int
    outputs: dict[int, str]
    wall_s: float
    values: list[Any] = field(default_factory=list)


class Supervisor:
    """Tails per-rank logs, watches processes, and cleans up. Shared by both
    launchers."""

    def __init__(self, nproc: int, stream: bool, label: str | None,
                 script: str | None = None) -> None:
        self.nproc = nproc
        self.script = script  # the launched script (None: the caller's own code)
        self.stream = stream
        self.label = label
        self.log_dir = tempfile.mkdtemp(prefix="dtlib-launch-")
        # Ranks end themselves when this process is gone (worker._exit_with_launcher).
        with open(os.path.join(self.log_dir, worker.LAUNCHER_PID), "w") as f:
            f.write(str(os.getpid()))
        self._offsets = [0] * nproc
        self._partial = [b""] * nproc
        self.outputs: dict[int, list[str]] = {r: [] for r in range(nproc)}
        self.deaths: dict[int, float] = {}
        self.start = time.monotonic()
        self.joined_at: float | None = None  # when every rank had joined the world

    def past_deadline(self, timeout: float) -> bool:
        """Whether the launch has run out of time.

        The ``timeout`` seconds count from the moment every rank has joined the world
        (each writes ``rank{k}.joined``: ``dtlib.runtime.dist.init`` does, and so does
        the worker once it sees a group made by torch's own ``init_process_group``):
        how long a rank takes to import torch and meet its peers depends on the
        machine and its load, and must not eat into the time a reader gives a
        collective. Start-up itself gets up to ``STARTUP_S`` more; a script that never
        joins a process group therefore has ``STARTUP_S + timeout`` in all.
        """
        now = time.monotonic()
        if self.joined_at is None and all(
                os.path.exists(os.path.join(self.log_dir, f"rank{r}.joined"))
                for r in range(self.nproc)):
            self.joined_at = now
        began = self.start + STARTUP_S if self.joined_at is None else min(
            self.joined_at, self.start + STARTUP_S)
        return now - began > timeout

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
        """Ask every live rank for its Python stack (SIGUSR1, see
        dtlib.runtime.worker)."""
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

    def results(self) -> list[Any]:
        """Each rank's ``result`` variable (see ``worker.record_result``), or None."""
        import pickle

        values: list[Any] = []
        for r in range(self.nproc):
            try:
                with open(os.path.join(self.log_dir, f"rank{r}.result"), "rb") as f:
                    values.append(pickle.load(f))
            except (OSError, EOFError, pickle.UnpicklingError):
                values.append(None)
        return values

    def finished(self) -> set[int]:
        """Ranks whose program returned normally (see ``worker.record_finish``)."""
        return {r for r in range(self.nproc)
                if os.path.exists(os.path.join(self.log_dir, f"rank{r}.done"))}

    def settled_with_error(self) -> bool:
        """Every rank has either finished or recorded an exception, and one raised.

        Then the outcome is known: the launcher need not wait for torchrun's agent to
        notice (a rank whose collective failed can take many seconds to exit).
        """
        records = [os.path.exists(os.path.join(self.log_dir, f"rank{r}.{kind}"))
                   for r in range(self.nproc) for kind in ("done", "exc")]
        done, exc = records[0::2], records[1::2]
        return any(exc) and all(d or e for d, e in zip(done, exc))

    def where_each_rank_is(self, script: str | None,
                           wait_s: float = 2.0) -> tuple[list[str], dict[int, str]]:
        """One line per rank saying where it is now, and the stacks behind them."""
        pids = self.rank_pids()
        stacks = self.collect_stacks(wait_s)
        finished = self.finished()
        exceptions = {r: e for r in range(self.nproc)
                      if (e := diagnose.read_exception(self.log_dir, r)) is not None}
        frames = [diagnose.parse_stack(t) for t in stacks.values()] + [
            [diagnose.exception_frames(e)] for e in exceptions.values()]
        awaited = next((c for threads in frames
                        if (c := diagnose.where(threads, script)[1])), None)
        report = []
        for r in range(self.nproc):
            alive = r in pids and _alive(pids[r])
            exc = exceptions.get(r)
            if not alive and r not in finished and exc is not None:
                report.append(
                    diagnose.describe_raised_rank(r, exc, script, self.label)[0])
                continue
            report.append(diagnose.describe_hung_rank(
                r, stacks.get(r), alive, script, self.label, finished=r in finished,
                awaited=awaited))
        return report, stacks

    def interrupt_report(self, script: str | None) -> str:
        """Where each rank was when the reader interrupted the launch."""
        report, _stacks = self.where_each_rank_is(script, wait_s=1.0)
        return (_("Interrupted.") + " " + _("Where each rank was:") + "\n  "
                + "\n  ".join(report))

    def timeout_error(self, timeout: float, script: str | None) -> LaunchTimeout:
        report, stacks = self.where_each_rank_is(script)
        mismatch = diagnose.mismatch_summary(stacks, script)
        if self.joined_at is not None:
            msg = _("launch timed out {timeout:g} s after every rank had joined the "
                    "world; the ranks were stopped.").format(timeout=timeout)
        else:
            msg = _("launch timed out {timeout:g} s after {startup:g} s of start-up "
                    "(not every rank joined); the ranks were stopped.").format(
                        timeout=timeout, startup=STARTUP_S)
        msg += ("\n" + _("Where each rank was:") + "\n  " + "\n  ".join(report) + "\n"
                + (mismatch + "\n" if mismatch else "") + _(diagnose.HANG_HINT))
        startup_s = None if self.joined_at is None else self.joined_at - self.start
        return LaunchTimeout(msg, report, self.texts(), startup_s)

    def failure(self, rank: int | None, cause: str) -> LaunchError:
        texts = self.texts()
        exc = diagnose.read_exception(self.log_dir, rank) if rank is not None else None
        if exc is not None:
            detail = diagnose.tail(exc["traceback"])
        else:
            detail = diagnose.tail(texts.get(rank, "")) if rank is not None else ""
        who = (f"rank {rank} failed ({cause})" if rank is not None
               else f"launch failed ({cause})")
        others = self._others(rank) if rank is not None else []
        where = ("\nThe other ranks:\n  " + "\n  ".join(others)) if others else ""
        return LaunchError(f"{who}; the other ranks were stopped.\n{detail}{where}",
                           rank, texts)

    def _others(self, rank: int) -> list[str]:
        """Where the ranks other than ``rank`` were, from what they left behind."""
        finished, lines = self.finished(), []
        for r in range(self.nproc):
            exc = diagnose.read_exception(self.log_dir, r)
            if r == rank:
                continue
            if r in finished:
                lines.append(diagnose.describe_finished_rank(r, None))
            elif exc is not None:
                lines.append(diagnose.describe_raised_rank(r, exc, self.script,
                                                           self.label)[0])
        return lines

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
        finished = self.finished()
        mismatch = diagnose.finished_mismatch(self.nproc, exceptions, finished,
                                              self.script, self.label)
        if mismatch is not None:
            msg, report = mismatch
            return CollectiveMismatch(msg, report, sorted(finished), self.texts())
        # A rank that returned normally is never a death, whatever its exit looked like.
        rank, cause = diagnose.root_cause(
            exceptions, {r: t for r, t in self.deaths.items() if r not in finished},
            {r: c for r, c in exit_codes.items() if r not in finished})
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


