"""Chapter 14: DeepSpeed's ``deepspeed.moe.layer.MoE`` on 2 gloo ranks equals the
book's MoE layer (same weights, same tokens, top-1 and top-2, nothing dropped).

One launch runs both. Skipped only where DeepSpeed (the ``.[deepspeed]`` extra) is
not installed. Tolerance: as the layer checks of ``test_expert_parallel.py``
(``reorder_rel(4h, 6, ep * tokens)``): the same sums in another order (DeepSpeed
pads every expert's rows to one capacity and runs ``einsum`` dispatches).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("deepspeed", reason="needs the .[deepspeed] extra")

from fp32_tolerance import assert_scaled, reorder_rel  # noqa: E402
from dtlib.chapters.ch14_experts.deepspeed_moe import deepspeed_moe_check  # noqa: E402
from dtlib.chapters.ch14_experts.runs import (HIDDEN, TOKENS,  # noqa: E402
                                              layer_reference)
from dtlib.expert_parallel import MoEConfig  # noqa: E402
from dtlib.runtime import launch  # noqa: E402

WORLD = 2
# aux_loss_coef=0: the reference's loss is sum(out * dout) alone, as DeepSpeed's here
CFGS = [MoEConfig(n_experts=8, top_k=k, aux_loss_coef=0.0) for k in (1, 2)]
REL = reorder_rel(4 * HIDDEN, 6, WORLD * TOKENS)


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return launch.spawn(deepspeed_moe_check, WORLD, CFGS, stream=False, timeout=300)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("i", [0, 1], ids=["top1", "top2"])
def test_deepspeed_moe_equals_ours(runs, i: int) -> None:
    assert all(r["ran"] for r in runs), runs[0]["error"]
    ref = layer_reference(CFGS[i], WORLD)
    got = [r["checks"][i] for r in runs]
    assert_scaled(torch.cat([g["out"] for g in got]), ref["out"], REL, "out")
    assert_scaled(torch.cat([g["dx"] for g in got]), ref["dx"], REL, "dx")
    for name, want in ref["grads"].items():
        if name != "router.weight":
            owner = next(g for g in got if name in g["grads"])
            assert_scaled(owner["grads"][name], want, REL, name)
    if CFGS[i].top_k == 1:  # Switch's loss; DeepSpeed's top-2 counts first choices
        for g in got:
            # E products of means over TOKENS: sums of TOKENS + E terms, two deep
            assert g["aux"] == pytest.approx(g["our_aux"], rel=reorder_rel(TOKENS + 8,
                                                                           2))
