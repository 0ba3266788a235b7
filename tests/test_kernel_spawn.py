"""In a real Jupyter kernel: a rank function written in a cell runs under ``spawn``.

A learner defines the function in the notebook, edits it, reruns it at spawn's speed and
gets each rank's value back; nbclient drives a real ipykernel, as JupyterLab would.
"""

from __future__ import annotations

import nbformat
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


def test_notebook_function_runs_on_four_ranks(no_leftovers: None) -> None:
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in CELLS])
    NotebookClient(nb, timeout=120, kernel_name="python3").execute()
    outputs = ["".join(o.get("text", "") for o in cell.outputs) for cell in nb.cells]
    assert outputs[2].strip() == "[6, 16, 26, 36]"
    assert outputs[3].strip() == "[0, -10, -20, -30]"
