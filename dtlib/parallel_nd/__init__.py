"""Chapter 11: parallelism in several dimensions.

- :mod:`~dtlib.parallel_nd.dims`: :class:`ParallelDims`, the one owner of the
  degrees: validated once, and the mesh or grid built from them.
- :mod:`~dtlib.parallel_nd.grid`: a rank grid ``arange(world).view(dp, tp)`` and
  one process group per line of it (the teaching device mesh).
- :mod:`~dtlib.parallel_nd.parts`: one :class:`Part` per dimension (our TP or
  torch's, our DataParallel, FSDP2, a pipeline's cut, our average after it), and
  :class:`Composed`, the Parallelism that applies a list of parts in order.
- :mod:`~dtlib.parallel_nd.parallelism`: ``parallelism(layout, ...)``, each layout as
  its list of parts (our TP inside our DP; our pipeline inside our DP; torch's
  FSDP2 x TP, HSDP and FSDP2 x PP on a ``DeviceMesh``) for the one loop
  ``run_steps``.

The planner that chooses the degrees is :mod:`dtlib.planner` (pure Python).
"""

from __future__ import annotations

from dtlib.parallel_nd.dims import DIM_NAMES, ParallelDims
from dtlib.parallel_nd.grid import GridGroups, build_grid_groups, lines_along, rank_grid
from dtlib.parallel_nd.parallelism import LAYOUTS, layout_parts, parallelism
from dtlib.parallel_nd.parts import (AverageAfterBackward, Composed, DataPart, Fsdp2,
                                     OurDataParallel, OurTensorParallel, Part,
                                     Pipeline, TensorPart, TorchTensorParallel)

__all__ = ["ParallelDims", "DIM_NAMES", "rank_grid", "lines_along", "GridGroups",
           "build_grid_groups", "Part", "DataPart", "TensorPart",
           "OurTensorParallel",
           "TorchTensorParallel", "OurDataParallel", "Fsdp2", "AverageAfterBackward",
           "Pipeline", "Composed", "LAYOUTS", "layout_parts", "parallelism"]
