"""Expert parallelism: mixture-of-experts layers, their experts split across ranks.

``MoE`` and ``route`` (one process: top-k router, capacity, dropping, auxiliary
losses), ``all_to_all`` and ``exchange_counts`` (the dispatch and combine, autograd
Functions), ``ExpertParallelMoE`` (the layer over an ``ep`` group), ``moe_gpt`` /
``moe_loss`` (the book's GPT with MoE blocks), ``parallelism`` (ep x dp for the one
loop, ``run_steps``), and the cost formulas of ``counts``.

Taught in: Chapter 14, "Mixture of experts".
"""

from dtlib.expert_parallel.all_to_all import AllToAll, all_to_all, exchange_counts
from dtlib.expert_parallel.gpt import MoEBlock, moe_gpt, moe_layers, moe_loss
from dtlib.expert_parallel.layer import ExpertParallelMoE
from dtlib.expert_parallel.moe import MoE, MoEConfig, Routing, capacity, route
from dtlib.expert_parallel.parallelism import ExpertParallel, parallelism

__all__ = ["AllToAll", "ExpertParallel", "ExpertParallelMoE", "MoE", "MoEBlock",
           "MoEConfig", "Routing", "all_to_all", "capacity", "exchange_counts",
           "moe_gpt", "moe_layers", "moe_loss", "parallelism", "route"]
