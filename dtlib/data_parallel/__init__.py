"""Chapter 3: data parallelism from scratch (naive, bucketed, overlapped) and
sharding the data.

- :mod:`~dtlib.data_parallel.buckets`: gradients grouped into buckets, one
  all-reduce each.
- :mod:`~dtlib.data_parallel.ddp`: the :class:`DataParallel` wrapper and its hooks.
- :mod:`~dtlib.data_parallel.parallelism`: every DDP as the one loop's
  Parallelism; :func:`parallelism` is the package's factory.
- :mod:`~dtlib.data_parallel.sampling`: each rank's share of the data set.
"""

from __future__ import annotations

from dtlib.data_parallel.ddp import (TEACHING_VARIANTS, sync_module_states,
                                     DataParallel, allreduce_calls_per_step)
from dtlib.data_parallel.buckets import (group_size, allreduce_grads, Bucket,
                                         build_buckets, allreduce_buckets)
from dtlib.data_parallel.parallelism import (VARIANTS, DataParallelism, parallelism,
                                             rows_of_rank, settle_ddp_buckets)
from dtlib.data_parallel.sampling import (shards, epoch_orders, duplicated,
                                          sharded_mean, eval_shards)

__all__ = ["TEACHING_VARIANTS", "VARIANTS", "sync_module_states", "DataParallel",
           "allreduce_calls_per_step", "DataParallelism", "parallelism",
           "rows_of_rank", "settle_ddp_buckets", "group_size", "allreduce_grads",
           "Bucket", "build_buckets", "allreduce_buckets", "shards", "epoch_orders",
           "duplicated", "sharded_mean", "eval_shards"]
