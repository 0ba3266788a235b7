"""``%%torchrun``: run a notebook cell as a multi-rank program.

Load with ``%load_ext dtlib``, then::

    %%torchrun -n 4 --timeout 60
    import torch, torch.distributed as dist
    from dtlib.runtime import dist as ddist
    world = ddist.init()
    ...

The cell is written to a temporary script and launched by
:func:`dtlib.runtime.launch.torchrun`, so a reader edits a cell and re-runs it like any
other. Line numbers in error reports are the cell's own.

What a cell sees: it runs in fresh processes, one per rank, not in the kernel, so the
notebook's variables do not exist there. Values go in on the magic line, which IPython
expands: ``%%torchrun -n 2 {lr}`` gives the cell ``sys.argv[1] == str(lr)``. Values come
out through a top-level variable named ``result``: after the cell,
``torchrun_result.values[rank]`` holds each rank's (pickled, so plain data and tensors).
"""

from __future__ import annotations

import os
import tempfile

from IPython.core.magic import Magics, cell_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from dtlib.runtime import launch


@magics_class
class TorchrunMagics(Magics):
    """The ``%%torchrun`` cell magic."""

    @magic_arguments()
    @argument("-n", "--nproc", type=int, default=None,
              help="ranks to start (default: GPUs, else 4)")
    @argument("--timeout", type=float, default=launch.DEFAULT_TIMEOUT_S,
              help="seconds the ranks may run once all have joined the world")
    @argument("--quiet", action="store_true", help="do not stream the ranks' output")
    @argument("args", nargs="*", help="arguments passed to the cell as sys.argv[1:]")
    @cell_magic
    def torchrun(self, line: str, cell: str) -> None:
        """Run this cell on ``-n`` ranks under torchrun
        (``%%torchrun -n 4 --timeout 60``).

        The :class:`~dtlib.runtime.launch.LaunchResult` is left in the variable
        ``torchrun_result`` for the next cell: ``.outputs`` (each rank's text) and
        ``.values`` (each rank's top-level ``result`` variable).

        Raises LaunchError / LaunchTimeout from :mod:`dtlib.runtime.launch`; the
        traceback of the failing rank, or where each rank hung, is in the message.
        """
        opts = parse_argstring(self.torchrun, line)
        fd, path = tempfile.mkstemp(prefix="torchrun_cell_", suffix=".py")
        with os.fdopen(fd, "w") as f:
            # One empty line stands in for the %%torchrun line, so the line numbers in
            # tracebacks and hang reports are the ones the notebook shows.
            f.write("\n" + cell)
        try:
            result = launch.torchrun(path, *opts.args, nproc=opts.nproc,
                                     timeout=opts.timeout, stream=not opts.quiet,
                                     label="cell line")
            # Kept for the next cell: outputs per rank and the launch's wall time.
            self.shell.user_ns["torchrun_result"] = result
        except launch.LaunchError as exc:
            # The reader knows the cell, not our temporary file: name it "<cell>".
            exc.args = (str(exc).replace(f'File "{path}"', 'File "<cell>"'),)
            raise
        finally:
            os.unlink(path)

