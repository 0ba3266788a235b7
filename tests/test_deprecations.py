"""No deprecated API in dtlib's own code, under the pinned torch.

The suite runs with ``DTLIB_STRICT_WARNINGS=1`` (root ``conftest.py``): every process
that imports dtlib (this one, each notebook kernel, every rank a launch starts) turns a
``FutureWarning`` or ``DeprecationWarning`` raised on behalf of dtlib's own code (see
:mod:`dtlib.runtime.strict_warnings`) into an error, so all of every chapter's rank
code that the suite and the notebooks run is checked. These
tests show the switch is on and that it fails a rank that calls a deprecated collective.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed as dist

import dtlib
from dtlib.runtime import launch

# Code that looks, to the warnings machinery, like a dtlib module calling torch.
OLD = """
def gather(out, x):
    dist.all_gather_into_tensor(out, x)   # deprecated in favour of all_gather_single
"""
NEW = """
def gather(out, x):
    new = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    new(out, x)
"""


def planted(source: str) -> list[float]:
    """On every rank: ``gather`` defined in a module named ``dtlib.planted``."""
    namespace = {"__name__": "dtlib.planted", "dist": dist}
    exec(compile(source, "planted.py", "exec"), namespace)
    x = torch.tensor([float(dist.get_rank())])
    out = torch.empty(dist.get_world_size())
    namespace["gather"](out, x)
    return out.tolist()


def test_the_switch_is_on_in_this_process_and_in_the_ranks():
    assert os.environ.get(dtlib.STRICT_WARNINGS_ENV) == "1"

    def caught() -> bool:
        namespace = {"__name__": "dtlib.planted", "warnings": warnings}
        exec("def f():\n    warnings.warn('old', FutureWarning)", namespace)
        try:
            namespace["f"]()
        except FutureWarning:
            return True
        return False

    assert caught()
    assert launch.spawn(caught, 2, stream=False) == [True, True]
    with warnings.catch_warnings(record=True) as seen:  # others' warnings go on
        warnings.simplefilter("always")
        warnings.warn("a test's own deprecation", FutureWarning)
    assert [str(w.message) for w in seen] == ["a test's own deprecation"]


def test_a_rank_calling_a_deprecated_collective_fails_and_the_new_name_passes():
    with pytest.raises(launch.LaunchError, match="FutureWarning.*all_gather_into_tensor"):
        launch.spawn(planted, 2, OLD, stream=False)
    assert launch.spawn(planted, 2, NEW, stream=False) == [[0.0, 1.0], [0.0, 1.0]]
