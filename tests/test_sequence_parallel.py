"""Chapter 12: Megatron sequence parallelism on top of Chapter 5's tensor parallelism.

One transformer block, sequence parallel on 2 and 4 ranks, equals one process and
tensor parallelism: outputs, input gradients and every parameter gradient
(rtol=1e-5, atol=1e-6 in float32: the reduce-scatter sums the row layers' partial
products in another order than one process, and the LayerNorm gradients are now sums
of per-rank partial sums; a missing all-reduce of those or a wrong operator is off by
O(1)). Communication: the bytes on the wire (message x ring factor) equal plain tensor
parallelism's exactly. Memory: the bytes saved per rank equal the term-by-term formula
exactly.
"""

from __future__ import annotations

import pytest
import torch

from dtlib.chapters.ch12_long_sequences.runs import block_reference, sp_block_run
from dtlib.collectives.cost_model import bus_bandwidth_factor
from dtlib.models.sizes import size
from dtlib.runtime import launch
from dtlib.tensor_parallel.sequence_parallel import block_activation_terms

TOL = dict(rtol=1e-5, atol=1e-6)
CFG, BATCH = size("tiny"), 2


def _wire_bytes(summary: list[dict], n: int) -> float:
    return sum(row["bytes"] * bus_bandwidth_factor(row["op"], n) for row in summary)


@pytest.mark.parametrize("world_size", [2, 4])
def test_sequence_parallel_block_equals_one_process_and_tp(world_size: int) -> None:
    ref = block_reference(CFG, BATCH)
    tp = launch.spawn(sp_block_run, world_size, CFG, BATCH, False, stream=False,
                      timeout=120)
    sp = launch.spawn(sp_block_run, world_size, CFG, BATCH, True, stream=False,
                      timeout=120)
    for label, res in (("tp", tp), ("sp", sp)):
        for r in res:
            torch.testing.assert_close(r["out"], ref["out"], **TOL, msg=label)
            torch.testing.assert_close(r["dx"], ref["dx"], **TOL, msg=label)
            assert set(r["grads"]) == set(ref["grads"])
            for name, g in ref["grads"].items():
                torch.testing.assert_close(r["grads"][name], g, **TOL,
                                           msg=f"{label} {name}")
    s, h, a = CFG.seq_len, CFG.hidden, CFG.n_heads
    for phase in ("forward", "backward"):
        ops = {row["op"] for row in sp[0]["comms"][phase]}
        assert ops == {"all_gather", "reduce_scatter"}
        assert _wire_bytes(sp[0]["comms"][phase], world_size) == pytest.approx(
            _wire_bytes(tp[0]["comms"][phase], world_size), rel=1e-12)
        assert _wire_bytes(tp[0]["comms"][phase], world_size) > 0
    for seq_par, res in ((False, tp), (True, sp)):
        formula = sum(block_activation_terms(s, BATCH, h, a, world_size, seq_par
                                             ).values())
        assert all(r["act_bytes"] == formula for r in res)
    assert ref["act_bytes"] == sum(block_activation_terms(s, BATCH, h, a, 1, False
                                                          ).values())
    assert sp[0]["act_bytes"] < tp[0]["act_bytes"]
