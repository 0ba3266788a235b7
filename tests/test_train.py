"""The capstone script (dtlib.train): it equals its single-process reference, resumes
exactly, refuses what cannot fit, and names bad flags.

Launches go through dtlib.runtime.launch.torchrun (real torchrun, ~5 s each on 2 cores);
the module fixture keeps them to five: DDP straight / crash / resume, FSDP crash /
resume.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn as nn

from dtlib.runtime import launch
from dtlib.train import loop as train
from dtlib.train.loop import DoesNotFit, check_memory, lr_lambda, main, prepare_model
from dtlib.train.config import TrainConfig, parse_args

STEPS = 8
BASE = ["--steps", str(STEPS), "--save-every", "3", "--log-every", "4",
        "--micro-batch", "2", "--dataset-size", "256"]
LOSS_TOL = dict(rtol=1e-5, atol=1e-6)  # fp32, different summation order only


def _run(tmp, name: str, *args: str, nproc: int = 2) -> dict:
    out = os.path.join(tmp, f"{name}.json")
    launch.torchrun("dtlib.train", *BASE, *args, "--summary-json", out,
                    module=True, nproc=nproc, stream=False, timeout=120)
    with open(out) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("train"))
    res = {"straight": _run(tmp, "straight", "--strategy", "ddp")}
    for strategy in ("ddp", "fsdp"):
        ckpt = os.path.join(tmp, f"ckpt_{strategy}")
        args = ("--strategy", strategy, "--ckpt-dir", ckpt)
        res[f"{strategy}_crash"] = _run(tmp, f"{strategy}_crash", *args,
                                        "--stop-after", "5")
        res[f"{strategy}_resume"] = _run(tmp, f"{strategy}_resume", *args)
    return res


def _losses(summary: dict) -> list[float]:
    return [summary["losses"][str(s)] for s in range(1, STEPS + 1)]


def test_two_ranks_equal_one_rank_with_the_same_global_batch(runs):
    # 1 rank x 2 micro-batches of 2 = 2 ranks x 1 micro-batch of 2: same samples.
    single = main([*BASE, "--accum-steps", "2"])
    torch.testing.assert_close(single, runs["straight"]["final_loss"], **LOSS_TOL)


def test_ddp_crash_and_resume_is_bit_exact(runs):
    crash, resumed = runs["ddp_crash"], runs["ddp_resume"]
    assert crash["end_step"] == 5 and resumed["start_step"] == 3  # step 3 saved
    assert resumed["param_sha256"] == runs["straight"]["param_sha256"]
    assert resumed["final_loss"] == runs["straight"]["final_loss"]
    assert crash["losses"]["4"] == resumed["losses"]["4"]  # redone identically


def test_fsdp_crash_and_resume_matches_ddp(runs):
    resumed = runs["fsdp_resume"]
    assert resumed["start_step"] == 3 and resumed["end_step"] == STEPS
    torch.testing.assert_close(resumed["final_loss"], runs["straight"]["final_loss"],
                               **LOSS_TOL)
    torch.testing.assert_close(resumed["param_norm"], runs["straight"]["param_norm"],
                               rtol=1e-6, atol=0)


def test_fp16_crash_and_resume_is_bit_exact(tmp_path):
    """The loss scaler is part of the state: at a first scale of 2**20 the first steps
    overflow and back off, so a resume that restarted the scale would skip other
    steps and end elsewhere."""
    tmp = str(tmp_path)
    args = ("--strategy", "ddp", "--precision", "fp16", "--loss-scale", str(2.0 ** 20))
    straight = _run(tmp, "fp16", *args)
    ckpt = ("--ckpt-dir", os.path.join(tmp, "ckpt"))
    _run(tmp, "fp16_crash", *args, *ckpt, "--stop-after", "5")
    resumed = _run(tmp, "fp16_resume", *args, *ckpt)
    assert straight["loss_scale"] < 2.0 ** 20  # the scale moved before step 3
    assert resumed["start_step"] == 3
    assert resumed["loss_scale"] == straight["loss_scale"]
    assert resumed["param_sha256"] == straight["param_sha256"]
    assert resumed["final_loss"] == straight["final_loss"]


def test_fsdp_resume_survives_damage_and_refuses_another_world_size(tmp_path):
    """Saves at steps 3 and 6; step 6's shard file is truncated (a full disk): the
    resume warns, falls back to step 3, says so, and ends where a straight run does.
    Resuming those 2-rank shards on 1 rank is refused, naming both sizes."""
    tmp = str(tmp_path)
    ckpt = os.path.join(tmp, "ckpt")
    args = ("--strategy", "fsdp", "--ckpt-dir", ckpt)
    _run(tmp, "crash", *args, "--stop-after", "7")
    step6 = os.path.join(ckpt, "step00000006")
    shard = sorted(n for n in os.listdir(step6) if n.endswith(".distcp"))[0]
    with open(os.path.join(step6, shard), "r+b") as f:
        f.truncate(64)
    out = os.path.join(tmp, "resume.json")
    res = launch.torchrun("dtlib.train", *BASE, *args, "--summary-json", out,
                          module=True, nproc=2, stream=False, timeout=120)
    with open(out) as f:
        resumed = json.load(f)
    text = "\n".join(res.outputs.values())
    assert resumed["start_step"] == 3, text
    assert "falling back" in text and "resumed from" in text, text
    straight = _run(tmp, "straight", "--strategy", "fsdp")
    assert resumed["param_sha256"] == straight["param_sha256"]
    with pytest.raises(launch.LaunchError, match="saved by 2 ranks; this job has 1"):
        launch.torchrun("dtlib.train", *BASE, *args, module=True, nproc=1,
                        stream=False, timeout=120)


def test_four_rank_ddp_crash_and_resume_is_bit_exact(tmp_path):
    """With 4 ranks the bucket layout changes the order of the ring's sums: the
    resumed process settles DDP's buckets before its first step, as the fresh one."""
    tmp = str(tmp_path)
    straight = _run(tmp, "straight4", "--strategy", "ddp", nproc=4)
    args = ("--strategy", "ddp", "--ckpt-dir", os.path.join(tmp, "ckpt"))
    _run(tmp, "crash4", *args, "--stop-after", "5", nproc=4)
    resumed = _run(tmp, "resume4", *args, nproc=4)
    assert resumed["start_step"] == 3
    assert resumed["param_sha256"] == straight["param_sha256"]
    assert resumed["final_loss"] == straight["final_loss"]


def test_fsdp_tp_equals_one_process_and_resumes_bit_exactly(tmp_path):
    """4 ranks on a (dp 2, tp 2) mesh: DTensor TP inside, FSDP2 across dp. The two
    tp ranks of a row read the same batch, so the global batch is 2 x micro-batch
    2, as one process accumulating two micro-batches of 2. A run stopped after
    step 5 and resumed from its step-3 checkpoint (2-D DTensor state through DCP)
    ends bit-identical to the uninterrupted 4-rank run. Three launches."""
    tmp = str(tmp_path)
    args = ("--strategy", "fsdp", "--tp", "2")
    straight = _run(tmp, "tp_straight", *args, nproc=4)
    one_json = os.path.join(tmp, "one.json")
    main([*BASE, "--accum-steps", "2", "--summary-json", one_json])
    with open(one_json) as f:
        one = json.load(f)
    assert straight["config"]["tp"] == 2 and straight["world_size"] == 4
    torch.testing.assert_close(_losses(straight), _losses(one), **LOSS_TOL)
    torch.testing.assert_close(straight["param_norm"], one["param_norm"],
                               rtol=1e-6, atol=0)
    ckpt = ("--ckpt-dir", os.path.join(tmp, "ckpt"))
    crash = _run(tmp, "tp_crash", *args, *ckpt, "--stop-after", "5", nproc=4)
    resumed = _run(tmp, "tp_resume", *args, *ckpt, nproc=4)
    assert crash["end_step"] == 5 and resumed["start_step"] == 3
    assert resumed["param_sha256"] == straight["param_sha256"]
    assert resumed["losses"] == {k: v for k, v in straight["losses"].items()
                                 if int(k) > 3}
    assert crash["losses"]["4"] == resumed["losses"]["4"]  # redone identically


def test_accumulation_equals_the_large_micro_batch():
    big = main([*BASE, "--micro-batch", "4"])
    accumulated = main([*BASE, "--micro-batch", "2", "--accum-steps", "2"])
    torch.testing.assert_close(accumulated, big, **LOSS_TOL)


def test_bf16_stays_close_to_fp32():
    fp32 = main(BASE)
    bf16 = main([*BASE, "--precision", "bf16"])
    assert bf16 != fp32  # bf16 really ran
    assert abs(bf16 - fp32) < 0.02 * fp32  # bf16 has ~3 significant digits


@pytest.mark.parametrize("argv, words", [
    (["--strategy", "zero9"], ["--strategy", "strategy='zero9'", "ddp", "fsdp"]),
    (["--accum-steps", "0"], ["--accum-steps", "accum_steps=0", ">= 1"]),
    (["--hidden", "30", "--n-heads", "4"], ["hidden=30", "n_heads=4"]),
    (["--precision", "fp16", "--strategy", "fsdp"], ["fp16", "fsdp"]),
    (["--warmup", "20", "--steps", "10"], ["--warmup", "warmup=20", "steps=10"]),
    (["--lr", "inf"], ["--lr", "lr=inf", "finite"]),
    (["--weight-decay", "nan"], ["--weight-decay", "weight_decay=nan", "finite"]),
    (["--grad-clip", "-1"], ["--grad-clip", ">= 0"]),
    (["--dataset-size", "2", "--micro-batch", "4"],
     ["--dataset-size", "dataset_size=2", "global batch", ">= 4"]),
    (["--ckpt-dir", __file__], ["--ckpt-dir", "is a file", "directory"]),
    (["--tp", "2"], ["--tp", "tp=2", "strategy='fsdp'", "strategy='ddp'"]),
    (["--strategy", "fsdp", "--tp", "3"], ["--tp", "tp=3", "n_heads=4", "divisor"]),
    (["--strategy", "fsdp", "--tp", "2"], ["--tp", "tp=2", "world size 1"]),
])
def test_bad_flags_stop_in_one_argparse_line(argv, words, capsys, tmp_path,
                                             monkeypatch):
    monkeypatch.chdir(tmp_path)  # nothing may be written, here or anywhere
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("python -m dtlib.train: error: "), err
    assert "Traceback" not in "\n".join(err)
    for word in words:
        assert word in err[-1], err
    assert os.listdir(tmp_path) == []


def test_flags_map_to_fields():
    cfg = parse_args(["--accum-steps", "3", "--lr", "0.5", "--ckpt-dir", "x"])
    assert cfg == TrainConfig(accum_steps=3, lr=0.5, ckpt_dir="x")


def test_seven_billion_fp32_ddp_is_refused_on_80_gb():
    with pytest.raises(DoesNotFit, match="112.0 GB"):
        check_memory(7_000_000_000, "ddp", world_size=8, device_gb=80)
    fsdp = check_memory(7_000_000_000, "fsdp", world_size=8, device_gb=80)
    assert fsdp.total == 16 * 7_000_000_000 // 8
    assert check_memory(7_000_000_000, "ddp", 8, None).total == 112e9  # CPU: report
    with pytest.raises(ValueError, match="strategy"):
        check_memory(10, "zero", 1, None)


def test_lr_schedule_warms_up_then_decays():
    lrs = [lr_lambda(s, warmup=2, steps=10, min_lr_ratio=0.1) for s in range(12)]
    assert lrs[0] == 0.5 and lrs[1] == 1.0 and lrs[2] == 1.0
    assert all(a >= b for a, b in zip(lrs[2:], lrs[3:]))
    assert lrs[10] == pytest.approx(0.1) and lrs[11] == pytest.approx(0.1)


def _bn_model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))


def test_batchnorm_becomes_syncbatchnorm_before_wrapping(monkeypatch):
    seen = []  # what DDP would see at wrapping time (a CPU DDP refuses SyncBatchNorm)
    monkeypatch.setattr(train, "DDP", lambda m, **kw: seen.extend(
        type(x).__name__ for x in m.modules()) or m)
    prepare_model(_bn_model(), "ddp", torch.device("cpu"), sync_bn=True)
    assert "SyncBatchNorm" in seen and "BatchNorm1d" not in seen


def _bn_rank() -> list[str]:
    wrapped = prepare_model(_bn_model(), "ddp", torch.device("cpu"))  # CPU: no sync
    return [type(m).__name__ for m in wrapped.module.modules()]


def test_cpu_ddp_keeps_batchnorm():
    assert "BatchNorm1d" in launch.spawn(_bn_rank, 2)[0]


def test_loss_multiplier_checker_accepts_right_and_rejects_wrong(capsys):
    from dtlib.exercises import WrongAnswer
    from dtlib.exercises.train import check_loss_multiplier

    check_loss_multiplier(lambda ws, mb, s, acc: ws / (ws * mb * s * acc))
    assert "right" in capsys.readouterr().out
    with pytest.raises(WrongAnswer, match="divides the summed gradients"):
        check_loss_multiplier(lambda ws, mb, s, acc: 1 / (ws * mb * s * acc))
    with pytest.raises(WrongAnswer, match="expected"):
        check_loss_multiplier(lambda ws, mb, s, acc: 1 / (mb * s))
