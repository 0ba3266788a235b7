"""Chapter 2: collectives built from send and receive, their cost, and counting them.

- :mod:`~dtlib.collectives.algorithms`: ring all-reduce / reduce-scatter / all-gather,
  tree broadcast, the naive all-reduce.
- :mod:`~dtlib.collectives.cost_model`: the alpha-beta model and bus bandwidth.
- :mod:`~dtlib.collectives.accounting`: which collectives a step ran, and how many bytes
  (:mod:`~dtlib.collectives.comm_log` holds the records).
- :mod:`~dtlib.collectives.slow_link`: the same collectives as if over a slower
  network (Chapter 15).
"""

from __future__ import annotations

import importlib
from typing import Any

# name -> submodule. Loaded on first use: the cost model is pure Python (the
# planner of Chapter 11 uses it without torch); the rest needs torch.
_WHERE = {
    **dict.fromkeys(("chunk_bounds", "all_gather_into", "reduce_scatter_into",
                     "ring_all_reduce", "ring_all_reduce_trace", "ring_reduce_scatter",
                     "ring_all_gather", "tree_broadcast", "naive_all_reduce"),
                    "algorithms"),
    **dict.fromkeys(("cost_terms", "collective_time", "bus_bandwidth_factor",
                     "bytes_sent_per_rank", "fit_alpha_beta",
                     "latency_bandwidth_crossover"), "cost_model"),
    **dict.fromkeys(("OPS", "CommRecord", "CommLog", "record", "active"), "comm_log"),
    "count_comms": "accounting", "CountComms": "accounting",
    "link_seconds": "cost_model",
    **dict.fromkeys(("SlowLink", "slow_link", "SlowLinkSteps"), "slow_link"),
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(f"dtlib.collectives.{_WHERE[name]}"),
                       name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["chunk_bounds", "all_gather_into", "reduce_scatter_into", "ring_all_reduce",
           "ring_all_reduce_trace", "ring_reduce_scatter", "ring_all_gather",
           "tree_broadcast", "naive_all_reduce", "CountComms", "cost_terms",
           "collective_time",
           "bus_bandwidth_factor", "bytes_sent_per_rank", "fit_alpha_beta",
           "latency_bandwidth_crossover", "OPS", "CommRecord", "CommLog", "record",
           "active", "count_comms", "link_seconds", "SlowLink", "slow_link",
           "SlowLinkSteps"]
