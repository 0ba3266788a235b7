"""Chapter 11: parallelism in several dimensions.

- :mod:`~dtlib.parallel_nd.dims`: :class:`ParallelDims`, the one owner of the
  degrees: validated once, and the mesh or grid built from them.
- :mod:`~dtlib.parallel_nd.grid`: a rank grid ``arange(world).view(dp, tp)`` and
  one process group per line of it (the teaching device mesh).
- :mod:`~dtlib.parallel_nd.compose`: our tensor parallel inside our data parallel;
  our pipeline inside our data parallel; torch's FSDP2 x TP, HSDP and FSDP2 x PP
  on a ``DeviceMesh``.
- :mod:`~dtlib.parallel_nd.parallelism`: ``parallelism(layout, ...)``, each layout as a
  :class:`~dtlib.models.run.Parallelism` for the one loop ``run_steps``.

The planner that chooses the degrees is :mod:`dtlib.planner` (pure Python).
"""

from __future__ import annotations

from dtlib.parallel_nd.compose import (average_across_replicas,
                                       fsdp_pipeline_stage, fsdp_tp, hsdp,
                                       pipeline_stage_of, tp_inside_dp)
from dtlib.parallel_nd.dims import DIM_NAMES, ParallelDims
from dtlib.parallel_nd.grid import GridGroups, build_grid_groups, lines_along, rank_grid
from dtlib.parallel_nd.parallelism import LAYOUTS, parallelism

__all__ = ["ParallelDims", "DIM_NAMES", "rank_grid", "lines_along", "GridGroups",
           "build_grid_groups",
           "tp_inside_dp", "fsdp_tp", "hsdp", "pipeline_stage_of",
           "average_across_replicas", "fsdp_pipeline_stage", "LAYOUTS", "parallelism"]
