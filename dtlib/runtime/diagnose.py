"""Reading what ranks left behind: where a hung rank was, and why a rank died.

Used by :mod:`dtlib.runtime.launch` to turn a timeout into "rank 0 waits in all_reduce
at line 7, rank 1 is at line 9 and never joined", and a crash into "rank 2 raised
ValueError".

Taught in: Chapter 0 (the deadlock demo) and Chapter 2 (rank-0-only reduce/gather).
"""

from __future__ import annotations

import json
import linecache
import os
import re
import signal
import sysconfig
from dataclasses import dataclass
from typing import Any

from dtlib.runtime.i18n import N_, _, ngettext

_FRAME = re.compile(r'^\s*File "(?P<file>.+)", line (?P<line>\d+) in (?P<func>.+)$')
_THREAD = re.compile(r"^(Current thread|Thread) 0x[0-9a-f]+|^Stack \(most recent")
_TORCH_DIR = os.path.dirname(os.path.dirname(os.path.abspath(
    __import__("torch").__file__)))  # site-packages (torch and its deps live here)
_STDLIB = os.path.abspath(sysconfig.get_paths()["stdlib"])


@dataclass(frozen=True)
class Frame:
    """One Python frame of a stack dump."""

    file: str
    line: int
    func: str


def parse_stack(text: str) -> list[list[Frame]]:
    """Split a faulthandler dump into threads, each a list of frames, innermost
    first."""
    threads: list[list[Frame]] = []
    for raw in text.splitlines():
        if _THREAD.match(raw):
            threads.append([])
            continue
        m = _FRAME.match(raw)
        if m:
            if not threads:
                threads.append([])
            threads[-1].append(Frame(m["file"], int(m["line"]), m["func"].strip()))
    return [t for t in threads if t]


#: Code without a file that is still the reader's: a function sent by value
#: (cloudpickle), a notebook cell, a learner's answer a checker executes.
_READER_PSEUDO_FILES = ("<dynamic-code>", "<ipython-input", "<cell>", "<your ")
_RUNTIME_DIR = os.path.dirname(os.path.abspath(__file__))


def _is_library(path: str) -> bool:
    if path.startswith(_READER_PSEUDO_FILES):
        return False
    if path.startswith("<"):  # <frozen runpy>, <string>
        return True
    path = os.path.abspath(path)
    # The launcher's own frames (which call the reader's function) are plumbing too.
    return path.startswith((_TORCH_DIR, _STDLIB, _RUNTIME_DIR + os.sep))


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.abspath(a) == os.path.abspath(b)


def where(threads: list[list[Frame]],
          script: str | None) -> tuple[Frame | None, str | None]:
    """The reader's innermost frame and the torch.distributed call below it (if any).

    Args:
        threads: from :func:`parse_stack`.
        script: the launched script; ``None`` picks the innermost frame outside torch
            and the standard library.
    Returns:
        ``(frame, collective)``; ``collective`` is the name of the outermost
        ``torch.distributed`` function called from that frame, e.g. ``"all_reduce"``.
    """
    for frames in threads:
        for i, fr in enumerate(frames):
            mine = _same_file(fr.file, script) if script else not _is_library(fr.file)
            if not mine:
                continue
            deeper = frames[:i]  # innermost first
            names = [f.func for f in deeper
                     if f.file.endswith("distributed_c10d.py")
                     and not f.func.startswith("_")]
            if not names:
                names = [f.func for f in deeper
                         if os.sep + "distributed" + os.sep in f.file
                         and f.func != "wrapper" and not f.func.startswith("_")]
            return fr, (names[-1] if names else None)
    return None, None


# cloudpickle names the file of every function it sends by value "<dynamic-code>" (its
# payload then does not depend on where the function was defined), keeping the line
# numbers. The launcher notes where each such function really lives, so that a report
# shows the reader's own line: function name -> [(file, first line, last line)].
_SENT_CODE: dict[str, list[tuple[str, int, int]]] = {}


def remember_code(*objs: Any) -> None:
    """Note the files of the functions in ``objs`` (and of those they hold: closures,
    defaults, nested functions, containers), which are about to be sent by value.

    Taught in: Chapter 0, "When a rank hangs" (the report names your line).
    """
    seen: set[int] = set()

    def code(c: Any) -> None:
        if id(c) in seen:
            return
        seen.add(id(c))
        lines = [n for _, _, n in c.co_lines() if n is not None] or [c.co_firstlineno]
        entry = (c.co_filename, c.co_firstlineno, max(lines))
        known = _SENT_CODE.setdefault(c.co_name, [])
        if entry not in known:
            known.append(entry)
        for const in c.co_consts:
            if hasattr(const, "co_lines"):
                code(const)

    def visit(obj: Any, depth: int = 0) -> None:
        if depth > 4 or id(obj) in seen:
            return
        if isinstance(obj, (list, tuple, set, frozenset)):
            seen.add(id(obj))
            for item in obj:
                visit(item, depth + 1)
        elif isinstance(obj, dict):
            seen.add(id(obj))
            for item in obj.values():
                visit(item, depth + 1)
        elif hasattr(obj, "__code__") and hasattr(obj, "__closure__"):
            seen.add(id(obj))
            code(obj.__code__)
            for cell in obj.__closure__ or ():
                try:
                    visit(cell.cell_contents, depth + 1)
                except ValueError:  # an empty cell
                    continue
            visit(obj.__defaults__ or (), depth + 1)
            visit(obj.__kwdefaults__ or {}, depth + 1)
        elif hasattr(obj, "func") and hasattr(obj, "args"):  # functools.partial
            seen.add(id(obj))
            visit((obj.func, obj.args, obj.keywords), depth + 1)

    for obj in objs:
        visit(obj)


def remember_source(filename: str, source: str) -> None:
    """Make ``source`` the text of ``filename`` (a pseudo-file such as "<your f>" that
    ranks compile a learner's answer under) for this process's reports.

    Taught in: Chapter 0, "When a rank hangs" (the report names your line).
    """
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)


def _real_file(frame: Frame) -> str:
    if frame.file == "<dynamic-code>":
        for file, first, last in _SENT_CODE.get(frame.func, ()):
            if first <= frame.line <= last:
                return file
    return frame.file


def _source(frame: Frame) -> str:
    return linecache.getline(_real_file(frame), frame.line).strip()


def _place(frame: Frame, label: str | None) -> str:
    if label is None:
        file = _real_file(frame)
        if file.startswith("<your "):  # an answer a checker runs: its own lines
            where_ = _("your `{func}`, line {line}")
        elif os.sep + "ipykernel_" in file:  # a notebook cell's function
            where_ = _("`{func}`, cell line {line}")
        else:
            where_ = _("{file} line {line}")
        where_ = where_.format(func=frame.func, line=frame.line,
                               file=os.path.basename(file))
        return f"{where_}: {_source(frame)}"
    return f"{label} {frame.line}: {_source(frame)}"


def exception_frames(exc: dict | None) -> list[Frame]:
    """The frames a recorded exception (``worker.record_exception``) passed through,
    innermost first."""
    return [Frame(f, int(n), fn)
            for f, n, fn in reversed((exc or {}).get("frames", []))]


def describe_finished_rank(rank: int, awaited: str | None) -> str:
    """One line for a rank whose program returned normally while others still waited."""
    what = awaited or _("the collective its peers wait in")
    return _("rank {rank}: finished without calling {what} (its program returned, "
             "exit 0)").format(rank=rank, what=what)


def describe_hung_rank(rank: int, stack: str | None, alive: bool, script: str | None,
                       label: str | None = None, finished: bool = False,
                       awaited: str | None = None) -> str:
    """One line saying where ``rank`` was when the launch timed out.

    Args:
        finished: the rank had returned normally (``rank{k}.done``), not died.
        awaited: the collective the other ranks wait in, to name in that case.
    """
    if not alive:
        if finished:
            return describe_finished_rank(rank, awaited)
        return _("rank {rank}: had already exited; it never called what the others "
                 "wait in").format(rank=rank)
    if not stack:
        return _("rank {rank}: alive but left no stack (still starting up, or not "
                 "Python)").format(rank=rank)
    frame, collective = where(parse_stack(stack), script)
    if frame is None:
        return _("rank {rank}: no frame of the script on its stack (still "
                 "importing?)").format(rank=rank)
    place = _place(frame, label)
    if collective:
        return _("rank {rank}: in {collective} at {place}  <- waiting for its "
                 "peers").format(rank=rank, collective=collective, place=place)
    return _("rank {rank}: at {place}  <- not in a collective: never joined the "
             "others").format(rank=rank, place=place)


def describe_raised_rank(rank: int, exc: dict, script: str | None,
                         label: str | None = None) -> tuple[str, str | None]:
    """Where a rank was when it raised: ``(line, collective or None)``."""
    frame, collective = where([exception_frames(exc)], script)
    if frame is None:
        return _("rank {rank}: raised {type}: {message}").format(
            rank=rank, type=exc["type"], message=exc["message"]), None
    place = _place(frame, label)
    if collective and is_peer_loss(exc):
        return _("rank {rank}: in {collective} at {place}  <- waiting for its peers "
                 "when they left").format(rank=rank, collective=collective,
                                          place=place), collective
    if collective:
        return _("rank {rank}: raised {type} in {collective} at {place}").format(
            rank=rank, type=exc["type"], collective=collective, place=place), collective
    return _("rank {rank}: raised {type} at {place}").format(
        rank=rank, type=exc["type"], place=place), collective


def finished_mismatch(nproc: int, exceptions: dict[int, dict], finished: set[int],
                      script: str | None, label: str | None = None
                      ) -> tuple[str, list[str]] | None:
    """Some ranks finished while the others waited in a collective: say so.

    With gloo, a peer that exits makes the ranks still waiting for it raise "Connection
    closed by peer"; those errors are echoes, and the finished ranks did not fail.

    Args:
        nproc: ranks in the launch.
        exceptions: rank -> recorded exception (only peer-loss errors qualify).
        finished: ranks whose program returned normally.
    Returns:
        ``(message, report)`` (one report line per rank), or None when the launch
        does not look like this (nobody finished, or a rank raised its own error).
    """
    if not finished or any(not is_peer_loss(e) for e in exceptions.values()):
        return None
    lines: dict[int, str] = {}
    waits: dict[int, str] = {}
    for r in range(nproc):
        if r in finished:
            continue
        if r in exceptions:
            lines[r], collective = describe_raised_rank(r, exceptions[r], script, label)
            if collective:
                waits[r] = collective
        else:
            lines[r] = _("rank {rank}: stopped by the launcher (it left no "
                         "record)").format(rank=r)
    awaited = next(iter(waits.values()), None)
    for r in finished:
        lines[r] = describe_finished_rank(r, awaited)
    done = sorted(finished)
    head = ngettext("rank {ranks} finished without calling {what}",
                    "ranks {ranks} finished without calling {what}", len(done)).format(
        ranks=", ".join(map(str, done)),
        what=awaited or _("the collective the others wait in"))
    if waits:
        head += ngettext(", which rank {ranks} waits in",
                         ", which ranks {ranks} wait in", len(waits)).format(
            ranks=", ".join(map(str, sorted(waits))))
    report = [lines[r] for r in range(nproc)]
    msg = (_("{head}. Nothing crashed: the ranks did not call the same "
             "collectives.").format(head=head) + "\n" + _("Where each rank was:")
           + "\n  " + "\n  ".join(report) + "\n" + _(HANG_HINT))
    return msg, report


def mismatch_summary(stacks: dict[int, str], script: str | None) -> str | None:
    """Name the collectives the ranks wait in when they are not all the same call."""
    places: dict[str, list[int]] = {}
    for rank, text in sorted(stacks.items()):
        frame, collective = where(parse_stack(text), script)
        if frame is None:
            continue
        key = _("{collective} (line {line})").format(
            collective=collective or _("no collective"), line=frame.line)
        places.setdefault(key, []).append(rank)
    if len(places) < 2:
        return None
    parts = [ngettext("{key} on rank {ranks}", "{key} on ranks {ranks}", len(r)).format(
        key=key, ranks=", ".join(map(str, r))) for key, r in places.items()]
    return _("The ranks are not in the same call: {parts}.").format(
        parts="; ".join(parts))


HANG_HINT = N_(
    "The usual cause is a collective mismatch: a rank that never calls the "
    "collective its peers wait in (a collective under 'if rank == 0:', a "
    "different number of calls per rank, or a rank stuck elsewhere)."
)


def exit_cause(code: int | None) -> str:
    """Words for a process exit code (negative: killed by a signal)."""
    if code is None:
        return "still running"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        extra = (" (kill -9, or the out-of-memory killer)"
                 if -code == signal.SIGKILL else "")
        return f"killed by {name}{extra}"
    return f"exit code {code}"


def read_exception(log_dir: str, rank: int) -> dict | None:
    """The exception a rank recorded before dying, or None."""
    path = os.path.join(log_dir, f"rank{rank}.exc")
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


#: Errors a rank raises when a *peer* died: echoes of the root cause, not the cause.
PEER_LOSS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
             "communicator was aborted", "remote process exited", "Connection refused")


def is_peer_loss(exc: dict | None) -> bool:
    """Whether a recorded exception only says that another rank went away."""
    return exc is not None and any(m in exc.get("message", "") for m in PEER_LOSS)


def root_cause(exceptions: dict[int, dict], deaths: dict[int, float],
               exit_codes: dict[int, int]) -> tuple[int | None, str]:
    """Pick the rank that failed first, and say why.

    A rank's own exception beats a silent death (signal, ``os._exit``), which beats the
    "connection closed" errors its peers raise afterwards; ties go to the earliest.
    SIGTERM is what the launcher sends survivors, so it is never the cause.

    Args:
        exceptions: rank -> recorded exception (``type``, ``message``, ``time``).
        deaths: rank -> when the launcher saw the rank gone.
        exit_codes: rank -> exit code, where known.
    Returns:
        ``(rank, cause)``; rank is None when nothing points at one.
    """
    own = {r: e["time"] for r, e in exceptions.items() if not is_peer_loss(e)}
    if own:
        r = min(own, key=own.__getitem__)
        return r, f"{exceptions[r]['type']}: {exceptions[r]['message']}"
    silent = {r: deaths.get(r, float("inf")) for r, code in exit_codes.items()
              if code not in (0, -signal.SIGTERM) and r not in exceptions}
    silent.update({r: t for r, t in deaths.items()
                   if r not in exceptions and exit_codes.get(r) != -signal.SIGTERM})
    if silent:
        r = min(silent, key=lambda k: (silent[k], k))
        return r, exit_cause(exit_codes.get(r, 1)) if r in exit_codes else "died"
    if exceptions:
        r = min(exceptions, key=lambda k: exceptions[k]["time"])
        return r, f"{exceptions[r]['type']}: {exceptions[r]['message']}"
    return None, "no rank left a clue"


_ROOT = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank.*?\)\s*\n"
                   r"\s*exitcode\s*:\s*(-?\d+)",
                   re.S)


def torchrun_exit_codes(agent_output: str) -> dict[int, int]:
    """rank -> exit code for every failure in torchrun's failure summary."""
    return {int(m.group(1)): int(m.group(2)) for m in _ROOT.finditer(agent_output)}


def tail(text: str, n: int = 15) -> str:
    """The last ``n`` lines of ``text``."""
    return "\n".join(text.rstrip().splitlines()[-n:])
