"""Chapter 12's rank code keeps every tensor on the rank's device (NCCL's first rule).

Run under :mod:`device_check` (the world's device made ``meta`` on a CPU rank; see
``tests/test_device_placement.py``): ring attention and Ulysses, the
context-parallel GPT, the sequence-parallel block and the interleaved torch schedule
must produce no record, and their numbers must not change (both attentions still
equal to one process, to ``test_context_parallel.py``'s derived tolerance).
"""

from __future__ import annotations

import pytest

import device_check
from fp32_tolerance import assert_scaled, reorder_rel
from dtlib.chapters.ch06_pipeline_parallel.runs import PP_GPT
from dtlib.chapters.ch12_long_sequences.runs import (attention_checks,
                                                     attention_reference,
                                                     tp_and_sp_block, train_cp,
                                                     train_interleaved)
from dtlib.models.sizes import size
from dtlib.runtime import launch


def ch12_rank_code() -> dict:
    """On every rank: each rank function Chapter 12 launches, once, small."""
    both = attention_checks(True)  # ring attention and Ulysses
    train_cp(size("tiny"), 2, 1)
    tp_and_sp_block(size("tiny"), 2)
    train_interleaved(PP_GPT, 4, 2, 1, 2)
    return {"ring": both["ring"]["out"], "ulysses": both["ulysses"]["out"]}


@pytest.mark.parametrize("world_size", [2])
def test_chapter_12_rank_code_keeps_every_tensor_on_the_device(world_size: int
                                                               ) -> None:
    results = launch.spawn(device_check.checked, world_size, ch12_rank_code,
                           timeout=240, stream=False)
    truth = attention_reference(True, (2, 4, 16, 8))["out"]
    rel = reorder_rel(16 + 8, 6, 16)  # S + D terms, as test_context_parallel.py
    for r in results:
        assert r["violations"] == []
        for name in ("ring", "ulysses"):
            assert_scaled(r["value"][name], truth, rel, name)
