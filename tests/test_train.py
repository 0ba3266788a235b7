"""The capstone script (dtlib.train): it equals its single-process reference, resumes
exactly, refuses what cannot fit, and names bad flags.

Every run that several tests compare is computed once: the one-process references in
this process (a module fixture), every 2-rank run in ONE ``launch.spawn`` (a rank
function calling the script's ``train`` run after run), every 4-rank run in another.
torchrun starts one job only, in the test of the script under torchrun itself.

Two kinds of claims:
- *bit-exact* (a resume is the uninterrupted run): the parameter digest (sha256 of
  every full fp32 parameter) and the losses are equal, no tolerance.
- *equal to one process* (other world size, other wrapper, TP): the same gradients up
  to summation order, compared with SGD + momentum (``--optimizer sgd``, no gradient
  clipping: AdamW's lr * g / (|g| + eps) and a clipped norm would hide a gradient
  that is off by a constant factor) under :func:`loss_rtol`, derived below; a planted
  defect (the loss multiplier missing its x N) must fail the same comparison.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from dtlib.models.init import storage_bytes
from dtlib.models.run import Parallelism, tensors_by_name, unwrap
from dtlib.runtime import dist as ddist
from dtlib.runtime import launch
from dtlib.runtime.dist import world
from dtlib.train import job as train_job
from dtlib.memory.recompute import RECOMPUTE_MODES
from dtlib.models.gpt import ATTENTION
from dtlib.train import config as config_module
from dtlib.train.config import STRATEGY_NAMES, TrainConfig, parse_args
from dtlib.train.faults import Preemption
from dtlib.train.identity import step_dirs
from dtlib.train.job import DoesNotFit, check_memory, lr_lambda, prepare_model
from dtlib.train.loop import main, train
from dtlib.train.model import build_model, unit_params
from dtlib.train.state import resume
from dtlib.planner.strategies import STRATEGIES, capstone_names
from fp32_tolerance import U32

STEPS = 8
BASE = ["--steps", str(STEPS), "--save-every", "3", "--log-every", "4",
        "--micro-batch", "2", "--dataset-size", "256"]
#: The proofs' optimizer: smooth in the gradient (see the module docstring).
SGD = ["--optimizer", "sgd", "--lr", "0.05", "--grad-clip", "0"]

# ---- the tolerance of "equal to one process" -----------------------------------------
# What can differ between the runs compared: the order of float32 sums (another world
# size adds the ranks' gradients in another order; other shapes, thread counts or
# vector ISAs cut a kernel's reductions differently). A sum of n terms in any order is
# within (n - 1) u sum|terms| of the exact sum (u = 2**-24, float32's unit roundoff);
# the longest sums here are the MLP's dot products (4 x hidden = 256 terms) and the
# token sums of the loss and of every weight gradient (the global batch's 4 x 32 =
# 128 tokens), so each step's loss and gradient move by at most ~256 u relative
# (the loss is a sum of positive terms: its condition number is 1). SGD with momentum
# at lr 0.05 is a smooth step (no normalisation amplifying tiny gradients), so over k
# steps the differences add up linearly: rtol(k) = k x 256 u (1.2e-4 at step 8).
# (We take them to add up, not to compound: a smooth step moves the next gradient by
# lr x curvature x the parameter difference, and lr x curvature is small here.)
# A real defect moves the losses by percent (test_a_missing_x_n_fails_the_comparison).
U = U32  # float32's unit roundoff, 2**-24 (tests/fp32_tolerance.py)
TERMS = max(4 * TrainConfig().hidden, 4 * TrainConfig().seq_len)


def loss_rtol(step: int, terms: int = TERMS) -> float:
    """Relative tolerance of step ``step``'s loss (and, at the last step, of the
    parameter norm) against one process: ``step x terms x u``."""
    return step * terms * U


def losses(summary: dict) -> list[float]:
    """The summary's losses, step 1 first."""
    return [summary["losses"][str(s)] for s in range(1, summary["end_step"] + 1)]


def assert_equal_to_one_process(got: dict, ref: dict, terms: int = TERMS) -> None:
    """Every step's loss within rtol(step), the final parameter norm within
    rtol(last step), of the one-process reference (``terms``: the longest sum)."""
    assert got["end_step"] == ref["end_step"]
    for step, (a, b) in enumerate(zip(losses(got), losses(ref)), start=1):
        torch.testing.assert_close(a, b, rtol=loss_rtol(step, terms), atol=0,
                                   msg=lambda m, s=step: f"step {s}: {m}")
    torch.testing.assert_close(got["param_norm"], ref["param_norm"],
                               rtol=loss_rtol(got["end_step"], terms), atol=0)


# ---- runs ----------------------------------------------------------------------------

def one_process(*argv: str) -> dict:
    """The script in this process (a world of one); its summary as JSON has it."""
    cfg = parse_args(list(argv))
    owns = not dist.is_initialized()
    w = ddist.init()
    try:
        return json.loads(json.dumps(train(cfg, w)))
    finally:
        if owns:
            ddist.destroy()


def _missing_x_n(model: nn.Module, *micro_batch) -> torch.Tensor:
    """The planted defect: the summed loss without DDP's x N undone."""
    return _TOKEN_LOSS(model, *micro_batch) / dist.get_world_size()


_TOKEN_LOSS = train_job.token_loss


class _SignalDuring:
    """``token_loss`` that sends rank 0's own process a real SIGTERM during step
    ``step``'s forward (Slurm's preemption notice arriving mid-step, on one rank)."""

    def __init__(self, step: int) -> None:
        self.step, self.calls = step, 0

    def __call__(self, model: nn.Module, *micro_batch) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.step and dist.get_rank() == 0:
            os.kill(os.getpid(), signal.SIGTERM)
        return _TOKEN_LOSS(model, *micro_batch)


class _CrashDuringSave:
    """``token_loss`` that catches an asynchronous save in flight: rank 0's DCP
    writer is held in ``finish`` (where ``.metadata`` is written) for the save of
    step ``step``; at the next step's forward rank 0 copies ``ckpt_dir`` (what the
    disk holds if the job died now), then lets the writer go."""

    def __init__(self, step: int, ckpt_dir: str, snapshot: str) -> None:
        self.step, self.ckpt_dir, self.snapshot, self.calls = step, ckpt_dir, \
            snapshot, 0

    def __call__(self, model: nn.Module, *micro_batch) -> torch.Tensor:
        self.calls += 1
        writer = torch.distributed.checkpoint.FileSystemWriter
        if dist.get_rank() == 0 and self.calls == 1:  # hold step `step`'s writer
            import threading

            release, original = threading.Event(), writer.finish
            held = f"step{self.step:08d}.tmp"

            def finish(w, *args, **kwargs):
                if os.path.basename(os.fspath(w.path)) == held:
                    # a run that never reaches the release fails, it does not hang
                    assert release.wait(timeout=600), "the writer was never released"
                return original(w, *args, **kwargs)
            self.release, self.original, writer.finish = release, original, finish
        if dist.get_rank() == 0 and self.calls == self.step + 1:
            shutil.copytree(self.ckpt_dir, self.snapshot)
            writer.finish = self.original
            self.release.set()
        return _TOKEN_LOSS(model, *micro_batch)


def rank_runs(plan: list) -> dict:
    """On every rank: each ``(name, argv, defect)`` of ``plan`` through the script's
    ``train``, in turn; a callable entry (file surgery between runs) runs on rank 0.
    ``defect``: True plants the missing x N; a callable replaces ``token_loss``.

    Returns ``{name: summary + {"text": rank 0's output, "warnings": [...]}}``.
    """
    out = {}
    for entry in plan:
        if isinstance(entry, Everywhere):
            out[entry.name] = entry.fn(*entry.args)
            continue
        if callable(entry):
            if dist.get_rank() == 0:
                entry()
            dist.barrier()
            continue
        name, argv, defect = entry
        text = io.StringIO()
        with warnings.catch_warnings(record=True) as caught, \
                contextlib.redirect_stdout(text):
            warnings.simplefilter("always")
            if defect:
                train_job.token_loss = _missing_x_n if defect is True else defect
            try:
                summary = train(parse_args(argv), world())
            finally:
                train_job.token_loss = _TOKEN_LOSS
        out[name] = {**json.loads(json.dumps(summary)), "text": text.getvalue(),
                     "warnings": [str(w.message) for w in caught]}
    return out


class Everywhere:
    """A plan entry that every rank runs: ``fn(*args)``, its result kept as
    ``name`` (rank 0's); flags in ``args`` get the plan's base in front."""

    def __init__(self, name: str, fn, *args) -> None:
        self.name, self.fn, self.args = name, fn, args


def with_base(base: list[str], plan: list) -> list:
    """``plan`` with ``base`` in front of every run's flags."""
    return [Everywhere(e.name, e.fn, *(a if not isinstance(a, list) else [*base, *a]
                                       for a in e.args))
            if isinstance(e, Everywhere) else e if callable(e)
            else (e[0], [*base, *e[1]], e[2]) for e in plan]


def _keep_until(src: str, dst: str, step: int) -> None:
    """Copy ``src``'s checkpoints to ``dst`` without those after ``step`` (a run
    that was stopped there)."""
    shutil.copytree(src, dst)
    for name in os.listdir(dst):
        found = re.search(r"(\d{8})", name)
        if found and int(found.group(1)) > step:
            path = os.path.join(dst, name)
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)


def _damage_newest_shard(src: str, dst: str) -> None:
    """Copy ``src``'s checkpoints to ``dst`` and truncate one shard file of step 6
    there (a full disk)."""
    shutil.copytree(src, dst)
    step6 = os.path.join(dst, "step00000006")
    shard = sorted(n for n in os.listdir(step6) if n.endswith(".distcp"))[0]
    with open(os.path.join(step6, shard), "r+b") as f:
        f.truncate(64)


def sharded_start(argv: list[str]) -> dict:
    """On every rank: the meta-device start-up of ``argv``'s model against the
    whole build (today's: ``build_model`` then ``prepare_model``), and the bytes of
    parameter storage this rank holds after each set-up step."""
    cfg = parse_args(argv)
    strategy = STRATEGIES[cfg.strategy]
    seen: list[tuple[str, int]] = []

    def probe(step: str, model: nn.Module, twin: nn.Module | None) -> None:
        held = storage_bytes(model.parameters())  # this rank's shards (padding too)
        if twin is not None:  # one module's full values, on the CPU
            held += storage_bytes(twin.parameters())
        seen.append((step, held))

    options = train_job.strategy_options(cfg, strategy)
    meta = train_job.start_model(cfg, strategy, strategy.parallelism(options),
                                 world().device, probe)
    whole = prepare_model(build_model(cfg), strategy.parallelism(options),
                          world().device)
    got, ref = tensors_by_name(unwrap(meta)), tensors_by_name(unwrap(whole))
    return {"same_names": sorted(got) == sorted(ref),
            "unequal": [n for n in ref if not torch.equal(got[n], ref[n])],
            "seen": seen, "shard": storage_bytes(meta.parameters()),
            "whole": 4 * sum(p.numel() for p in build_model(cfg).parameters()),
            "unit": 4 * unit_params(cfg)}


def _flat(tree, prefix: str = "") -> dict:
    """Every tensor of a nested state dict, by its dotted path."""
    if torch.is_tensor(tree):
        return {prefix: tree.detach().cpu()}
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) \
        if isinstance(tree, (list, tuple)) else ()
    out = {}
    for key, value in items:
        out.update(_flat(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def loaded_state(argv: list[str], saved: str) -> dict:
    """On every rank: build ``argv``'s job, resume it from its ``--ckpt-dir`` and
    compare the full model and optimizer state it loaded with the checkpoint
    ``saved`` read back on its own (rank 0): tensor by tensor, bit for bit."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                         get_state_dict)

    job = train_job.build_job(parse_args(argv), world())
    step = resume(job)
    msd, osd = get_state_dict(job.model, job.optimizer, options=StateDictOptions(
        full_state_dict=True, cpu_offload=True))  # a collective under FSDP2
    loaded = _flat({"model": msd, "optim": osd})
    if dist.get_rank() == 0:
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        whole = os.path.join(os.path.dirname(saved), f"whole-{os.getpid()}.pt")
        dcp_to_torch_save(saved, whole)
        ref = _flat(torch.load(whole, weights_only=False))
        os.remove(whole)  # not a file of the checkpoint directory
    if dist.get_rank() != 0:
        return {}
    return {"step": step, "n": len(ref), "same_keys": sorted(loaded) == sorted(ref),
            "unequal": [k for k in ref if k in loaded
                        and not torch.equal(loaded[k], ref[k])]}


@pytest.fixture(scope="module")
def one(tmp_path_factory):
    """The one-process references, once each: 2 micro-batches of 2 accumulated (the
    global batch of 2 ranks x 2, and of dp 2 x tp 2), one micro-batch of 4 (its log
    also as TensorBoard scalars), bf16."""
    torch.set_num_threads(1)
    logs = tmp_path_factory.mktemp("logs")
    log, board = str(logs / "log.jsonl"), str(logs / "tb")
    return {"sgd": one_process(*BASE, *SGD, "--accum-steps", "2"),
            "sgd_big": {**one_process(*BASE, *SGD, "--micro-batch", "4",
                                      "--log-file", log, "--tensorboard", board),
                        "log_file": log, "tensorboard": board},
            "bf16_big": one_process(*BASE, *SGD, "--micro-batch", "4",
                                    "--precision", "bf16")}


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    """Every 2-rank run, in one launch: SGD proofs (DDP, a planted defect, FSDP2);
    DDP, FSDP2 and fp16 crash-and-resume, with their uninterrupted runs."""
    tmp = str(tmp_path_factory.mktemp("train2"))
    ddp_ckpt, fp16_ckpt, sig_ckpt = (os.path.join(tmp, n)
                                     for n in ("ddp", "fp16", "sigterm"))
    fsdp_ckpt, damaged = os.path.join(tmp, "fsdp"), os.path.join(tmp, "fsdp_damaged")
    async_ckpt, torn, ddp_async = (os.path.join(tmp, n) for n in
                                   ("fsdp_async", "fsdp_torn", "ddp_async"))
    ddp_sgd, fsdp_sgd = os.path.join(tmp, "ddp_sgd"), os.path.join(tmp, "fsdp_sgd")
    fp16 = ["--precision", "fp16", "--loss-scale", str(2.0 ** 20)]
    plan = [
        Everywhere("start_fsdp", sharded_start, ["--strategy", "fsdp"]),
        Everywhere("start_ddp", sharded_start, []),
        # saves at 3, 6, 8: the 2-rank checkpoints that 4 ranks resume
        ("ddp_sgd", [*SGD, "--ckpt-dir", ddp_sgd], False),
        ("ddp_defect", SGD, True),
        ("fsdp_sgd", ["--strategy", "fsdp", *SGD, "--ckpt-dir", fsdp_sgd], False),
        ("ddp", [], False),
        ("ddp_crash", ["--ckpt-dir", ddp_ckpt, "--stop-after", "5"], False),
        ("ddp_resume", ["--ckpt-dir", ddp_ckpt], False),
        ("fsdp", ["--strategy", "fsdp"], False),
        # saves at steps 3 and 6, stops after 7 without a final save
        ("fsdp_crash", ["--strategy", "fsdp", "--ckpt-dir", fsdp_ckpt,
                        "--stop-after", "7"], False),
        functools.partial(_damage_newest_shard, fsdp_ckpt, damaged),
        ("fsdp_resume", ["--strategy", "fsdp", "--ckpt-dir", fsdp_ckpt], False),
        ("fsdp_fallback", ["--strategy", "fsdp", "--ckpt-dir", damaged], False),
        # --async-save: the step-6 save is caught in flight (torn: the disk then)
        ("fsdp_async_crash", ["--strategy", "fsdp", "--async-save", "--ckpt-dir",
                              async_ckpt, "--stop-after", "7"],
         _CrashDuringSave(6, async_ckpt, torn)),
        ("fsdp_async_resume", ["--strategy", "fsdp", "--async-save", "--ckpt-dir",
                               async_ckpt], False),
        functools.partial(shutil.copytree, torn, torn + "_resumed"),  # kept as torn
        ("fsdp_torn_resume", ["--strategy", "fsdp", "--ckpt-dir", torn + "_resumed"],
         False),
        ("ddp_async_crash", ["--async-save", "--ckpt-dir", ddp_async,
                             "--stop-after", "5"], False),
        ("ddp_async_resume", ["--async-save", "--ckpt-dir", ddp_async], False),
        ("fp16", fp16, False),
        ("fp16_crash", [*fp16, "--ckpt-dir", fp16_ckpt, "--stop-after", "5"], False),
        ("fp16_resume", [*fp16, "--ckpt-dir", fp16_ckpt], False),
        # SIGTERM during step 4 on rank 0: both ranks save step 4 and leave
        ("sigterm", ["--ckpt-dir", sig_ckpt, "--keep-last", "1"], _SignalDuring(4)),
        ("sigterm_resume", ["--ckpt-dir", sig_ckpt, "--keep-last", "1"], False),
    ]
    res = launch.spawn(rank_runs, 2, with_base(BASE, plan), stream=False,
                       timeout=900)[0]
    res["fsdp_ckpt"], res["sig_ckpt"], res["torn"] = fsdp_ckpt, sig_ckpt, torn
    res["ckpt"] = {"ddp": ddp_sgd, "fsdp": fsdp_sgd}
    return res


#: The resume-elsewhere runs: global batch 4 on 2 ranks (micro-batch 2) and on 4
#: (micro-batch 1), SGD (the module docstring), by strategy.
ELSEWHERE = {"ddp": SGD, "fsdp": ["--strategy", "fsdp", *SGD]}
#: (the strategy that saved, the one that resumes): the same, and switched (one
#: checkpoint format for every strategy).
SWITCHES = (("ddp", "ddp"), ("fsdp", "fsdp"), ("ddp", "fsdp"), ("fsdp", "ddp"))


def switch_name(saver: str, resumer: str) -> str:
    """``ddp`` for a DDP checkpoint resumed by DDP, ``ddp_to_fsdp`` for a switch."""
    return saver if saver == resumer else f"{saver}_to_{resumer}"


def elsewhere_plan(saved: dict, tmp: str, ranks: int) -> list:
    """Each strategy's checkpoint of the other world size, cut back to step 6 (a
    run stopped there), resumed by the same strategy and by the other one: its
    loaded state read, then the run continued to 8."""
    micro = ["--micro-batch", str(4 // ranks)]
    plan = []
    for saver, resumer in SWITCHES:
        name = switch_name(saver, resumer)
        ckpt = os.path.join(tmp, f"{name}_from_other")
        argv = [*ELSEWHERE[resumer], *micro, "--ckpt-dir", ckpt]
        plan += [functools.partial(_keep_until, saved[saver], ckpt, 6),
                 Everywhere(f"{name}_loaded", loaded_state, argv,
                            os.path.join(ckpt, "step00000006")),
                 (f"{name}_elsewhere", argv, False)]
    return plan


@pytest.fixture(scope="module")
def four(tmp_path_factory, two):
    """Every 4-rank run, in one launch: DDP crash-and-resume (the ring's sum order
    depends on the bucket layout), FSDP2 x TP on a (dp 2, tp 2) mesh, the sharded
    start-ups, the 2-rank checkpoints resumed here and the uninterrupted runs
    they are compared with (whose checkpoints 2 ranks resume in ``back``)."""
    tmp = str(tmp_path_factory.mktemp("train4"))
    ddp_ckpt, tp_ckpt = os.path.join(tmp, "ddp"), os.path.join(tmp, "tp")
    tp = ["--strategy", "fsdp", "--tp", "2"]
    ckpt = {name: os.path.join(tmp, f"{name}_sgd") for name in ELSEWHERE}
    plan = [
        Everywhere("start_fsdp", sharded_start, ["--strategy", "fsdp"]),
        Everywhere("start_tp", sharded_start, tp),
        *[(f"{name}_sgd", [*flags, "--micro-batch", "1", "--ckpt-dir", ckpt[name]],
           False) for name, flags in ELSEWHERE.items()],
        *elsewhere_plan(two["ckpt"], tmp, 4),
        ("ddp", [], False),
        ("ddp_crash", ["--ckpt-dir", ddp_ckpt, "--stop-after", "5"], False),
        ("ddp_resume", ["--ckpt-dir", ddp_ckpt], False),
        ("tp_sgd", [*tp, *SGD], False),
        ("tp", tp, False),
        ("tp_crash", [*tp, "--ckpt-dir", tp_ckpt, "--stop-after", "5"], False),
        ("tp_resume", [*tp, "--ckpt-dir", tp_ckpt], False),
    ]
    res = launch.spawn(rank_runs, 4, with_base(BASE, plan), stream=False,
                       timeout=900)[0]
    res["ckpt"], res["tp_ckpt"] = ckpt, tp_ckpt
    return res


@pytest.fixture(scope="module")
def back(tmp_path_factory, four):
    """2 ranks resume the 4-rank checkpoints (a requeue onto fewer nodes)."""
    tmp = str(tmp_path_factory.mktemp("train4to2"))
    return launch.spawn(rank_runs, 2, with_base(BASE, elsewhere_plan(
        four["ckpt"], tmp, 2)), stream=False, timeout=900)[0]


# ---- equal to one process ------------------------------------------------------------

@pytest.mark.timeout(1200)  # the first user of a fixture waits for its launch
def test_two_ranks_equal_one_rank_with_the_same_global_batch(one, two):
    # 1 rank x 2 micro-batches of 2 = 2 ranks x 1 micro-batch of 2: same samples.
    assert_equal_to_one_process(two["ddp_sgd"], one["sgd"])
    assert_equal_to_one_process(two["fsdp_sgd"], one["sgd"])


@pytest.mark.timeout(1200)
def test_a_missing_x_n_fails_the_comparison(one, two):
    """The tolerance catches a real defect: a loss multiplier without the x N that
    undoes DDP's average halves every gradient on 2 ranks."""
    with pytest.raises(AssertionError):
        assert_equal_to_one_process(two["ddp_defect"], one["sgd"])
    gap = abs(losses(two["ddp_defect"])[-1] / losses(one["sgd"])[-1] - 1)
    assert gap > 10 * loss_rtol(STEPS), gap


@pytest.mark.timeout(1200)
def test_fsdp_tp_equals_one_process(one, four):
    """4 ranks on a (dp 2, tp 2) mesh: DTensor TP inside, FSDP2 across dp. The two
    tp ranks of a row read the same batch, so the global batch is 2 x micro-batch
    2, as one process accumulating two micro-batches of 2."""
    tp = four["tp_sgd"]
    assert tp["config"]["tp"] == 2 and tp["world_size"] == 4
    assert_equal_to_one_process(tp, one["sgd"])


def test_accumulation_equals_the_large_micro_batch(one):
    assert_equal_to_one_process(one["sgd"], one["sgd_big"])


def test_tensorboard_scalars_are_the_json_log(one):
    """With the .[tensorboard] extra, every number of every JSON record is a scalar
    of the same name at the same step (TensorBoard keeps float32: within float32's
    rounding, 2**-24 relative, of the JSON's float64)."""
    pytest.importorskip("tensorboard", reason="the tensorboard package is not "
                        "installed (pip install '.[tensorboard]'): TensorBoard "
                        "scalars are not exercised here")
    from tensorboard.backend.event_processing.event_accumulator import \
        EventAccumulator

    run = one["sgd_big"]
    with open(run["log_file"]) as f:
        records = [json.loads(line) for line in f]
    events = EventAccumulator(run["tensorboard"])
    events.Reload()
    for key in ("loss", "lr", "grad_norm", "step_time_s", "tokens_per_s", "mfu",
                "peak_memory_bytes"):
        want = [(r["step"], r[key]) for r in records if key in r]
        got = [(e.step, e.value) for e in events.Scalars(key)]
        assert [s for s, _ in got] == [s for s, _ in want], key
        torch.testing.assert_close([v for _, v in got], [float(v) for _, v in want],
                                   rtol=U, atol=0)


def test_without_tensorboard_the_run_says_one_line_and_continues(tmp_path,
                                                                 monkeypatch,
                                                                 capsys):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # not installed
    log = tmp_path / "log.jsonl"
    main(["--steps", "3", "--log-every", "1", "--micro-batch", "2", "--log-file",
          str(log), "--tensorboard", str(tmp_path / "tb")])
    said = [line for line in capsys.readouterr().out.splitlines()
            if "tensorboard" in line]
    assert len(said) == 1 and "not installed" in said[0], said
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert "run" in records[0] and records[0]["start_step"] == 0  # whose log it is
    assert [r["step"] for r in records[1:]] == [1, 2, 3]
    assert not (tmp_path / "tb").exists()


def test_bf16_stays_close_to_fp32(one):
    bf16, fp32 = one["bf16_big"]["final_loss"], one["sgd_big"]["final_loss"]
    assert bf16 != fp32  # bf16 really ran
    # bf16 keeps 8 significant bits (u = 2**-9 ~ 0.2%); a handful of roundings in
    # the forward's matmuls and norms per step stays well inside 2%.
    assert abs(bf16 - fp32) < 0.02 * fp32


# ---- bit-exact resumes ---------------------------------------------------------------

@pytest.mark.timeout(1200)
def test_ddp_crash_and_resume_is_bit_exact(two):
    crash, resumed = two["ddp_crash"], two["ddp_resume"]
    assert crash["end_step"] == 5 and resumed["start_step"] == 3  # step 3 saved
    assert resumed["param_sha256"] == two["ddp"]["param_sha256"]
    assert resumed["final_loss"] == two["ddp"]["final_loss"]
    assert crash["losses"]["4"] == resumed["losses"]["4"]  # redone identically


@pytest.mark.timeout(1200)
def test_sigterm_saves_at_the_step_boundary_and_the_resume_is_bit_exact(two):
    """A real SIGTERM reaches rank 0 in the middle of step 4: step 4 finishes, both
    ranks agree, save it and leave; the resume ends where the uninterrupted run
    does. --keep-last 1 leaves only the newest checkpoint (8) of 3, 4, 6, 8. A run
    that finds nothing to load says it starts from step 0."""
    sig, resumed = two["sigterm"], two["sigterm_resume"]
    assert sig["preempted"] == "SIGTERM" and sig["end_step"] == 4, sig["text"]
    assert "SIGTERM received: saved step 4" in sig["text"]
    assert resumed["start_step"] == 4 and resumed["preempted"] is None
    assert resumed["param_sha256"] == two["ddp"]["param_sha256"]
    assert [os.path.basename(p) for p in step_dirs(two["sig_ckpt"])] == ["step00000008"]
    assert "no checkpoint in" in two["ddp_crash"]["text"]
    assert "yet: starting from step 0" in two["ddp_crash"]["text"]


@pytest.mark.timeout(1200)
def test_fsdp_crash_and_resume_is_bit_exact(two):
    crash, resumed = two["fsdp_crash"], two["fsdp_resume"]
    assert crash["end_step"] == 7 and resumed["start_step"] == 6
    assert resumed["param_sha256"] == two["fsdp"]["param_sha256"]
    assert resumed["losses"] == {k: v for k, v in two["fsdp"]["losses"].items()
                                 if int(k) > 6}
    # Rank 0 hashed only what it reads: the metadata, its own RNG file, shards that
    # hold its pieces; never rank 1's file, not the whole checkpoint.
    saved = json.load(open(os.path.join(two["fsdp_ckpt"], "step00000006",
                                        "manifest.json")))["files"]
    mine = set(resumed["verified_files"])
    assert {".metadata", "rank0.pt"} <= mine < set(saved) and "rank1.pt" not in mine
    assert any(name.endswith(".distcp") for name in mine), mine
    # Same parameters at step 1, whatever the wrapper: one step of the same sums
    # (AdamW has not yet acted: a one-step loss check).
    torch.testing.assert_close(two["fsdp"]["losses"]["1"], two["ddp"]["losses"]["1"],
                               rtol=loss_rtol(1), atol=0)


@pytest.mark.timeout(1200)
def test_async_saves_resume_as_sync_saves_and_a_torn_one_is_never_loaded(two):
    """--async-save: the checkpoints written in the background resume to the
    digest of the synchronous ones (``dcp.async_save``, FSDP2 and DDP alike). The step-6 save caught in flight (its directory copied while
    rank 0's writer was held before ``.metadata``) is a ``.tmp`` directory that the
    resume does not list: it starts from step 3 and still ends bit-identical."""
    fsdp, crash = two["fsdp"], two["fsdp_async_crash"]
    assert crash["end_step"] == 7
    for name, start in (("fsdp_async_resume", 6), ("fsdp_torn_resume", 3)):
        resumed = two[name]
        assert resumed["start_step"] == start, resumed["text"]
        assert resumed["param_sha256"] == fsdp["param_sha256"], name
    assert two["fsdp_async_resume"]["losses"] == two["fsdp_resume"]["losses"]
    torn = sorted(n for n in os.listdir(two["torn"]) if n.startswith("step"))
    assert torn == ["step00000003", "step00000006.tmp"], torn
    held = os.listdir(os.path.join(two["torn"], "step00000006.tmp"))
    assert ".metadata" not in held and "manifest.json" not in held, held
    assert two["ddp_async_crash"]["end_step"] == 5
    resumed = two["ddp_async_resume"]
    assert resumed["start_step"] == 3
    assert resumed["param_sha256"] == two["ddp"]["param_sha256"]


@pytest.mark.timeout(1200)
def test_fp16_crash_and_resume_is_bit_exact(two):
    """The loss scaler is part of the state: at a first scale of 2**20 the first steps
    overflow and back off, so a resume that restarted the scale would skip other
    steps and end elsewhere."""
    straight, resumed = two["fp16"], two["fp16_resume"]
    assert straight["loss_scale"] < 2.0 ** 20  # the scale moved before step 3
    assert resumed["start_step"] == 3
    assert resumed["loss_scale"] == straight["loss_scale"]
    assert resumed["param_sha256"] == straight["param_sha256"]
    assert resumed["final_loss"] == straight["final_loss"]


@pytest.mark.timeout(1200)
def test_fsdp_resume_survives_damage_and_refuses_another_tp(two, four, capsys):
    """Step 6's shard file truncated (a full disk): the resume warns, falls back to
    step 3 of the same run, says so, and ends where the uninterrupted run does.
    Resuming tp 2's shards with tp 1 is refused (exit 2) in one line naming both
    (the qkv rows are stored in tp 2's interleaved order)."""
    resumed = two["fsdp_fallback"]
    assert resumed["start_step"] == 3, resumed["text"]
    assert any("falling back" in w for w in resumed["warnings"]), resumed["warnings"]
    assert "resumed from" in resumed["text"], resumed["text"]
    assert resumed["param_sha256"] == two["fsdp"]["param_sha256"]
    with pytest.raises(SystemExit) as stop:
        main([*BASE, "--strategy", "fsdp", "--ckpt-dir", four["tp_ckpt"]])
    assert stop.value.code == 2
    assert "was written with --tp 2; this run has --tp 1" in capsys.readouterr().err


@pytest.mark.timeout(1200)
def test_four_rank_ddp_crash_and_resume_is_bit_exact(four):
    """With 4 ranks the bucket layout changes the order of the ring's sums: the
    resumed process settles DDP's buckets before its first step, as the fresh one."""
    resumed = four["ddp_resume"]
    assert resumed["start_step"] == 3
    assert resumed["param_sha256"] == four["ddp"]["param_sha256"]
    assert resumed["final_loss"] == four["ddp"]["final_loss"]


@pytest.mark.timeout(1200)
def test_fsdp_tp_resumes_bit_exactly(four):
    """Stopped after step 5, resumed from its step-3 checkpoint (2-D DTensor state
    through DCP): bit-identical to the uninterrupted 4-rank run."""
    straight, crash, resumed = four["tp"], four["tp_crash"], four["tp_resume"]
    assert crash["end_step"] == 5 and resumed["start_step"] == 3
    assert resumed["param_sha256"] == straight["param_sha256"]
    assert resumed["losses"] == {k: v for k, v in straight["losses"].items()
                                 if int(k) > 3}
    assert crash["losses"]["4"] == resumed["losses"]["4"]  # redone identically


# ---- sharded start-up ----------------------------------------------------------------

def test_meta_start_reproduces_the_seeded_build():
    """One process: built on meta, allocated by to_empty and initialised in place,
    the GPT has build_gpt's values bit for bit (tied and untied head, every size),
    and the caller's generator has not moved."""
    from dtlib.models.gpt import GPT, build_gpt
    from dtlib.models.sizes import SIZES

    for name in ("tiny", "tiny-untied", "pipeline"):
        with torch.device("meta"):
            model = GPT(SIZES[name])
        model.to_empty(device="cpu")
        before = torch.get_rng_state()
        model.init_weights(seed=3)
        assert torch.equal(torch.get_rng_state(), before)
        ref = build_gpt(SIZES[name], seed=3)
        got, want = dict(model.named_parameters()), dict(ref.named_parameters())
        assert sorted(got) == sorted(want), name
        assert all(torch.equal(got[k], want[k]) for k in want), name
        assert all(torch.equal(a, b) for a, b in zip(model.buffers(), ref.buffers()))
        assert (model.head.weight is model.tok_emb.weight) == SIZES[name].tie_weights
    other = build_gpt(SIZES["pipeline"], seed=4)  # another seed, other values
    assert not torch.equal(other.head.weight, got["head.weight"])


@pytest.mark.timeout(1200)
def test_sharded_start_equals_the_whole_build_and_holds_a_shard_plus_a_unit(two, four):
    """FSDP2 on 2 and 4 ranks, FSDP2 x TP on (dp 2, tp 2), DDP on 2: built on meta,
    sharded, allocated, initialised module by module, every full parameter equals
    today's whole build bit for bit. The bytes of parameter storage a rank holds
    (its parameters' distinct storages, plus the CPU copy of the one module being
    initialised), measured after every set-up step, never exceed its shard plus the
    largest unit; the whole fp32 model, which the old start-up held, is more."""
    for run in (two["start_fsdp"], four["start_fsdp"], four["start_tp"],
                two["start_ddp"]):
        assert run["same_names"] and run["unequal"] == [], run
        steps = [step for step, _ in run["seen"]]
        assert steps[:1] == ["meta"] and steps[-1] == "initialised", steps
        assert steps.count("module") > 2, steps  # one record per module written
        peak = max(held for _, held in run["seen"])
        assert peak <= run["shard"] + run["unit"], run
    for run in (two["start_fsdp"], four["start_fsdp"], four["start_tp"]):
        assert dict(run["seen"])["applied"] == 0  # sharded before any allocation
        assert max(held for _, held in run["seen"]) < run["whole"], run
    # The script reports the same measurement: its summary's set-up peak is the one
    # measured step by step above (same flags), and the whole build's is 4 N bytes.
    for job, probed in ((two["fsdp"], two["start_fsdp"]), (four["tp"], four["start_tp"]),
                        (two["ddp"], two["start_ddp"])):
        assert job["startup_bytes"] == {"peak": max(h for _, h in probed["seen"]),
                                        "kept": probed["shard"],
                                        "whole": probed["whole"]}, job["startup_bytes"]
        assert "set-up peak" in job["text"]


def test_check_memory_models_the_start_up_peak():
    """The issue's example: 24e9 params, FSDP2 on 8 x 80 GB. The model states are
    16 B/param / 8 = 48 GB per GPU; a whole fp32 build first needs 4 x 24e9 = 96 GB
    on every GPU (refused now, for that reason); the meta start-up peaks at the
    shard plus one unit, 4 x (3e9 + 1.3e9) = 17.2 GB: approved."""
    n, unit = 24_000_000_000, 1_300_000_000  # unit: a 131k-token embedding + head
    with pytest.raises(DoesNotFit, match="96.0 GB per device while setting up "
                                         r"\(the whole fp32 model"):
        check_memory(n, "fsdp", 8, 80)
    states = check_memory(n, "fsdp", 8, 80, unit_params=unit)
    assert states.total == 48e9
    assert train_job.startup_bytes(n, "fsdp", 8, unit) == 4 * (3e9 + unit)
    with pytest.raises(DoesNotFit, match="shard plus one unit of 2.1e\\+10"):
        check_memory(n, "fsdp", 8, 80, unit_params=21_000_000_000)  # one huge unit
    assert train_job.startup_bytes(n, "ddp", 8, unit) == 4 * (n + unit)


# ---- resume on another world size ----------------------------------------------------

@pytest.mark.timeout(1200)
def test_resume_on_another_world_size_and_strategy_continues(two, four, back):
    """2-rank checkpoints (step 6) resumed on 4 ranks, 4-rank ones on 2, with the
    same global batch (4: micro-batch 2 x 2 ranks, 1 x 4), by the strategy that
    saved them and by the other one (DDP -> FSDP2 and FSDP2 -> DDP: one format).
    The state loaded equals the state saved, tensor by tensor, bit for bit (DCP
    reads each rank's shard, or DDP's whole replica, from the saved chunks); the
    data position is the global samples consumed; the generators are reseeded from
    (seed, step, rank), and the run says what it did. Steps 7 and 8 then equal the
    uninterrupted run of the resuming strategy at the new world size within
    rtol(step): the two differ only in the order of float32 sums in every step
    (another world size, another wrapper), the derivation of loss_rtol above."""
    for new, straight, saver_runs in ((four, four, two), (back, two, four)):
        for saver, resumer in SWITCHES:
            name = switch_name(saver, resumer)
            loaded, run = new[f"{name}_loaded"], new[f"{name}_elsewhere"]
            assert loaded["step"] == 6 and loaded["same_keys"], loaded
            assert loaded["n"] > 0 and loaded["unequal"] == [], loaded
            assert run["start_step"] == 6 and run["end_step"] == STEPS, run["text"]
            assert "generators reseeded" in run["text"], run["text"]
            did = "into its replica (DDP)" if resumer == "ddp" else "its new shards"
            assert did in run["text"], run["text"]
            if saver != resumer:
                assert f"--strategy {saver} -> --strategy {resumer}" in run["text"]
            ref = straight[f"{resumer}_sgd"]  # uninterrupted, at the new world size
            assert ref["world_size"] == run["world_size"] \
                != saver_runs[f"{saver}_sgd"]["world_size"]
            for step in (7, 8):
                torch.testing.assert_close(run["losses"][str(step)],
                                           ref["losses"][str(step)],
                                           rtol=loss_rtol(step), atol=0,
                                           msg=lambda m, n=name: f"{n}: {m}")
            torch.testing.assert_close(run["param_norm"], ref["param_norm"],
                                       rtol=loss_rtol(STEPS), atol=0)


# ---- under torchrun: the script itself -----------------------------------------------

@pytest.mark.timeout(1200)
@pytest.mark.parametrize("ranks, reference", [(2, "two"), (4, "four")])
def test_torchrun_restarts_a_killed_rank_and_the_run_resumes_by_itself(
        tmp_path, ranks, reference, request):
    """``torchrun --max-restarts=1``: the last rank is SIGKILLed in the middle of a
    random step of 4..8 (--kill-at-step, first attempt only); torchrun stops the
    others and starts the group again; they find the newest checkpoint (saves every
    3 steps) and end bit-identical to the uninterrupted run on as many ranks (the
    fixture's, launched by spawn). This is also the proof that the script under
    torchrun (its environment, the ``-m dtlib.train`` entry point, the summary
    file) computes what the spawned script computes, bit for bit; the spawned
    script's equality to one process is the SGD proof above."""
    kill = random.randint(4, 8)
    ckpt, out = tmp_path / "ckpt", tmp_path / "summary.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={ranks}", "--max-restarts=1", "--monitor_interval=0.1",
           "-m", "dtlib.train", *BASE, "--ckpt-dir", str(ckpt), "--kill-at-step",
           str(kill), "--summary-json", str(out)]
    done = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=600)
    text = done.stdout + done.stderr
    assert done.returncode == 0, text
    assert f"rank {ranks - 1}: SIGKILL in step {kill}" in text, text
    summary = json.loads(out.read_text())
    assert summary["world_size"] == ranks
    assert summary["start_step"] == 3 * ((kill - 1) // 3), (kill, text)
    assert summary["end_step"] == STEPS
    uninterrupted = request.getfixturevalue(reference)["ddp"]
    assert summary["param_sha256"] == uninterrupted["param_sha256"], (kill, text)


def test_sigusr1_saves_and_exits_0(tmp_path):
    """Slurm's warning signal (``--signal=USR1@...``) to the script's process, once
    its first checkpoint exists: it saves the step it is in and exits with 0."""
    ckpt = tmp_path / "ckpt"
    proc = subprocess.Popen(
        [sys.executable, "-m", "dtlib.train", "--steps", "2000", "--save-every", "5",
         "--log-every", "1000", "--ckpt-dir", str(ckpt), "--micro-batch", "2"],
        env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 300
        while not step_dirs(str(ckpt)) and proc.poll() is None \
                and time.monotonic() < deadline:
            time.sleep(0.01)
        proc.send_signal(signal.SIGUSR1)
        text, _ = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 0, text
    saved = re.search(r"SIGUSR1 received: saved step (\d+)", text)
    assert saved, text
    newest = os.path.basename(step_dirs(str(ckpt))[0])
    assert newest == f"step{int(saved.group(1)):08d}" and int(saved.group(1)) < 2000


def test_preemption_handlers_are_put_back():
    before = signal.getsignal(signal.SIGTERM)
    with Preemption() as stop:
        assert signal.getsignal(signal.SIGTERM) == stop._handle
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.requested() == "SIGUSR1"
    assert signal.getsignal(signal.SIGTERM) == before


# ---- the parts -----------------------------------------------------------------------

def test_strategy_table_is_the_flag():
    assert capstone_names() == STRATEGY_NAMES


@pytest.mark.parametrize("argv, words", [
    (["--strategy", "zero9"], ["--strategy", "strategy='zero9'", "ddp", "fsdp"]),
    (["--optimizer", "lion"], ["--optimizer", "optimizer='lion'", "adamw", "sgd"]),
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
    (["--attention", "flash"], ["--attention", "'flash'", "sdpa"]),
    (["--recompute", "half"], ["--recompute", "'half'", "selective"]),
    (["--export-hf", "out"], ["--export-hf", "hf-llama"]),
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


def test_recompute_and_attention_flags_change_how_not_what(one):
    """--recompute full/selective run the same ops again in backward: bit-identical
    to the run that saved everything. --attention sdpa is another kernel (other
    summation order): equal to one process within the derived tolerance."""
    flags = [*BASE, *SGD, "--accum-steps", "2"]
    for mode in ("full", "selective"):
        run = one_process(*flags, "--recompute", mode)
        assert run["param_sha256"] == one["sgd"]["param_sha256"], mode
    assert_equal_to_one_process(one_process(*flags, "--attention", "sdpa"), one["sgd"])
    full = build_model(TrainConfig(recompute="full"))
    assert all("forward" in vars(b) for b in full.blocks)  # each block checkpointed
    selective = build_model(TrainConfig(recompute="selective"))
    assert all(b.attn.core_fn is not None for b in selective.blocks)
    assert build_model(TrainConfig(attention="sdpa")).blocks[0].attn.attention == "sdpa"
    assert config_module.ATTENTION == ATTENTION
    assert config_module.RECOMPUTE == RECOMPUTE_MODES


def test_a_toml_config_gives_defaults_that_flags_override(tmp_path, capsys):
    run = tmp_path / "run.toml"
    run.write_text('strategy = "fsdp"\naccum-steps = 2\nlr = 1\nckpt_dir = "c"\n')
    cfg = parse_args(["--config", str(run), "--lr", "0.5"])
    assert (cfg.strategy, cfg.accum_steps, cfg.lr, cfg.ckpt_dir) == ("fsdp", 2, 0.5,
                                                                      "c")
    for text, words in (('acum-steps = 2\n', ["unknown key 'acum-steps'"]),
                        ('steps = "many"\n', ["steps = 'many'", "int"]),
                        ('steps = 2.5\n', ["steps = 2.5", "int"]),
                        ('steps = \n', ["run.toml"])):
        run.write_text(text)
        with pytest.raises(SystemExit) as stop:
            parse_args(["--config", str(run)])
        err = capsys.readouterr().err.strip().splitlines()
        assert stop.value.code == 2 and "--config" in err[-1], err
        assert all(w in err[-1] for w in words), err


def test_async_save_is_a_switch_in_flags_and_toml(tmp_path, capsys):
    assert parse_args(["--async-save"]).async_save is True
    assert parse_args([]).async_save is False
    run = tmp_path / "run.toml"
    run.write_text("async-save = true\n")
    assert parse_args(["--config", str(run)]).async_save is True
    run.write_text("async-save = 1\n")
    with pytest.raises(SystemExit):
        parse_args(["--config", str(run)])
    assert "async-save = 1 is not a bool" in capsys.readouterr().err


def test_flags_map_to_fields():
    cfg = parse_args(["--accum-steps", "3", "--lr", "0.5", "--ckpt-dir", "x",
                      "--optimizer", "sgd"])
    assert cfg == TrainConfig(accum_steps=3, lr=0.5, ckpt_dir="x", optimizer="sgd")


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


class _Seen(Parallelism):
    """What a wrapper would see at wrapping time (a CPU DDP refuses SyncBatchNorm)."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    def apply(self, model: nn.Module) -> nn.Module:
        self.seen += [type(m).__name__ for m in model.modules()]
        return model


def test_batchnorm_becomes_syncbatchnorm_before_wrapping():
    par = _Seen()
    prepare_model(_bn_model(), par, torch.device("cpu"), sync_bn=True)
    assert "SyncBatchNorm" in par.seen and "BatchNorm1d" not in par.seen


def _bn_rank() -> list[str]:
    par = STRATEGIES["ddp"].parallelism()
    wrapped = prepare_model(_bn_model(), par, world().device)  # CPU: no sync
    return [type(m).__name__ for m in wrapped.module.modules()]


def test_cpu_ddp_keeps_batchnorm():
    assert "BatchNorm1d" in launch.spawn(_bn_rank, 2, stream=False)[0]


def test_loss_multiplier_checker_accepts_right_and_rejects_wrong(capsys):
    from dtlib.exercises import WrongAnswer
    from dtlib.exercises.train import check_loss_multiplier

    check_loss_multiplier(lambda ws, mb, s, acc: ws / (ws * mb * s * acc))
    assert "right" in capsys.readouterr().out
    with pytest.raises(WrongAnswer, match="divides the summed gradients"):
        check_loss_multiplier(lambda ws, mb, s, acc: 1 / (ws * mb * s * acc))
    with pytest.raises(WrongAnswer, match="expected"):
        check_loss_multiplier(lambda ws, mb, s, acc: 1 / (mb * s))


def test_checkpoint_bench_refuses_bad_counts():
    import argparse

    from dtlib.bench import checkpoint

    args = argparse.Namespace(world_size=2, strategy="fsdp", saves=0, steps=3,
                              hidden=256, n_layers=4, timeout=60.0)
    with pytest.raises(ValueError, match="--saves=0 must be >= 1"):
        checkpoint.run(args)
