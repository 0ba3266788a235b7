"""Chapter 6: pipeline parallelism.

- :mod:`~dtlib.pipeline_parallel.split`: cutting the GPT into balanced stages.
- :mod:`~dtlib.pipeline_parallel.schedules`: GPipe, 1F1B and ZB-H1, simulated and run.
- :mod:`~dtlib.pipeline_parallel.zero_bubble_v`: ZB-V's V-shaped action lists, and
  torch's V schedules' lists read beside them.
- :mod:`~dtlib.pipeline_parallel.parallelism`: ``parallelism(schedule, n_micro, ...)``,
  a schedule as the :class:`~dtlib.models.run.Parallelism` of the one loop.
"""

from __future__ import annotations

from dtlib.pipeline_parallel.split import (GPTStage, split_gpt, balanced_layers,
                                           balance, gpt_layer_costs, stage_costs,
                                           layers_from_split_points)
from dtlib.pipeline_parallel.schedules import (SCHEDULES, Event, StepResult,
                                               schedule_order, bubble_fraction,
                                               simulate, idle_fractions, in_flight_peak,
                                               pipeline_step)
from dtlib.pipeline_parallel.parallelism import (VARIANTS, PipelineParallel, lm_loss,
                                               parallelism)

__all__ = ["GPTStage", "split_gpt", "balanced_layers", "balance", "gpt_layer_costs",
           "stage_costs", "layers_from_split_points", "SCHEDULES", "Event",
           "StepResult", "schedule_order", "bubble_fraction", "simulate",
           "idle_fractions", "in_flight_peak", "pipeline_step", "VARIANTS",
           "PipelineParallel", "lm_loss", "parallelism"]
