"""Starting ranks from a notebook or a test, and never leaving a hung kernel behind.

Two ways in, one supervisor:

- :func:`torchrun` runs a script (or module) under ``python -m torch.distributed.run
  --standalone``: the real launcher, the one that also runs multi-node and under Slurm.
- :func:`spawn` runs an importable function on each rank and returns what each returned.
  Its processes fork from a server that has already imported torch, so a launch costs
  milliseconds instead of one torch import per rank.

Both stream every rank's output as whole lines prefixed ``[rank k]``, stop on the first
failing rank (naming it and its traceback), and on a timeout first ask every rank where it
is (see :mod:`dtlib.worker`), then kill the whole process tree and raise
:class:`LaunchTimeout` with that report.

Taught in: Chapter 0, "Hello, distributed".
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import psutil
import torch

from dtlib import diagnose, worker

#: Ranks on a machine without GPUs. Four is the smallest world where ring, tree and
#: sharding patterns are not degenerate; gloo ranks spend most time waiting for each
#: other, so four processes on two cores run fine with one thread each.
CPU_NPROC = 4
DEFAULT_TIMEOUT_S = 120.0
_POLL_S = 0.02


def default_nproc() -> int:
    """One rank per GPU when there are GPUs, else :data:`CPU_NPROC`."""
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return n if n > 0 else CPU_NPROC


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


class _Supervisor:
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
        """Ask every live rank for its Python stack (SIGUSR1, see dtlib.worker)."""
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


def torchrun(target: str | os.PathLike, *args: str, nproc: int | None = None,
             timeout: float = DEFAULT_TIMEOUT_S, module: bool = False, stream: bool = True,
             label: str | None = None, env: dict[str, str] | None = None) -> LaunchResult:
    """Run ``target`` on ``nproc`` ranks under torchrun and wait for it.

    Args:
        target: a script path, or a module name with ``module=True``.
        *args: command-line arguments for the script.
        nproc: ranks to start (default :func:`default_nproc`).
        timeout: seconds before every rank is stopped and :class:`LaunchTimeout` raised.
        module: run ``target`` as ``python -m target``.
        stream: print each rank's lines live, prefixed ``[rank k]``.
        label: how to name lines of the script in reports ("cell line 7").
        env: extra environment variables for the ranks.
    Returns:
        A :class:`LaunchResult` (return code 0).
    Raises:
        LaunchError: a rank failed; names it, its cause and its traceback.
        LaunchTimeout: the run did not finish in time; says where each rank was.

    Taught in: Chapter 0.
    """
    nproc = default_nproc() if nproc is None else nproc
    _check_launch_args(nproc, timeout)
    script = None if module else os.path.abspath(os.fspath(target))
    if script is not None and not os.path.isfile(script):
        raise ValueError(f"target={os.fspath(target)!r}: no such script")
    sup = _Supervisor(nproc, stream, label or ("line" if module else
                                               f"{os.path.basename(script)} line"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", "--monitor_interval=0.1",
           "-m", "dtlib.worker", *(["-m", os.fspath(target)] if module else [script]),
           *map(str, args)]
    full_env = {**sup.env(), **(env or {})}
    agent_out: list[str] = []
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env=full_env, start_new_session=True)
    reader = threading.Thread(target=lambda: agent_out.extend(
        line.decode(errors="replace") for line in proc.stdout), daemon=True)
    reader.start()
    try:
        while proc.poll() is None:
            sup.pump()
            sup.watch()
            if time.monotonic() - start > timeout:
                sup.pump()
                raise sup.timeout_error(timeout, script)
            time.sleep(_POLL_S)
        reader.join(timeout=5)
        sup.pump(final=True)
        if proc.returncode != 0:
            codes = diagnose.torchrun_exit_codes("".join(agent_out))
            error = sup.root_cause_error(codes)
            if error.rank is None:
                error = sup.failure(None, f"torchrun {diagnose.exit_cause(proc.returncode)}"
                                    f":\n{diagnose.tail(''.join(agent_out))}")
            raise error
        return LaunchResult(0, sup.texts(), time.monotonic() - start)
    finally:
        # Runs on success, failure, timeout and KeyboardInterrupt alike.
        kill_tree([proc.pid, *sup.rank_pids().values()])
        sup.close()


def _check_launch_args(nproc: int, timeout: float) -> None:
    if not isinstance(nproc, int) or isinstance(nproc, bool) or nproc < 1:
        raise ValueError(f"nproc={nproc!r} must be a positive integer")
    if not (isinstance(timeout, (int, float)) and timeout > 0):
        raise ValueError(f"timeout={timeout!r} must be a positive number of seconds")


# ---- spawn: importable functions, forked from a server that has torch loaded ----------

_CTX: Any = None


def _context() -> Any:
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        # The server imports these once; every rank forks from it with torch loaded.
        _CTX.set_forkserver_preload(["torch", "torch.distributed", "dtlib.launch"])
    return _CTX


def _spawn_entry(fn: Callable[..., Any], rank: int, world_size: int, port: int,
                 log_dir: str, backend: str | None, args: tuple, kwargs: dict,
                 conn: Any) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), DTLIB_LAUNCHED="1")
    worker.prepare(log_dir, rank)
    torch.set_num_threads(threads_per_rank(world_size))
    from dtlib import dist as ddist

    try:
        store = torch.distributed.TCPStore("127.0.0.1", port, world_size, is_master=False)
        ddist.init(backend, store=store)
        value = fn(*args, **kwargs)
        # Plain pickle copies tensors by value. Connection.send would use torch's
        # shared-memory reduction, whose segment dies with this process.
        conn.send_bytes(pickle.dumps(("ok", value)))
    except BaseException as exc:
        worker.record_exception(log_dir, rank, exc)
        conn.send_bytes(pickle.dumps(("error", None)))
        sys.stdout.flush()
        os._exit(1)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    ddist.destroy()


def spawn(fn: Callable[..., Any], world_size: int | None = None, *args: Any,
          timeout: float = DEFAULT_TIMEOUT_S, backend: str | None = None,
          stream: bool = True, **kwargs: Any) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks; return each rank's value.

    Each rank has joined the default process group (``dtlib.dist.init``) before ``fn``
    runs, so ``fn`` may call collectives and ``dtlib.dist.world()`` directly.

    Args:
        fn: a function importable by name (module level, not defined in a notebook:
            use ``%%torchrun`` for cell code).
        world_size: number of ranks (default :func:`default_nproc`).
        timeout: seconds before all ranks are stopped and :class:`LaunchTimeout` raised.
        backend: force ``"gloo"`` or ``"nccl"``.
        stream: print the ranks' output live, prefixed ``[rank k]``.
    Returns:
        ``[value of rank 0, value of rank 1, ...]``.

    Taught in: Chapter 0; the workhorse of the tests.
    """
    world_size = default_nproc() if world_size is None else world_size
    _check_launch_args(world_size, timeout)
    if getattr(fn, "__module__", None) == "__main__" or "<locals>" in getattr(
            fn, "__qualname__", "<locals>"):
        raise ValueError(
            f"fn={getattr(fn, '__qualname__', fn)!r} must be importable (a module-level "
            "function in a .py file); for code written in a notebook cell use %%torchrun")
    try:
        pickle.dumps(fn)
    except Exception as exc:
        raise ValueError(f"fn={fn!r} cannot be sent to the ranks: {exc}") from None
    ctx = _context()
    store = torch.distributed.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    sup = _Supervisor(world_size, stream, None)
    pipes = [ctx.Pipe(duplex=False) for _ in range(world_size)]
    procs = [ctx.Process(target=_spawn_entry, daemon=True,
                         args=(fn, r, world_size, store.port, sup.log_dir, backend,
                               args, kwargs, pipes[r][1])) for r in range(world_size)]
    values: dict[int, Any] = {}
    start = time.monotonic()
    try:
        for p in procs:
            p.start()
        while len(values) < world_size:
            sup.pump()
            failed = False
            for r, (recv, _) in enumerate(pipes):
                if r not in values and recv.poll():
                    status, value = pickle.loads(recv.recv_bytes())
                    failed |= status == "error"
                    if status == "ok":
                        values[r] = value
            for r, p in enumerate(procs):
                if p.exitcode not in (None, 0):
                    sup.deaths.setdefault(r, time.time())
                    failed = True
            if failed:
                time.sleep(0.3)  # let the first failure's echoes land before judging
                codes = {r: p.exitcode for r, p in enumerate(procs)
                         if p.exitcode not in (None, 0)}
                for r in codes:
                    sup.deaths.setdefault(r, time.time())
                raise sup.root_cause_error(codes)
            if time.monotonic() - start > timeout:
                sup.pump()
                raise sup.timeout_error(timeout, None)
            time.sleep(_POLL_S)
        for p in procs:
            p.join(timeout=max(1.0, timeout - (time.monotonic() - start)))
        sup.pump(final=True)
        return [values[r] for r in range(world_size)]
    finally:
        kill_tree([p.pid for p in procs if p.pid is not None and p.exitcode is None])
        sup.close()
        del store

