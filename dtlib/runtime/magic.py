"""``%%torchrun`` and ``%%ranks``: run a notebook cell as a multi-rank program.

Load with ``%load_ext dtlib``, then::

    %%torchrun -n 4 --timeout 60
    import torch, torch.distributed as dist
    from dtlib.runtime import dist as ddist
    world = ddist.init()
    ...

The cell is written to a temporary script and launched by
:func:`dtlib.runtime.launch.torchrun`, so a reader edits a cell and re-runs it like any
other. Line numbers in error reports are the cell's own. ``%%ranks`` runs the same
script on ranks forked from the kernel's warm fork server
(:func:`dtlib.runtime.launch.spawn_script`), in torchrun's environment: the same
program without torchrun's seconds of start-up, for cells where the launcher is not
the lesson. Its result is ``ranks_result``.

What a cell sees: it runs in fresh processes, one per rank, not in the kernel, so the
notebook's variables do not exist there. Values go in on the magic line, which IPython
expands: ``%%torchrun -n 2 {lr}`` gives the cell ``sys.argv[1] == str(lr)``. Values come
out through a top-level variable named ``result``: after the cell,
``torchrun_result.values[rank]`` holds each rank's (pickled, so plain data and tensors).
"""

from __future__ import annotations

import os
import tempfile
from typing import Callable

from IPython.core.magic import Magics, cell_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from dtlib.runtime import launch


def _launch_options(method: Callable) -> Callable:
    """The options both cell magics take: ``-n``, ``--timeout``, ``--quiet`` and the
    cell's own arguments (applied as the stacked decorators would be)."""
    for option in (
            argument("args", nargs="*", help="arguments passed to the cell as "
                     "sys.argv[1:]"),
            argument("--quiet", action="store_true",
                     help="do not stream the ranks' output"),
            argument("--timeout", type=float, default=launch.LAUNCH_TIMEOUT_S,
                     help="seconds the ranks may run once all have joined the world"),
            argument("-n", "--nproc", type=int, default=None,
                     help="ranks to start (default: GPUs, else 4)"),
            magic_arguments()):
        method = option(method)
    return method


@magics_class
class TorchrunMagics(Magics):
    """The ``%%torchrun`` and ``%%ranks`` cell magics."""

    @_launch_options
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
        self._run(launch.torchrun, parse_argstring(self.torchrun, line), cell,
                  "torchrun_result")

    @_launch_options
    @cell_magic
    def ranks(self, line: str, cell: str) -> None:
        """Run this cell on ``-n`` ranks forked from this kernel's warm fork server
        (``%%ranks -n 4 --timeout 60``): the same program as under ``%%torchrun``, in
        the same environment, without torchrun's start-up (an agent and one torch
        import per rank: seconds). :func:`dtlib.runtime.launch.spawn_script`.

        Leaves ``ranks_result``, a :class:`~dtlib.runtime.launch.LaunchResult`; raises
        as ``%%torchrun`` does.
        """
        self._run(launch.spawn_script, parse_argstring(self.ranks, line), cell,
                  "ranks_result")

    def _run(self, launcher, opts, cell: str, result_name: str) -> None:
        fd, path = tempfile.mkstemp(prefix="torchrun_cell_", suffix=".py")
        with os.fdopen(fd, "w") as f:
            # One empty line stands in for the magic's line, so the line numbers in
            # tracebacks and hang reports are the ones the notebook shows.
            f.write("\n" + cell)
        try:
            result = launcher(path, *opts.args, nproc=opts.nproc,
                              timeout=opts.timeout, stream=not opts.quiet,
                              label="cell line")
            # Kept for the next cell: outputs per rank and the launch's wall time.
            self.shell.user_ns[result_name] = result
        except launch.LaunchError as exc:
            # The reader knows the cell, not our temporary file: name it "<cell>".
            exc.args = (str(exc).replace(f'File "{path}"', 'File "<cell>"'),)
            raise
        finally:
            os.unlink(path)
