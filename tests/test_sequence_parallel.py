"""Chapter 12: Megatron sequence parallelism on top of Chapter 5's tensor parallelism.

One transformer block, sequence parallel on 2 and 4 ranks, equals one process and
tensor parallelism: outputs, input gradients and every parameter gradient. One launch
per world size runs tensor parallelism, sequence parallelism, and sequence
parallelism with the LayerNorm / row-bias gradients left partial (a planted defect
the comparison must catch).

Tolerance (``fp32_tolerance.py``), relative to each tensor's largest element: the
reduce-scatter sums the row layers' partial products in another order than one
process, the LayerNorm gradients are sums of per-rank partial sums, and the kernels
block the split shapes differently: the longest reduction has ``4h = 128`` terms, a
weight gradient sums ``b * s`` tokens of mixed sign, ~8 reductions on the path
(forward and backward): ``reorder_rel(128, 8, b * s)``. A missing all-reduce or a
wrong operator is off by O(1).

Communication: the bytes on the wire (message x ring factor) equal plain tensor
parallelism's exactly. Memory: the bytes saved per rank equal the term-by-term
formula exactly.
"""

from __future__ import annotations

import pytest

from fp32_tolerance import assert_all_scaled, assert_scaled, reorder_rel
from dtlib.chapters.ch12_long_sequences.runs import block_reference, sp_block_run
from dtlib.collectives.cost_model import bus_bandwidth_factor
from dtlib.models.sizes import size
from dtlib.runtime import launch
from dtlib.tensor_parallel.sequence_parallel import block_activation_terms

CFG, BATCH = size("tiny"), 2
REL = reorder_rel(4 * CFG.hidden, 8, BATCH * CFG.seq_len)


def _wire_bytes(summary: list[dict], n: int) -> float:
    return sum(row["bytes"] * bus_bandwidth_factor(row["op"], n) for row in summary)


def _runs() -> dict:
    return {"tp": sp_block_run(CFG, BATCH, False), "sp": sp_block_run(CFG, BATCH, True),
            "partial": sp_block_run(CFG, BATCH, True, allreduce_grads=False)}


@pytest.fixture(scope="module")
def reference() -> dict:
    return block_reference(CFG, BATCH)


@pytest.fixture(scope="module", params=[2, 4])
def ranks(request: pytest.FixtureRequest) -> list[dict]:
    return launch.spawn(_runs, request.param, stream=False, timeout=120)


def _assert_equal(r: dict, ref: dict, label: str) -> None:
    assert_scaled(r["out"], ref["out"], REL, f"{label} out")
    assert_scaled(r["dx"], ref["dx"], REL, f"{label} dx")
    assert_all_scaled(r["grads"], ref["grads"], REL, f"{label} grad")


def test_sequence_parallel_block_equals_one_process_and_tp(ranks: list[dict],
                                                           reference: dict) -> None:
    world_size = len(ranks)
    tp, sp = [r["tp"] for r in ranks], [r["sp"] for r in ranks]
    for label, res in (("tp", tp), ("sp", sp)):
        for r in res:
            _assert_equal(r, reference, label)
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
    assert reference["act_bytes"] == sum(block_activation_terms(s, BATCH, h, a, 1,
                                                                False).values())
    assert sp[0]["act_bytes"] < tp[0]["act_bytes"]


def test_partial_layernorm_gradients_fail_the_proof(ranks: list[dict],
                                                    reference: dict) -> None:
    for r in ranks:
        with pytest.raises(AssertionError, match="ln1.weight"):
            _assert_equal(r["partial"], reference, "partial")
