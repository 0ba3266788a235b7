"""Tensor parallelism on the Hugging Face Llama (q/k/v/gate/up column, o/down row):
ours and torch's DTensor plan train equal to one process on 2 and 4 ranks (one launch
per world size, both variants and a planted defect; the reference once), and the plan
matches transformers' own ``base_model_tp_plan``. Skipped only where transformers
(the ``.[hf]`` extra) is not installed; ``make test`` installs it.

Tolerance (derived as in ``test_tensor_parallel.py``, see ``fp32_tolerance.py``): the
longest reordered reduction has 128 terms (the SwiGLU width and the vocabulary), a
gradient sums ``b * s = 64`` tokens, ~8 reductions on a gradient's path through 2
layers: ``reorder_rel(128, 8, 64)`` of each tensor's largest element; parameters
after 3 steps of SGD with momentum: ``lr * momentum_gain`` times the gradient bound,
doubled for feedback, plus a rounding of each update.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", reason="needs the .[hf] extra (transformers)")

from fp32_tolerance import (assert_all_scaled, assert_scaled,  # noqa: E402
                            reorder_rel, sgd_param_scale)
from dtlib.chapters.ch05_tensor_parallel.hf_runs import (  # noqa: E402
    OPTIMIZER, TINY_LLAMA, llama_reference, llama_run, llama_tp_rank)
from dtlib.chapters.ch05_tensor_parallel.runs import drop_f  # noqa: E402
from dtlib.models import hf  # noqa: E402
from dtlib.runtime import launch  # noqa: E402
from dtlib.tensor_parallel import TensorParallel  # noqa: E402
from dtlib.tensor_parallel.hf_llama import (LLAMA_PLAN,  # noqa: E402
                                            check_llama_tp, plan_table)

STEPS = 3
REL = reorder_rel(128, 8, 4 * TINY_LLAMA["seq_len"])


class WithoutF(TensorParallel):
    """A planted defect: the column layers leave out f (ERRATA 17)."""

    def apply(self, model: torch.nn.Module) -> torch.nn.Module:
        return drop_f(super().apply(model))


def _both() -> dict:
    """One launch per world size: both variants, and the defect."""
    out = {v: llama_tp_rank(v, STEPS) for v in ("ours", "dtensor")}
    out["no_f"] = llama_run(WithoutF("ours"), STEPS)
    return out


@pytest.fixture(scope="module")
def reference():
    return llama_reference(STEPS)


@pytest.fixture(scope="module", params=[2, 4])
def ranks(request):
    return launch.spawn(_both, request.param, stream=False, timeout=500)


def _assert_equal(got, ref, msg: str) -> None:
    assert_scaled(torch.tensor(got.losses), torch.tensor(ref.losses), REL,
                  f"{msg} losses")
    assert_all_scaled(got.grads, ref.grads, REL, f"{msg} grad")
    scale = sgd_param_scale(REL, ref.grads, ref.params, OPTIMIZER["lr"], STEPS,
                            OPTIMIZER["momentum"])
    assert set(got.params) == set(ref.params)
    for name, p in ref.params.items():
        assert_scaled(got.params[name], p, 1.0, f"{msg} param {name}", scale=scale)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("variant", ["ours", "dtensor"])
def test_tp_llama_equals_one_process(reference, ranks, variant):
    world_size = len(ranks)
    n = hf.n_params(hf.build_hf_llama(hf.llama_config(**TINY_LLAMA)))
    for rank, r in enumerate(ranks):
        _assert_equal(r[variant], reference, f"{variant} rank {rank}")
    # each rank keeps 1/tp of the planned weights, all of the rest
    planned = 2 * (4 * 64 * 64 + 3 * 64 * 128)
    assert ranks[0][variant]["local_numel"] == n - planned + planned // world_size


@pytest.mark.timeout(600)
def test_without_f_the_llama_proof_fails(reference, ranks):
    for r in ranks:  # the first step's gradients already fail, and so does the rest
        with pytest.raises(AssertionError, match="no f grad"):
            assert_all_scaled(r["no_f"].grads, reference.grads, REL, "no f grad")
        with pytest.raises(AssertionError):
            _assert_equal(r["no_f"], reference, "no f")


def test_our_plan_is_transformers_plan():
    rows = plan_table(hf.llama_config(**TINY_LLAMA), type(hf.build_hf_llama(
        hf.llama_config(**TINY_LLAMA))))
    for row in rows[:len(LLAMA_PLAN)]:
        style = LLAMA_PLAN[row["module"].removeprefix("layers.*.")]
        assert row["transformers"] == style  # "colwise" / "rowwise" both sides
    assert {r["module"]: r["transformers"] for r in rows}["lm_head"] \
        == "colwise_gather_output"  # theirs also splits the head: ours keeps it whole


def test_indivisible_heads_are_refused():
    model = hf.build_hf_llama(hf.llama_config(hidden=48, n_heads=3))
    with pytest.raises(ValueError, match="num_attention_heads=3"):
        check_llama_tp(model, 2)
    check_llama_tp(model, 3)  # 3 heads, 3 kv heads, SwiGLU width 96: all divide
