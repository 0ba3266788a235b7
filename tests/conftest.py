"""Shared fixtures: a check that a test left no launched process behind."""

from __future__ import annotations

import psutil
import pytest


def launched_processes() -> list[psutil.Process]:
    """Processes that dtlib.launch starts: torchrun agents and their rank workers."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if "dtlib.worker" in cmd or "torch.distributed.run" in cmd:
            found.append(p)
    return found


@pytest.fixture
def no_leftovers():
    """Fail the test if it leaves a torchrun agent or rank worker alive."""
    yield
    leftovers = [p for p in launched_processes() if p.is_running()]
    assert not leftovers, f"processes left behind: {[p.cmdline() for p in leftovers]}"
