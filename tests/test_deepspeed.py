"""DeepSpeed, run: ``deepspeed.initialize`` at ZeRO-1/2/3 on 2 CPU ranks (gloo) trains
the tiny Hugging Face Llama equal to one process, to the book's ZeRO and to FSDP2:
losses, parameters and per-rank model-state bytes.

One launch runs all seven trainings (DeepSpeed 1-3, ours 1-3, FSDP2). Skipped only
where DeepSpeed or transformers (the ``.[deepspeed]`` and ``.[hf]`` extras) are not
installed; ``make test`` installs both.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", reason="needs the .[hf] extra (transformers)")
pytest.importorskip("deepspeed", reason="needs the .[deepspeed] extra")

from dtlib.chapters.ch04_zero_fsdp.deepspeed_runs import (  # noqa: E402
    compare_rank, reference_run, train_rank)
from dtlib.runtime import launch  # noqa: E402

WORLD = 2
#: fp32 everywhere; the implementations sum the same gradients in different orders
#: (bucketed reduce-scatter vs all-reduce vs one process), and AdamW divides each
#: update by sqrt(v), so a rounding difference in a tiny gradient can move its
#: parameter by ~1e-5 after three steps at lr 1e-2 (parameters are ~0.02-1).
PARAM_TOL = dict(rtol=0, atol=1e-4)
LOSS_TOL = dict(rtol=1e-6, atol=1e-6)


@pytest.fixture(scope="module")
def runs():
    return launch.spawn(compare_rank, WORLD, stream=False, timeout=500)


@pytest.fixture(scope="module")
def reference():
    return reference_run(WORLD)


@pytest.mark.timeout(600)  # the fixture's launch runs inside the first test
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_deepspeed_equals_ours_and_one_process(runs, reference, stage):
    ds, ours = runs[0][f"deepspeed{stage}"], runs[0][f"ours{stage}"]
    torch.testing.assert_close(ds["losses"], ours["losses"], **LOSS_TOL)
    torch.testing.assert_close(ds["losses"], reference["losses"], **LOSS_TOL)
    assert ds["losses"][-1] < ds["losses"][0]  # it trained
    for name, ref in reference["params"].items():
        torch.testing.assert_close(ds["params"][name], ours["params"][name],
                                   **PARAM_TOL)
        torch.testing.assert_close(ds["params"][name], ref, **PARAM_TOL)


def test_deepspeed_zero3_equals_fsdp2(runs, reference):
    ds, fsdp = runs[0]["deepspeed3"], runs[0]["fsdp2"]
    torch.testing.assert_close(ds["losses"], fsdp["losses"], **LOSS_TOL)
    for name in reference["params"]:
        torch.testing.assert_close(ds["params"][name], fsdp["params"][name],
                                   **PARAM_TOL)


def test_model_state_bytes_per_rank(runs):
    psi = runs[0]["ours1"]["n_params"]
    assert psi == 98_624  # divisible by 2: no padding in the shards
    shard = 4 * psi // WORLD  # fp32 bytes of 1/N of the parameters
    for rank in runs:
        # ZeRO-3: DeepSpeed, ours and FSDP2 hold exactly the same bytes: 16 Psi / N
        assert rank["deepspeed3"]["state"]["total"] == rank["ours3"]["state"]["total"] \
            == rank["fsdp2"]["state"]["total"] == 4 * shard
        for stage in (1, 2, 3):
            ds, ours = rank[f"deepspeed{stage}"]["state"], rank[f"ours{stage}"]["state"]
            assert ds["optimizer"] == ours["optimizer"] == 2 * shard  # AdamW m, v
        for stage in (1, 2):
            ds = rank[f"deepspeed{stage}"]["state"]
            # full fp32 parameters + a fp32 master copy of the own partition
            assert ds["params"] == 4 * psi + shard and ds["master"] == shard
            # DeepSpeed 0.19 partitions gradients at stage 1 too (one code path
            # with stage 2): the own partition plus at most one bucket in flight
            assert shard <= ds["grads"] < 2 * shard
        assert rank["ours1"]["state"]["grads"] == 4 * psi  # ours: full at stage 1
        assert rank["ours2"]["state"]["grads"] == shard


def test_bad_impl_and_stage_are_named():
    with pytest.raises(ValueError, match="impl='megatron'"):
        train_rank("megatron")
    with pytest.raises(ValueError, match="stage=2 not allowed for fsdp2"):
        train_rank("fsdp2", 2)
