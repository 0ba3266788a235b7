"""Context parallelism: the sequence split across ranks, attention made exact by a ring.

``cp_shard`` / ``cp_unshard`` (load-balanced layout), ``ring_attention`` (forward and
backward ring passes), ``ulysses_attention`` (the all-to-all alternative),
``cp_volume`` (their communication), ``parallelism`` (the technique for the one loop,
``run_steps``).

Taught in: Chapter 12, "Context parallelism".
"""

from dtlib.context_parallel.parallelism import ContextParallel, parallelism
from dtlib.context_parallel.ring_attention import ring_attention
from dtlib.context_parallel.sharding import cp_shard, cp_unshard
from dtlib.context_parallel.ulysses import ulysses_attention
from dtlib.context_parallel.volume import cp_volume

__all__ = ["ContextParallel", "cp_shard", "cp_unshard", "cp_volume", "parallelism",
           "ring_attention", "ulysses_attention"]
