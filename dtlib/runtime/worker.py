"""The first code every launched rank runs, before the reader's script.

``dtlib.runtime.launch`` starts ranks as
``torchrun ... -m dtlib.runtime.worker SCRIPT ARGS`` (and ``spawn`` calls
:func:`prepare` directly). Before handing over to the script it:

- sends the rank's stdout and stderr to one file per rank, so the launcher can print
  whole lines with a ``[rank k]`` prefix instead of bytes from four processes
  interleaved;
- writes its pid, so the launcher can find it among torchrun's children, and ends
  itself if the launcher disappears without stopping it (killed outright);
- registers :mod:`faulthandler` on SIGUSR1: when a launch times out, the launcher sends
  the signal and every rank writes the Python stack it is stuck in. faulthandler was
  chosen over py-spy because it is in the standard library, works without ptrace
  permissions (often denied in containers), and dumps from inside the process even
  while a C++ collective holds the thread (it runs in the signal handler, not at a
  bytecode boundary);
- records an uncaught exception's type, message and frames, so the launcher can name the
  failing rank, its cause and the line it was on without parsing tracebacks;
- sends back the script's top-level ``result`` variable, if any (``rank{k}.result``);
- records a normal finish (``rank{k}.done``), so a rank that exited 0 while its peers
  still waited in a collective is reported as "finished", never as "died";
- and notes when the rank has joined the world (``rank{k}.joined``): a launch's
  timeout counts from the moment every rank has joined, so start-up (importing torch,
  the rendezvous) never eats into it. ``dtlib.runtime.dist.init`` writes the note; a
  script that builds its group with torch's own ``init_process_group`` gets it from
  a thread that watches for the group (:func:`_note_group_join`).
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import runpy
import signal
import sys
import threading
import time
import traceback
from typing import IO

STACK_SIGNAL = signal.SIGUSR1
_keep_open: list[IO[str]] = []  # faulthandler writes to these; they must outlive main


def prepare(log_dir: str, rank: int) -> None:
    """Redirect this process's output to ``log_dir`` and arm the stack dump."""
    fd = os.open(os.path.join(log_dir, f"rank{rank}.log"),
                 os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    stack_file = open(os.path.join(log_dir, f"rank{rank}.stack"), "w")
    _keep_open.append(stack_file)
    faulthandler.register(STACK_SIGNAL, file=stack_file, all_threads=True)
    with open(os.path.join(log_dir, f"rank{rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
    _exit_with_launcher(log_dir)


#: Name of the file in which the launcher leaves its pid (``Supervisor``).
LAUNCHER_PID = "launcher.pid"


def _exit_with_launcher(log_dir: str) -> None:
    """End this rank when the process that launched it is gone.

    The launcher stops its ranks itself on success, failure, timeout and interrupt;
    this covers the case it cannot: a launcher killed outright (a notebook kernel
    restarted, ``kill -9``), whose ranks would otherwise wait in a collective, or
    train on, with nobody to report to.
    """
    try:
        with open(os.path.join(log_dir, LAUNCHER_PID)) as f:
            pid = int(f.read().strip())
    except (OSError, ValueError):
        return

    def watch() -> None:
        while True:
            time.sleep(1.0)
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                os._exit(1)
            except PermissionError:  # alive, but another user's: not ours to judge
                pass

    threading.Thread(target=watch, daemon=True, name="dtlib-launcher-watch").start()


def note_joined(log_dir: str, rank: int, mark: str = "joined") -> None:
    """Write ``rank{k}.{mark}`` in ``log_dir`` unless it is there already.

    The file's existence is the signal (``Supervisor.past_deadline``); creating it
    with ``O_EXCL`` makes it appear in one step and only once, however many callers
    (``dist.init`` and the group watch of :func:`_note_group_join`) get here.
    """
    try:
        fd = os.open(os.path.join(log_dir, f"rank{rank}.{mark}"),
                     os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return
    with os.fdopen(fd, "w") as f:
        f.write("joined\n")


#: Seconds between two looks for a process group made by the script itself.
_GROUP_POLL_S = 0.05


def _note_group_join(log_dir: str, rank: int) -> None:
    """Note the join of a script that calls torch's own ``init_process_group``.

    A thread looks every ``_GROUP_POLL_S`` for a default process group and writes the
    join note once there is one, so the launch's timeout counts from the join however
    the script joined. It never imports torch itself (only looks whether the script
    has), so a rank's start-up costs what the script's own imports cost.
    """
    mark = os.environ.get("DTLIB_JOINED_MARK", "joined")
    noted = os.path.join(log_dir, f"rank{rank}.{mark}")

    def watch() -> None:
        while not os.path.exists(noted):  # dist.init may note it first
            tdist = sys.modules.get("torch.distributed")
            is_initialized = getattr(tdist, "is_initialized", None)
            try:
                joined = is_initialized is not None and is_initialized()
            except Exception:  # torch.distributed still half imported
                joined = False
            if joined:
                with contextlib.suppress(OSError):  # the launch may be over already
                    note_joined(log_dir, rank, mark)
                return
            time.sleep(_GROUP_POLL_S)

    threading.Thread(target=watch, daemon=True, name="dtlib-group-watch").start()


_LAUNCHER_FILES = {__file__, os.path.join(os.path.dirname(__file__), "launch.py")}


def record_exception(log_dir: str, rank: int, exc: BaseException) -> None:
    """Write the exception's type, message and traceback for the launcher to read."""
    # Drop the launcher's own frames (this file, spawn's entry in launch.py, runpy):
    # the reader's code is what matters.
    tb = [fr for fr in traceback.extract_tb(exc.__traceback__)
          if fr.filename not in _LAUNCHER_FILES and "runpy" not in fr.filename]
    text = "Traceback (most recent call last):\n" + "".join(traceback.format_list(tb))
    text += "".join(traceback.format_exception_only(type(exc), exc))
    info = {"type": type(exc).__name__, "message": str(exc), "traceback": text,
            "time": time.time(),
            # outermost first, as in the traceback: where the rank was when it raised
            "frames": [[fr.filename, fr.lineno, fr.name] for fr in tb]}
    with open(os.path.join(log_dir, f"rank{rank}.exc"), "w") as f:
        json.dump(info, f)


#: A script's top-level variable of this name is sent back to the launcher
#: (``LaunchResult.values[rank]``; in a notebook, ``torchrun_result.values``).
RESULT_NAME = "result"


def record_result(log_dir: str, rank: int, value: object) -> None:
    """Pickle this rank's ``result`` for the launcher (its repr if it cannot be)."""
    import pickle

    try:
        data = pickle.dumps(value)
    except Exception:  # a lambda, an open file: the reader still sees what it was
        data = pickle.dumps(repr(value))
    with open(os.path.join(log_dir, f"rank{rank}.result"), "wb") as f:
        f.write(data)


def record_finish(log_dir: str, rank: int) -> None:
    """Note that this rank's program returned normally (exit code 0)."""
    with open(os.path.join(log_dir, f"rank{rank}.done"), "w") as f:
        f.write(repr(time.time()))


def main(argv: list[str]) -> None:
    """Run ``argv[0]`` (a script path, or ``-m module``) as this rank's ``__main__``."""
    if not argv:
        raise SystemExit("usage: python -m dtlib.runtime.worker SCRIPT [ARGS...] "
                         "| -m MODULE [ARGS]")
    log_dir = os.environ.get("DTLIB_LOG_DIR")
    rank = int(os.environ.get("RANK", "0"))
    if log_dir:
        prepare(log_dir, rank)
        _note_group_join(log_dir, rank)
    try:
        if argv[0] == "-m":
            sys.argv = argv[1:]
            namespace = runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
            namespace = runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exc:
        if log_dir:
            if exc.code not in (None, 0):
                record_exception(log_dir, rank, exc)
            else:
                record_finish(log_dir, rank)
        raise
    except BaseException as exc:
        if log_dir:
            record_exception(log_dir, rank, exc)
        raise
    if log_dir:
        if RESULT_NAME in namespace:
            record_result(log_dir, rank, namespace[RESULT_NAME])
        record_finish(log_dir, rank)


if __name__ == "__main__":
    main(sys.argv[1:])
