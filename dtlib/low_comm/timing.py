"""DDP, PowerSGD and DiLoCo trained and timed on the fast link and a slow one.

What runs on the ranks for Chapter 15 and ``python -m dtlib.bench link``: the slow
link's alpha-beta fit (:func:`fit_link`), and each :class:`~dtlib.planner.link.Method`
trained through the one loop on a token file (:func:`train_methods`), its losses and
step times, on the fast loopback or inside the slow link.

Taught in: Chapter 15, "When the network is slow".
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from dtlib.collectives.cost_model import fit_alpha_beta
from dtlib.collectives.slow_link import SlowLinkSteps, slow_link
from dtlib.data_parallel import parallelism as ddp_parallelism
from dtlib.data_parallel.parallelism import DataParallelism
from dtlib.low_comm.diloco import DiLoCo
from dtlib.low_comm.powersgd import PowerSGDState, powersgd_hook
from dtlib.models.gpt import GPTConfig, build_gpt
from dtlib.models.run import RunConfig, run_steps
from dtlib.low_comm.link import Method

#: The chapter's GPT: the byte tokenizer's 256 ids, small enough for 300 steps of
#: five methods on two CPU ranks within the page's budget.
LOW_GPT = GPTConfig(vocab_size=256, seq_len=32, n_layers=2, hidden=64, n_heads=4)
#: Global batch (sequences per step, over the replicas) and the inner AdamW.
BATCH = 16
INNER = {"lr": 3e-3, "weight_decay": 0.0, "foreach": True}  # one kernel a step


def fit_link(alpha: float, beta: float, sizes: list[int], repeats: int = 3
             ) -> dict[str, Any]:
    """On every rank: the fastest of ``repeats`` blocking all-reduces of each size
    (bytes) inside ``slow_link(alpha, beta)``, and Chapter 2's fit of them."""
    n = dist.get_world_size()
    times = []
    with slow_link(alpha, beta):
        for nbytes in sizes:
            x = torch.ones(nbytes // 4)
            best = float("inf")
            for _ in range(repeats):
                dist.barrier()
                start = time.perf_counter()
                dist.all_reduce(x)
                best = min(best, time.perf_counter() - start)
            times.append(best)
    a, b = fit_alpha_beta(sizes, times, "all_reduce", n)
    return {"sizes": sizes, "times": times, "alpha": a, "beta": b}


def token_batches(tokens: Any, seq_len: int, batch: int, seed: int = 0) -> Any:
    """``batches(k)``: global batch ``k`` of windows of the token file, in one seeded
    order (the same on every rank; each replica takes its rows)."""
    windows = (len(tokens) - 1) // seq_len
    order = torch.randperm(windows, generator=torch.Generator().manual_seed(seed))

    def batches(k: int) -> tuple[torch.Tensor, torch.Tensor]:
        picks = order[(torch.arange(batch) + k * batch) % windows]
        rows = torch.stack([torch.from_numpy(
            tokens[int(i) * seq_len:int(i) * seq_len + seq_len + 1].astype("int64"))
            for i in picks])
        return rows[:, :-1], rows[:, 1:]
    return batches


def method_parallelism(method: Method) -> Any:
    """The one loop's Parallelism of ``method``: torch DDP, torch DDP with our
    PowerSGD hook (or torch's), or our DiLoCo (DiLoCo's outer lr 0.7 and Nesterov
    0.9)."""
    if method.kind == "diloco":
        return DiLoCo(method.inner_steps)
    if method.kind == "powersgd" and method.library:
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as tp
        state = tp.PowerSGDState(
            process_group=None, matrix_approximation_rank=method.rank,
            start_powerSGD_iter=method.start_iter,
            min_compression_rate=method.min_compression_rate, random_seed=0)
        return DataParallelism("torch", comm_hook=tp.powerSGD_hook, comm_state=state)
    if method.kind == "powersgd":
        state = PowerSGDState(matrix_rank=method.rank, start_iter=method.start_iter,
                              min_compression_rate=method.min_compression_rate)
        return DataParallelism("torch", comm_hook=powersgd_hook, comm_state=state)
    return ddp_parallelism("torch")


def train_methods(tokens: Any, methods: list[Method], steps: list[int],
                  link: tuple[float, float] | None = None) -> list[dict[str, Any]]:
    """On every rank: each method trains the chapter's GPT from the same start for
    its number of ``steps`` on ``tokens`` (a token file's ids,
    ``dtlib.train.tokens.open_tokens``); with ``link = (alpha, beta)`` every
    step on that link (``(0, 0)``: the fast loopback, the same observer open).
    Per method: the losses, the step times, and (with a link) the link seconds and
    message bytes it charged, and each step's ``(op, bytes)`` on the link."""
    out = []
    for method, n_steps in zip(methods, steps):
        callbacks = [SlowLinkSteps(*link)] if link is not None else []
        config = RunConfig(n_steps, optimizer_kwargs=dict(INNER), record_grads=False,
                           record_params=False)
        res = run_steps(method_parallelism(method), build_gpt(LOW_GPT, seed=0),
                        token_batches(tokens, LOW_GPT.seq_len, BATCH), config,
                        callbacks=callbacks)
        row = {"label": method.label, "losses": res.losses,
               "step_times": res.step_times}
        if callbacks:
            row.update(link_s=callbacks[0].link.seconds(),
                       bytes=callbacks[0].link.sent_bytes,
                       messages=callbacks[0].messages)
        out.append(row)
    return out


def time_on_link(tokens: Any, methods: list[Method], steps: list[int], alpha: float,
                 beta: float) -> list[dict[str, Any]]:
    """On every rank: each method for its ``steps`` on the fast loopback, then on a
    link of ``(alpha, beta)``, back to back (the machine's drift between the two
    is what a comparison of them must not see). Per method: both runs' step times,
    and the slow run's link seconds and messages."""
    out = []
    for method, n_steps in zip(methods, steps):
        fast, slow = (train_methods(tokens, [method], [n_steps], link)[0]
                      for link in ((0.0, 0.0), (alpha, beta)))
        out.append({"label": method.label, "fast": fast["step_times"],
                    "slow": slow["step_times"], "link_s": slow["link_s"],
                    "messages": slow["messages"]})
    return out
