"""Suite-wide checks: no launched process outlives a test, and notebook wall times.

At the root so it covers both ``tests/`` and the notebooks nbval collects.
"""

from __future__ import annotations

import collections
import os

import psutil
import pytest

_NOTEBOOK_SECONDS: dict[str, float] = collections.defaultdict(float)
#: Seconds per test file (set-up, call and tear-down of its tests): the suite's budget
#: is spent file by file, and a file runs whole on one worker.
_FILE_SECONDS: dict[str, float] = collections.defaultdict(float)
#: Files under this many seconds are summed in one line of the summary.
FILE_SUMMARY_MIN_S = 10.0


# Every launch from this test session (and from subprocesses it starts) carries this
# mark in its environment: other sessions' launches on the same machine are not ours.
# Under pytest-xdist each worker is a session of its own: it inherits the controller's
# mark and adds its name, so a worker never judges the launches of the other.
SESSION = os.environ.setdefault("DTLIB_LAUNCH_OWNER", str(os.getpid()))
WORKER = os.environ.get("PYTEST_XDIST_WORKER")
OWNER = SESSION
if WORKER and not SESSION.endswith(f"-{WORKER}"):
    OWNER = os.environ["DTLIB_LAUNCH_OWNER"] = f"{SESSION}-{WORKER}"
# Deprecated API called from dtlib's own code fails the run, in this process and in
# every kernel and rank it starts (see dtlib/__init__.py; tests/test_deprecations.py).
os.environ.setdefault("DTLIB_STRICT_WARNINGS", "1")


def launched_processes(pattern: str = "", every_worker: bool = False
                       ) -> list[psutil.Process]:
    """This session's torchrun agents and rank workers whose command line has
    ``pattern`` (this worker's; ``every_worker``: those of every xdist worker)."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            cmd = " ".join(p.info["cmdline"] or [])
            owner = p.environ().get("DTLIB_LAUNCH_OWNER", "")
            ours = owner == OWNER or every_worker and owner.startswith(f"{SESSION}-")
            if ("dtlib.runtime.worker" in cmd or "torch.distributed.run" in cmd) \
                    and pattern in cmd and ours:
                found.append(p)
        except psutil.Error:
            continue
    return found


def _alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    gone, alive = psutil.wait_procs(procs, timeout=2)
    return [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]


@pytest.fixture
def no_leftovers():
    """Fail the test if it leaves a torchrun agent or rank worker alive."""
    yield
    leftovers = _alive(launched_processes())
    assert not leftovers, f"processes left behind: {[p.cmdline() for p in leftovers]}"


@pytest.fixture(autouse=True)
def fresh_exercise_attempts():
    """Each test starts with no wrong tries on record: a checker's feedback escalates
    with the tries since its last success, and under ``-n`` one worker runs many files,
    so another file's wrong answers must not change what this test's first try shows."""
    from dtlib.exercises import _ATTEMPTS  # noqa: PLC2701 (the suite's own reset)

    _ATTEMPTS.clear()
    yield


# The files that take longest (measured with --durations=0) start first, so that the
# pytest workers of `make test` finish together instead of one waiting on the other's
# last long file; every other file keeps pytest's order, and each file's tests theirs.
LONGEST_FIRST = ["tests/test_train.py", "notebooks/10_capstone.ipynb",
                 "notebooks/03_data_parallel.ipynb",
                 "notebooks/06_pipeline_parallel.ipynb",
                 "notebooks/04_zero_fsdp.ipynb", "tests/test_gpu_check.py",
                 "notebooks/07_mixed_precision.ipynb", "tests/test_launch_failures.py",
                 "tests/test_launch.py", "notebooks/13_where_the_time_goes.ipynb"]


def pytest_collection_modifyitems(session: pytest.Session, config,
                                  items: list[pytest.Item]) -> None:
    rank = {path: k for k, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    path = report.nodeid.split("::")[0]
    _FILE_SECONDS[path] += report.duration
    if path.endswith(".ipynb"):
        _NOTEBOOK_SECONDS[path] += report.duration


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if WORKER:  # the controller judges every worker's leftovers once they are done
        return
    leftovers = _alive(launched_processes(every_worker=True))
    if leftovers:
        session.config._dtlib_leftovers = [" ".join(p.cmdline()) for p in leftovers]
        for p in leftovers:
            p.kill()
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus: int, config) -> None:
    if _NOTEBOOK_SECONDS:
        terminalreporter.section("notebook wall times (budget: 90 s each)")
        for path, seconds in sorted(_NOTEBOOK_SECONDS.items()):
            flag = "" if seconds <= 90 else "   <-- over budget"
            terminalreporter.write_line(f"{seconds:7.1f} s  {path}{flag}")
    if _FILE_SECONDS and not WORKER:
        terminalreporter.section("seconds per file (all workers)")
        rest = [t for t in _FILE_SECONDS.values() if t < FILE_SUMMARY_MIN_S]
        for path, seconds in sorted(_FILE_SECONDS.items(), key=lambda kv: -kv[1]):
            if seconds >= FILE_SUMMARY_MIN_S:
                terminalreporter.write_line(f"{seconds:7.1f} s  {path}")
        if rest:
            terminalreporter.write_line(f"{sum(rest):7.1f} s  the other {len(rest)} "
                                        f"files, each under {FILE_SUMMARY_MIN_S:.0f} s")
    leftovers = getattr(config, "_dtlib_leftovers", None)
    if leftovers:
        terminalreporter.section("processes left behind (killed; the run fails)")
        for cmd in leftovers:
            terminalreporter.write_line(cmd)
