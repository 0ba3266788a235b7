"""DeepSpeed, run: ``deepspeed.initialize`` at ZeRO-1/2/3 on 2 CPU ranks (gloo) trains
the tiny Hugging Face Llama equal to one process, to the book's ZeRO and to FSDP2:
losses, parameters and per-rank model-state bytes; and ZeRO-3 with the optimizer
offloaded holds the host bytes DeepSpeed's stage 3 allocates for it.

One launch runs all seven trainings (DeepSpeed 1-3, ours 1-3, FSDP2), with SGD and
momentum (a trajectory proof; the page runs AdamW); the single-process reference runs
once, in this process. Skipped only where DeepSpeed or transformers (the
``.[deepspeed]`` and ``.[hf]`` extras) are not installed; ``make test`` installs both.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", reason="needs the .[hf] extra (transformers)")
pytest.importorskip("deepspeed", reason="needs the .[deepspeed] extra")

from dtlib.chapters.ch04_zero_fsdp.deepspeed_runs import (  # noqa: E402
    compare_rank, offload_rank, reference_run, train_rank)
from dtlib.runtime import launch  # noqa: E402
from dtlib.zero.deepspeed_engine import offload_host_bytes  # noqa: E402

WORLD = 2
#: SGD with momentum 0.9 (weight decay 0.1, clip 1.0), whose step is smooth in the
#: gradient: the runs compute the same gradients, summed in another order (DeepSpeed's
#: bucketed reduce-scatter or all-reduce, ours, one process over 4 rows x 16 tokens).
#: A sum of n <= 64 fp32 terms in another order differs by at most n u sum|terms| =
#: 64 * 6e-8 * sum|terms| (u = 2**-24); each row's share of a gradient element is
#: O(1) / 64 (softmax - onehot has L1 norm <= 2; RMSNorm'd activations and weights
#: ~1), so |dg| <= ~1e-5 * 10. Three SGD steps at lr 0.05 with momentum scale a
#: gradient difference by at most lr * (1 + 1.9 + 2.71) = 0.28: |dp| <= 3e-5, and the
#: loss of step t moves by |dL/dp| |dp| summed over parameters, bounded the same way
#: relative to the loss (~5): 1e-5 absolute. The tolerances allow 3x that. A missing
#: 1/N (twice the step) moves parameters by ~lr * |g| ~ 1e-3: caught.
OPT = dict(optimizer="sgd", lr=0.05)
PARAM_TOL = dict(rtol=0, atol=1e-4)
LOSS_TOL = dict(rtol=0, atol=3e-5)


@pytest.fixture(scope="module")
def runs():
    return launch.spawn(compare_rank, WORLD, stream=False, timeout=500, **OPT)


@pytest.fixture(scope="module")
def offload():
    return launch.spawn(offload_rank, WORLD, stream=False, timeout=300)


@pytest.fixture(scope="module")
def reference():
    return reference_run(WORLD, **OPT)


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


def test_the_tolerance_sees_a_missing_average(runs, reference):
    """Twice the step (a reduce-scatter without the 1/N, or one rank's gradient
    counted twice) leaves the parameters far outside PARAM_TOL."""
    init = reference_run(WORLD, steps=0, **OPT)["params"]
    ours = runs[0]["ours2"]["params"]
    doubled = {n: 2 * ours[n] - init[n] for n in init}  # twice the movement
    with pytest.raises(AssertionError):
        for name, ref in reference["params"].items():
            torch.testing.assert_close(doubled[name], ref, **PARAM_TOL)


def test_model_state_bytes_per_rank(runs):
    psi = runs[0]["ours1"]["n_params"]
    assert psi == 98_624  # divisible by 2: no padding in the shards
    shard = 4 * psi // WORLD  # fp32 bytes of 1/N of the parameters
    for rank in runs:
        # ZeRO-3: DeepSpeed, ours and FSDP2 hold exactly the same bytes: 12 Psi / N
        # (fp32 parameters, gradients and SGD's momentum, each sharded)
        assert rank["deepspeed3"]["state"]["total"] == rank["ours3"]["state"]["total"] \
            == rank["fsdp2"]["state"]["total"] == 3 * shard
        for stage in (1, 2, 3):
            ds, ours = rank[f"deepspeed{stage}"]["state"], rank[f"ours{stage}"]["state"]
            assert ds["optimizer"] == ours["optimizer"] == shard  # the momentum
        for stage in (1, 2):
            ds = rank[f"deepspeed{stage}"]["state"]
            # full fp32 parameters + a fp32 master copy of the own partition
            assert ds["params"] == 4 * psi + shard and ds["master"] == shard
            # DeepSpeed 0.19 partitions gradients at stage 1 too (one code path
            # with stage 2): the own partition plus at most one bucket in flight
            assert shard <= ds["grads"] < 2 * shard
        assert rank["ours1"]["state"]["grads"] == 4 * psi  # ours: full at stage 1
        assert rank["ours2"]["state"]["grads"] == shard


def test_bad_variant_and_stage_are_named():
    with pytest.raises(ValueError, match="variant='megatron'"):
        train_rank("megatron")
    with pytest.raises(ValueError, match="stage=2 not allowed for fsdp2"):
        train_rank("fsdp2", 2)


#: Host bytes per partition element of ZeRO-3 + offload_optimizer in bf16, tensor by
#: tensor as DeepSpeed 0.19's stage3.py allocates them on the offload device: the fp32
#: master partition (_create_fp32_partitions), AdamW's exp_avg and exp_avg_sq of it,
#: the master's fp32 .grad (initialize_optimizer_states, kept between steps when
#: offloading) and grad_partitions_flat_buffer in the gradient-accumulation dtype,
#: the model's bf16 by default. The ZeRO-Offload paper counts 12 + 2 of these 18.
OFFLOAD_BYTES = {"master": 4, "optimizer": 4 + 4, "fp32_grads": 4, "grad_buffer": 2}


@pytest.mark.timeout(400)  # the fixture's launch runs inside the test
def test_offloaded_optimizer_holds_what_stage3_allocates(offload):
    for rank in offload:
        psi, n, tensors = rank["n_params"], rank["world_size"], rank["n_tensors"]
        assert n == WORLD and rank["losses"][0] == rank["losses"][0]  # it ran, no NaN
        # DeepSpeed partitions each parameter tensor on its own, ceil(numel / N)
        # elements a rank: between Psi / N and (Psi + tensors (N - 1)) / N in all
        lo, hi = psi / n, (psi + tensors * (n - 1)) / n
        for role, per_element in OFFLOAD_BYTES.items():
            assert per_element * lo <= rank["host"][role] <= per_element * hi, role
        per_param = rank["host"]["total"] / psi
        total = sum(OFFLOAD_BYTES.values())
        assert total * lo / psi <= per_param <= total * hi / psi, per_param
        assert rank["host"]["total"] == sum(rank["host"][r] for r in OFFLOAD_BYTES)


def test_offload_host_bytes_refuses_an_engine_without_offload():
    from types import SimpleNamespace

    engine = SimpleNamespace(zero_optimization_stage=lambda: 3,
                             optimizer=SimpleNamespace(offload_optimizer=False))
    with pytest.raises(ValueError, match="stage 3 without offload_optimizer"):
        offload_host_bytes(engine)
