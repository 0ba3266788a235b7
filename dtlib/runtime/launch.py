"""Starting ranks from a notebook or a test, and never leaving a hung kernel behind.

Two ways in, one supervisor:

- :func:`torchrun` runs a script (or module) under ``python -m torch.distributed.run
  --standalone``: the real launcher, the one that also runs multi-node and under Slurm.
- :func:`spawn` runs an importable function on each rank and returns what each returned.
  Its processes fork from a server that has already imported torch, so a launch costs
  milliseconds instead of one torch import per rank. :func:`spawn_script` runs a
  script that way, in torchrun's environment (the ``%%ranks`` cell magic).

Both stream every rank's output as whole lines prefixed ``[rank k]``, stop on the first
failing rank (naming it and its traceback), and on a timeout first ask every rank where
it is (see :mod:`dtlib.runtime.worker`), then kill the whole process tree and raise
:class:`LaunchTimeout` with that report.

Taught in: Chapter 0, "Hello, distributed".
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import runpy
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Iterator

import torch

from dtlib.runtime import diagnose, dist as ddist, worker
from dtlib.runtime.supervise import (CollectiveMismatch, LaunchError, LaunchResult,
                                     LaunchTimeout, Supervisor, kill_tree,
                                     threads_per_rank)

__all__ = ["torchrun", "spawn", "spawn_script", "default_nproc", "LaunchError",
           "LaunchTimeout", "LaunchInterrupted", "CollectiveMismatch",
           "LaunchResult", "kill_tree", "threads_per_rank", "CPU_NPROC",
           "LAUNCH_TIMEOUT_S"]

#: Ranks on a machine without GPUs. Four is the smallest world where ring, tree and
#: sharding patterns are not degenerate; gloo ranks spend most time waiting for each
#: other, so four processes on two cores run fine with one thread each.
CPU_NPROC = 4
#: Seconds a launch's ranks may run once every rank has joined (start-up has its
#: own STARTUP_S); a collective's own limit is dist.COLLECTIVE_TIMEOUT_S.
LAUNCH_TIMEOUT_S = 120.0
_POLL_S = 0.02


def default_nproc() -> int:
    """One rank per GPU when there are GPUs, else :data:`CPU_NPROC`."""
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return n if n > 0 else CPU_NPROC


def torchrun(target: str | os.PathLike, *args: str, nproc: int | None = None,
             timeout: float = LAUNCH_TIMEOUT_S, module: bool = False,
             stream: bool = True, label: str | None = None,
             env: dict[str, str] | None = None) -> LaunchResult:
    """Run ``target`` on ``nproc`` ranks under torchrun and wait for it.

    Args:
        target: a script path, or a module name with ``module=True``.
        *args: command-line arguments for the script.
        nproc: ranks to start (default :func:`default_nproc`).
        timeout: seconds the ranks may run once every rank has joined the world
            (start-up gets up to ``STARTUP_S`` more) before every rank is stopped and
            :class:`LaunchTimeout` raised.
        module: run ``target`` as ``python -m target``.
        stream: print each rank's lines live, prefixed ``[rank k]``.
        label: how to name lines of the script in reports ("cell line 7").
        env: extra environment variables for the ranks.
    Returns:
        A :class:`LaunchResult` (return code 0); ``values[rank]`` is the script's
        top-level ``result`` variable on that rank (None where it has none).
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
    sup = Supervisor(nproc, stream,
                     label or ("line" if module
                               else f"{os.path.basename(script)} line"),
                     script)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", "--monitor_interval=0.1",
           "-m", "dtlib.runtime.worker",
           *(["-m", os.fspath(target)] if module else [script]),
           *map(str, args)]
    full_env = {**sup.env(), **(env or {})}
    agent_out: list[str] = []
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env=full_env, start_new_session=True)
    reader = threading.Thread(target=lambda: agent_out.extend(
        line.decode(errors="replace") for line in proc.stdout), daemon=True)
    reader.start()
    settled_at = None
    try:
        with _interrupt_report(sup, script):
            while proc.poll() is None:
                sup.pump()
                sup.watch()
                if sup.settled_with_error():
                    # Every rank finished or raised: judge now (after the echoes land).
                    settled_at = settled_at or time.monotonic()
                    if time.monotonic() - settled_at > 0.5:
                        raise sup.root_cause_error(
                            diagnose.torchrun_exit_codes("".join(agent_out)))
                if sup.past_deadline(timeout):
                    sup.pump()
                    raise sup.timeout_error(timeout, script)
                time.sleep(_POLL_S)
        reader.join(timeout=5)
        sup.pump(final=True)
        if proc.returncode != 0:
            codes = diagnose.torchrun_exit_codes("".join(agent_out))
            error = sup.root_cause_error(codes)
            if error.rank is None and not isinstance(error, CollectiveMismatch):
                error = sup.failure(None,
                                    f"torchrun {diagnose.exit_cause(proc.returncode)}"
                                    f":\n{diagnose.tail(''.join(agent_out))}")
            raise error
        return LaunchResult(0, sup.texts(), time.monotonic() - start, sup.results())
    finally:
        # Runs on success, failure, timeout and KeyboardInterrupt alike.
        kill_tree([proc.pid, *sup.rank_pids().values()])
        sup.close()


class LaunchInterrupted(KeyboardInterrupt):
    """A launch stopped by an interrupt (Jupyter's stop button, Ctrl-C).

    Still a ``KeyboardInterrupt`` (code that catches one catches this), it carries the
    report of where each rank was, and a notebook shows that report alone: IPython
    renders an exception through its ``_render_traceback_``, so no traceback through
    the launcher's frames follows it.
    """

    def __init__(self, report: str) -> None:
        super().__init__(report)
        self.report = report

    def _render_traceback_(self) -> list[str]:
        return self.report.splitlines()


@contextlib.contextmanager
def _interrupt_report(sup: Supervisor, script: str | None) -> Iterator[None]:
    """On KeyboardInterrupt (Jupyter's stop button), say where each rank was."""
    try:
        yield
    except KeyboardInterrupt:
        try:
            sup.pump()
            report = sup.interrupt_report(script)
        except Exception:  # the report is a courtesy; the interrupt must go through
            report = "Interrupted."
        raise LaunchInterrupted(report) from None


def _check_launch_args(nproc: int, timeout: float) -> None:
    if not isinstance(nproc, int) or isinstance(nproc, bool) or nproc < 1:
        raise ValueError(f"nproc={nproc!r} must be a positive integer")
    if not (isinstance(timeout, (int, float)) and timeout > 0):
        raise ValueError(f"timeout={timeout!r} must be a positive number of seconds")


# ---- spawn: importable functions, forked from a server that has torch loaded ------

_CTX: Any = None

#: What the fork server imports once, so that no rank pays for it again: torch, and the
#: distributed modules the chapters' ranks use. ``torch._dynamo`` is among them because
#: DTensor's first operation imports it (about two seconds of CPU per rank otherwise).
#: A name this torch lacks is skipped by the server.
PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "torch.distributed.tensor",
           "torch.distributed.fsdp", "torch.distributed.checkpoint",
           "torch.distributed.pipelining", "dtlib.runtime.launch", "dtlib.models")


def _context() -> Any:
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        # The server imports these once; every rank forks from it with them loaded.
        _CTX.set_forkserver_preload(list(PRELOAD))
    return _CTX


def _spawn_entry(fn: Callable[..., Any], rank: int, world_size: int, port: int,
                 log_dir: str, backend: str | None, args: tuple, kwargs: dict,
                 conn: Any) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), DTLIB_LAUNCHED="1",
                      DTLIB_LOG_DIR=log_dir)
    worker.prepare(log_dir, rank)
    torch.set_num_threads(threads_per_rank(world_size))

    if fn is _run_script:  # the script's own init() marks the join (_run_script)
        os.environ["DTLIB_JOINED_MARK"] = "group"
    try:
        store = torch.distributed.TCPStore("127.0.0.1", port, world_size,
                                           is_master=False)
        ddist.init(backend, store=store)
        if isinstance(fn, _ByValue):
            fn = fn.load()
        value = fn(*args, **kwargs)
        worker.record_finish(log_dir, rank)
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


class _ByValue:
    """A function serialised with its code (cloudpickle), for ranks that cannot import
    it by name: one defined in a notebook cell, a lambda, a closure."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        import cloudpickle

        diagnose.remember_code(fn)  # so that a hang report can show its lines
        self.name = getattr(fn, "__qualname__", repr(fn))
        try:
            self.payload = cloudpickle.dumps(fn)
        except Exception as exc:
            raise ValueError(
                f"fn={self.name!r} cannot be sent to the ranks: it refers to "
                f"something that cannot be copied into another process ({exc}). "
                "Pass such objects as arguments built on each rank, or move the "
                "function into a .py file"
            ) from None

    def load(self) -> Callable[..., Any]:
        import cloudpickle

        return cloudpickle.loads(self.payload)


def _sendable(fn: Callable[..., Any]) -> Callable[..., Any] | _ByValue:
    """``fn`` itself when the ranks can import it by name, else a copy by value."""
    by_name = getattr(fn, "__module__", None) != "__main__" and "<locals>" not in \
        getattr(fn, "__qualname__", "<locals>") and "<lambda>" not in \
        getattr(fn, "__qualname__", "")
    if by_name:
        try:
            pickle.dumps(fn)
            return fn
        except Exception:
            pass
    return _ByValue(fn)


def spawn(fn: Callable[..., Any], world_size: int | None = None, *args: Any,
          timeout: float = LAUNCH_TIMEOUT_S, backend: str | None = None,
          stream: bool = True, **kwargs: Any) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks; return each rank's value.

    Each rank has joined the default process group (``dtlib.runtime.dist.init``) before
    ``fn`` runs, so ``fn`` may call collectives and ``dtlib.runtime.dist.world()``
    directly.

    Args:
        fn: the function each rank runs. A module-level function of a .py file is
            sent by name; one defined in a notebook cell (or a lambda, a closure) is
            sent by value with cloudpickle, so a learner can edit and rerun it.
        world_size: number of ranks (default :func:`default_nproc`).
        timeout: seconds the ranks may run once every rank has joined the world
            (start-up gets up to ``STARTUP_S`` more) before all ranks are stopped and
            :class:`LaunchTimeout` raised.
        backend: force ``"gloo"`` or ``"nccl"``.
        stream: print the ranks' output live, prefixed ``[rank k]``.
    Returns:
        ``[value of rank 0, value of rank 1, ...]``.

    Taught in: Chapter 0; the workhorse of the tests.
    """
    world_size = default_nproc() if world_size is None else world_size
    _check_launch_args(world_size, timeout)
    if not callable(fn):
        raise ValueError(f"fn={fn!r} is not callable; pass the function each rank runs")
    diagnose.remember_code(args, kwargs)  # functions among them go by value too
    return _spawn(_sendable(fn), world_size, args, kwargs, timeout, backend, stream,
                  Supervisor(world_size, stream, None))[0]


def spawn_script(script: str | os.PathLike, *args: str, nproc: int | None = None,
                 timeout: float = LAUNCH_TIMEOUT_S, stream: bool = True,
                 label: str | None = None) -> LaunchResult:
    """Run the script ``script`` on ``nproc`` ranks forked from the warm server: what
    :func:`torchrun` does with it, without torchrun's start-up.

    Each rank gets torchrun's environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``, ``MASTER_PORT``) and has joined the world before the script
    starts, so the script's own ``dtlib.runtime.dist.init()`` returns that world. The
    script runs as the rank's ``__main__``; what it prints, raises or hangs in is
    reported as under :func:`torchrun`. A torchrun launch pays one torch import per
    rank and one for its agent (seconds each); use :func:`torchrun` where the launcher
    itself is the point (its rendezvous, restarts, the command a cluster runs).

    Args:
        script, *args: the script's path and its command-line arguments.
        nproc, timeout, stream, label: as :func:`torchrun`.
    Returns:
        A :class:`LaunchResult` (return code 0); ``values[rank]`` is the script's
        top-level ``result`` variable on that rank (None where it has none).
    Raises:
        LaunchError, LaunchTimeout: as :func:`torchrun`.

    Taught in: Chapter 0, "When it goes wrong".
    """
    nproc = default_nproc() if nproc is None else nproc
    _check_launch_args(nproc, timeout)
    path = os.path.abspath(os.fspath(script))
    if not os.path.isfile(path):
        raise ValueError(f"script={os.fspath(script)!r}: no such script")
    sup = Supervisor(nproc, stream, label or f"{os.path.basename(path)} line", path)
    values, wall_s = _spawn(_run_script, nproc, (path, tuple(map(str, args))), {},
                            timeout, None, stream, sup)
    return LaunchResult(0, sup.texts(), wall_s, values)


def _run_script(path: str, argv: tuple[str, ...]) -> Any:
    """On a spawned rank: run the script ``path`` as ``__main__``; its ``result``.
    The launch's timeout counts from the script's own ``ddist.init()``, as under
    torchrun (the rank joined the group before, under another mark)."""
    os.environ.pop("DTLIB_JOINED_MARK", None)
    sys.argv = [path, *argv]
    sys.path.insert(0, os.path.dirname(path))
    namespace = runpy.run_path(path, run_name="__main__")
    return namespace.get(worker.RESULT_NAME)


def _spawn(fn: Callable[..., Any] | _ByValue, world_size: int, args: tuple,
           kwargs: dict, timeout: float, backend: str | None, stream: bool,
           sup: Supervisor) -> tuple[list[Any], float]:
    """spawn's launch: (each rank's value, wall seconds); ``sup.script`` names the
    script the ranks run (reports point into it), None for a function."""
    ctx = _context()
    store = torch.distributed.TCPStore("127.0.0.1", 0, None, True,
                                       wait_for_workers=False)
    pipes = [ctx.Pipe(duplex=False) for _ in range(world_size)]
    procs = [ctx.Process(target=_spawn_entry, daemon=True,
                         args=(fn, r, world_size, store.port, sup.log_dir, backend,
                               args, kwargs, pipes[r][1])) for r in range(world_size)]
    values: dict[int, Any] = {}
    start = time.monotonic()
    try:
        for p in procs:
            p.start()
        with _interrupt_report(sup, sup.script):
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
                    # Let the first failure's echoes land before judging.
                    time.sleep(0.3)
                    codes = {r: p.exitcode for r, p in enumerate(procs)
                             if p.exitcode not in (None, 0)}
                    for r in codes:
                        sup.deaths.setdefault(r, time.time())
                    raise sup.root_cause_error(codes)
                if sup.past_deadline(timeout):
                    sup.pump()
                    raise sup.timeout_error(timeout, sup.script)
                time.sleep(_POLL_S)
        for p in procs:
            p.join(timeout=max(1.0, timeout - (time.monotonic() - start)))
        sup.pump(final=True)
        return [values[r] for r in range(world_size)], time.monotonic() - start
    finally:
        kill_tree([p.pid for p in procs if p.pid is not None and p.exitcode is None])
        sup.close()
        del store

