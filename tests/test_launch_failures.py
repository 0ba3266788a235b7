"""When a launch goes wrong: dead ranks are named with their cause, the survivors are
ended promptly, an interrupt leaves nothing behind, and the next launch works at once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
import torch
import torch.distributed as dist

from conftest import launched_processes
from dtlib.runtime import launch, supervise
from dtlib.runtime.supervise import kill_tree

WAIT_FOR_DEATH = """
    import os, signal, sys, time, torch, torch.distributed as dist
    from dtlib.runtime import dist as ddist
    world = ddist.init()
    dist.barrier()                      # everyone is up
    if world.rank == 1:
        time.sleep(1.0)
        with open({stamp!r}, "w") as f:     # when the rank dies, for the test
            f.write(repr(time.time()))
        {death}
    dist.all_reduce(torch.ones(1))      # the survivors wait here for rank 1
"""


def _script(tmp_path, body: str, name: str = "script.py") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


# Three ranks for a kill (two survivors to end, one each side of the dead rank), two
# for an exit code: how the cause is named does not depend on the world size (each
# torchrun rank is a fresh interpreter importing torch: seconds of CPU apiece).
@pytest.mark.parametrize("death, cause, nproc", [
    ("os.kill(os.getpid(), signal.SIGKILL)", "killed by SIGKILL", 3),
    ("os._exit(3)", "exit code 3", 2),
])
def test_torchrun_names_a_dead_rank_and_ends_the_others(tmp_path, death, cause, nproc,
                                                        no_leftovers) -> None:
    stamp = tmp_path / "died_at"
    script = _script(tmp_path, WAIT_FOR_DEATH.format(death=death, stamp=str(stamp)))
    with pytest.raises(launch.LaunchError) as info:
        launch.torchrun(script, nproc=nproc, timeout=120, stream=False)
    # The survivors, waiting in all_reduce, are ended within 10 s of the death: not at
    # the 120 s launch timeout, nor at their own collective timeout.
    assert time.time() - float(stamp.read_text()) < 10
    assert info.value.rank == 1
    assert f"rank 1 failed ({cause}" in str(info.value)


def _killed_rank() -> None:
    dist.barrier()
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(torch.ones(1))


def test_spawn_names_a_killed_rank(no_leftovers) -> None:
    start = time.monotonic()
    with pytest.raises(launch.LaunchError) as info:
        launch.spawn(_killed_rank, 3, timeout=60, stream=False)
    assert time.monotonic() - start < 10
    assert info.value.rank == 1
    assert "killed by SIGKILL" in str(info.value)


OWN_INIT_DEADLOCK = """
    import time, torch, torch.distributed as dist
    dist.init_process_group("gloo")  # torch's own, not dtlib.runtime.dist.init
    if dist.get_rank() == 0:
        dist.recv(torch.empty(1), src=1)  # rank 1 never sends
    else:
        time.sleep(600)
"""


def test_torchrun_timeout_counts_from_torchs_own_init(tmp_path, no_leftovers) -> None:
    """A script that joins through ``torch.distributed.init_process_group`` gets the
    same clock as one that calls ``dtlib.runtime.dist.init``: the timeout counts from
    the moment every rank has joined, not from ``STARTUP_S`` of start-up."""
    timeout = 8
    script = _script(tmp_path, OWN_INIT_DEADLOCK)
    start = time.monotonic()
    with pytest.raises(launch.LaunchTimeout) as info:
        launch.torchrun(script, nproc=2, timeout=timeout, stream=False)
    elapsed = time.monotonic() - start
    startup_s = info.value.startup_s
    assert startup_s is not None, "the ranks' own init_process_group went unnoticed"
    assert f"{timeout} s after every rank had joined the world" in str(info.value)
    # After the join the launch runs the timeout, then at most one poll of the
    # launcher (0.02 s), the stack report (collect_stacks waits up to 2 s, then 0.1 s
    # for a dump to finish) and kill_tree's reap (up to 5 s): 7.12 s, 7.5 with
    # scheduling. Waiting for STARTUP_S instead would overshoot by about 60 s.
    assert timeout <= elapsed - startup_s < timeout + 7.5, (elapsed, startup_s)
    assert startup_s < supervise.STARTUP_S
    report = info.value.report
    assert report[0].startswith("rank 0: in recv at script.py line 5"), report
    assert report[1].startswith("rank 1: at script.py line 7: time.sleep(600)"), report


INTERRUPTED = """
    import signal, sys, time
    from dtlib.runtime import launch
    # What this process started with (a test worker may hand its children SIGINT
    # ignored or blocked; a Jupyter kernel has Python's own handler), then that handler.
    print("sigint at start:", signal.getsignal(signal.SIGINT),
          signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, []), flush=True)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        launch.torchrun({hang!r}, nproc=2, timeout=300, stream=False)
    except KeyboardInterrupt as exc:  # what a notebook shows: the report, no frames
        print("interrupted", type(exc).__name__, flush=True)
        from IPython.core.interactiveshell import InteractiveShell
        shell = InteractiveShell.instance()
        shell.showtraceback((type(exc), exc, exc.__traceback__))
        sys.stdout.flush()
    result = launch.torchrun({hello!r}, nproc=2, timeout=120, stream=False)
    print("next launch ok", result.returncode, flush=True)
"""

HANG = """
    import time
    from dtlib.runtime import dist as ddist
    world = ddist.init()
    open({up!r} + str(world.rank), "w").close()
    time.sleep(600)
"""

HELLO = """
    import torch.distributed as dist
    from dtlib.runtime import dist as ddist
    ddist.init()
    dist.barrier()
"""


def test_interrupt_ends_every_rank_and_next_launch_works(tmp_path, no_leftovers) -> None:
    up = str(tmp_path / "up")
    hang = _script(tmp_path, HANG.format(up=up), "hang.py")
    driver = _script(tmp_path, INTERRUPTED.format(
        hang=hang, hello=_script(tmp_path, HELLO, "hello.py")), "driver.py")
    proc = subprocess.Popen([sys.executable, driver], stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # wait until both ranks run the hang script
            workers = launched_processes("-u -m dtlib.runtime.worker " + hang)
            if len(workers) == 2:
                break
            time.sleep(0.2)
        assert len(workers) == 2, "the ranks never started"
        while time.monotonic() < deadline and not all(
                os.path.exists(up + str(r)) for r in range(2)):
            time.sleep(0.2)  # until both ranks have joined and reached the sleep
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)  # what Jupyter's stop button sends the kernel
        try:
            out, _ = proc.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            kill_tree([proc.pid] + [p.pid for p in launched_processes(hang)])
            out, _ = proc.communicate()
            pytest.fail("the driver did not finish within 90 s of SIGINT; it printed:\n"
                        + out)
    finally:
        if proc.poll() is None:  # the driver never finished: end it, its torchrun
            # agent and the ranks (their own session), so that this failure does not
            # leave processes that the next tests' leftover checks would count
            kill_tree([proc.pid] + [p.pid for p in launched_processes(hang)])
    assert "interrupted LaunchInterrupted" in out
    # Before ending the ranks, the launcher says where each one was, and that alone:
    # no traceback through the launcher's frames.
    assert "Interrupted. Where each rank was:" in out
    assert "Traceback" not in out and "launch.py" not in out, out
    assert "rank 0: at hang.py line 6: time.sleep(600)" in out
    assert "rank 1: at hang.py line 6: time.sleep(600)" in out
    assert "next launch ok 0" in out
    gone, alive = psutil.wait_procs(workers, timeout=5)
    assert not alive, "an interrupted rank survived"


ORPHANED = """
    import os, time
    from dtlib.runtime import launch

    def hang(where):
        with open(os.path.join(where, str(os.getpid())), "w"):
            pass
        time.sleep(600)

    if __name__ == "__main__":
        launch.spawn(hang, 2, {where!r}, timeout=600, stream=False)
"""


def test_ranks_end_when_their_launcher_is_killed_outright(tmp_path) -> None:
    """A kernel restarted or a ``kill -9``: the launcher cannot stop its ranks, so
    each rank watches it and leaves (within about a second) once it is gone."""
    where = tmp_path / "pids"
    where.mkdir()
    driver = _script(tmp_path, ORPHANED.format(where=str(where)), "orphan.py")
    proc = subprocess.Popen([sys.executable, driver])
    try:
        deadline = time.monotonic() + 60
        while len(os.listdir(where)) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        ranks = [psutil.Process(int(p)) for p in os.listdir(where)]
        assert len(ranks) == 2, "the ranks never started"
    finally:
        proc.kill()  # SIGKILL: no finally, no atexit, no kill_tree in the launcher
        proc.wait()
    gone, alive = psutil.wait_procs(ranks, timeout=10)
    assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE], \
        "a rank outlived its launcher"
