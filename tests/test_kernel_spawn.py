"""In a real Jupyter kernel: a rank function written in a cell runs under ``spawn``.

A learner defines the function in the notebook, edits it, reruns it at spawn's speed and
gets each rank's value back; nbclient drives a real ipykernel, as JupyterLab would.
"""

from __future__ import annotations

import nbformat
import pytest
from nbclient import NotebookClient

CELLS = [
    "from dtlib.runtime import launch",
    "import torch\nimport torch.distributed as dist\n\n"
    "def rank_value(scale):\n"
    "    t = torch.tensor([float(dist.get_rank())])\n"
    "    dist.all_reduce(t)  # 0+1+2+3 = 6 on every rank\n"
    "    return dist.get_rank() * scale + int(t.item())",
    "values = launch.spawn(rank_value, 4, 10, stream=False)\nprint(values)",
    # edit the function and rerun: the new code reaches the ranks
    "def rank_value(scale):\n    return -dist.get_rank() * scale\n"
    "print(launch.spawn(rank_value, 4, 10, stream=False))",
]


# Under %%ranks: torchrun's own report of this mismatch is tested in
# test_launch_mismatch.py (each torchrun rank is a fresh interpreter: seconds of CPU).
SKIP_CELL = """%%ranks -n 2 --timeout 30
import torch
import torch.distributed as dist
from dtlib.runtime import dist as ddist
world = ddist.init()
t = torch.ones(1)
if world.rank == 0:
    dist.all_reduce(t)
print("done", world.rank)"""

MAGIC_CELLS = ["lr = 0.25",
               "%%torchrun -n 2 --quiet {lr}\n"
               "import sys\n"
               "from dtlib.runtime import dist as ddist\n"
               "world = ddist.init()\n"
               # a kernel variable is not visible in the ranks: only through argv
               "result = {'rank': world.rank, 'lr': float(sys.argv[1]),\n"
               "          'sees_lr': 'lr' in globals()}",
               "print(torchrun_result.values)"]


# %%ranks: the same cell program, on ranks forked from the kernel's fork server.
RANKS_CELLS = [MAGIC_CELLS[1].replace("%%torchrun", "%%ranks"),
               "print(ranks_result.values)",
               "%%ranks -n 3 --timeout 30 --quiet\n"
               "import torch\n"
               "import torch.distributed as dist\n"
               "from dtlib.runtime import dist as ddist\n"
               "world = ddist.init()\n"
               "if world.rank == 2:\n"
               "    raise ValueError('rank 2 found a NaN')\n"
               "dist.all_reduce(torch.ones(1))"]


@pytest.fixture(scope="module")
def kernel_cells() -> list:
    """One real kernel runs every cell below in turn (one kernel start-up, not three);
    the skipped collective's cell and the last %%ranks cell are expected to raise."""
    cells = CELLS + ["%load_ext dtlib", SKIP_CELL] + MAGIC_CELLS + RANKS_CELLS
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    NotebookClient(nb, timeout=120, kernel_name="python3", allow_errors=True).execute()
    return nb.cells


def texts(cells: list) -> list[str]:
    return ["".join(o.get("text", "") for o in cell.outputs) for cell in cells]


def error_of(cell) -> tuple[str, str]:
    """The name of the error a cell raised, and what the notebook shows of it."""
    error = next(o for o in cell.outputs if o.output_type == "error")
    return error.ename, "\n".join(error.traceback)


def test_notebook_function_runs_on_four_ranks(kernel_cells, no_leftovers: None) -> None:
    outputs = texts(kernel_cells[:len(CELLS)])
    assert outputs[2].strip() == "[6, 16, 26, 36]"
    assert outputs[3].strip() == "[0, -10, -20, -30]"


def test_ranks_cell_that_skips_a_collective_names_waiter_and_finisher(
        kernel_cells, no_leftovers: None) -> None:
    ename, shown = error_of(kernel_cells[len(CELLS) + 1])
    assert ename == "CollectiveMismatch"
    assert "rank 0: in all_reduce at cell line 8: dist.all_reduce(t)" in shown
    assert "rank 1: finished without calling all_reduce" in shown
    assert "failed" not in shown and "died" not in shown
    # The report is the message, not the launcher's frames.
    assert "launch.py" not in shown


def test_torchrun_cell_takes_values_in_on_the_magic_line_and_returns_result(
        kernel_cells, no_leftovers: None) -> None:
    magic = kernel_cells[len(CELLS) + 2:len(CELLS) + 2 + len(MAGIC_CELLS)]
    assert not [o for c in magic for o in c.outputs if o.output_type == "error"]
    outputs = texts(magic)
    assert outputs[2].strip() == ("[{'rank': 0, 'lr': 0.25, 'sees_lr': False}, "
                                  "{'rank': 1, 'lr': 0.25, 'sees_lr': False}]")


def test_ranks_cell_runs_the_program_torchrun_would(kernel_cells,
                                                    no_leftovers: None) -> None:
    """The same cell under %%ranks: its argv from the magic line, each rank's
    ``result`` back, the kernel's variables invisible; a failing rank is named with
    the cell's own line and no launcher frame."""
    start = len(CELLS) + 2 + len(MAGIC_CELLS)
    ran, printed, failing = kernel_cells[start:start + 3]
    assert not [o for c in (ran, printed) for o in c.outputs
                if o.output_type == "error"]
    assert texts([printed])[0].strip() == (
        "[{'rank': 0, 'lr': 0.25, 'sees_lr': False}, "
        "{'rank': 1, 'lr': 0.25, 'sees_lr': False}]")
    ename, shown = error_of(failing)
    assert ename == "LaunchError"
    assert "rank 2 failed (ValueError: rank 2 found a NaN)" in shown
    assert 'File "<cell>", line 7' in shown
    assert "launch.py" not in shown and "runpy" not in shown
