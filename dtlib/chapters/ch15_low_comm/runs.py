"""What Chapter 15 runs on its ranks beyond :mod:`dtlib.low_comm.timing`: DiLoCo on
ranks beside its one-process simulation, on the book's own text.

Taught in: Chapter 15, "Sending less often: local SGD and DiLoCo".
"""

from __future__ import annotations

from typing import Any

import torch

from dtlib.low_comm import DiLoCo, simulate_diloco
from dtlib.low_comm.timing import BATCH, INNER, LOW_GPT, token_batches
from dtlib.models.gpt import build_gpt
from dtlib.models.run import RunConfig, run_steps


def diloco_on_ranks(tokens: Any, inner_steps: int, steps: int) -> dict[str, Any]:
    """On every rank: DiLoCo (DiLoCo's outer step) trains the chapter's GPT with
    AdamW inside for ``steps`` steps of ``tokens``; the anchor's parameters by name
    and the losses."""
    config = RunConfig(steps, optimizer_kwargs=dict(INNER), record_grads=False)
    res = run_steps(DiLoCo(inner_steps), build_gpt(LOW_GPT, seed=0),
                    token_batches(tokens, LOW_GPT.seq_len, BATCH), config)
    return {"params": res.params, "losses": res.losses}


def diloco_simulated(tokens: Any, inner_steps: int, steps: int, replicas: int
                     ) -> dict[str, Any]:
    """The same on one process: ``replicas`` copies, each on its rows, averaged
    every ``inner_steps`` steps (:func:`~dtlib.low_comm.simulate_diloco`), at one
    thread, as each rank computes."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return simulate_diloco(build_gpt(LOW_GPT, seed=0),
                               token_batches(tokens, LOW_GPT.seq_len, BATCH), steps,
                               replicas, inner_steps, **INNER)
    finally:
        torch.set_num_threads(before)
