"""A parallel-configuration planner, checked against published runs (pure Python).

Given a model, a cluster and a global batch, ``search`` enumerates (dp, tp, pp, cp, ZeRO
stage, micro-batch, recomputation, pipeline schedule), keeps what fits in memory
(Chapter 1's formulas) and ranks it by estimated step time: compute from Megatron's FLOP
count (Narayanan et al. 2021, Eq. 3), the pipeline bubble (Chapter 6) and communication
on the link it uses (Chapter 2's alpha-beta model). ``estimate`` prices one
configuration and its ``breakdown`` says what dominates.

>>> from dtlib.planner import ModelSpec, ClusterSpec, ParallelConfig, estimate, search

Modules: ``specs`` (the three inputs, cluster presets), ``counts`` (parameters,
FLOPs), ``footprint`` (memory), ``estimate`` (time), ``search``, ``published``
(the papers' tables). Units: bytes, FLOP/s, bytes/s, seconds.

Taught in: Chapter 11, a planner checked against published runs.
"""

from __future__ import annotations

from dtlib.planner.counts import flops_per_iteration, megatron_eq3, param_count
from dtlib.planner.estimate import Breakdown, Estimate, estimate, pipeline_bubble
from dtlib.planner.search import candidates, search
from dtlib.planner.specs import (PP_SCHEDULES, PRESETS, ClusterSpec, ModelSpec,
                                 ParallelConfig)

__all__ = ["ModelSpec", "ClusterSpec", "ParallelConfig", "estimate", "search",
           "Estimate", "Breakdown", "PRESETS", "PP_SCHEDULES", "candidates",
           "flops_per_iteration", "megatron_eq3", "param_count", "pipeline_bubble"]
