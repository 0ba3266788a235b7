"""The GPU suite: ``python -m dtlib.bench gpu`` (``make gpu-check``), a line per check.

On one node with CUDA it runs, with as many ranks as GPUs and NCCL:

- chapters 0, 2, 3, 4, 6, 14 and the capstone (on a token file, ``--attention sdpa``,
  FSDP2 started on the meta device, a rank killed and the run restarted by torchrun),
  each compared with one process (or, for chapter 2's primitives, with the same
  ranks on gloo), as the CPU tests do;
- ``ch15``: our PowerSGD hook against torch's ``powerSGD_hook`` on torch DDP (the
  same losses), DiLoCo's replicas all at the one anchor after each outer step, and
  the slow link holding NCCL's collectives (a DDP step at least its link time);
- ``ch7``: the book's ZeRO-3 under the bf16 ``MixedPrecisionPolicy`` against FSDP2's
  under the same policy on the same NCCL ranks, and the bytes of its collectives;
- ``collectives``: bus bandwidth of ``all_reduce`` (nccl-tests' busbw = algbw x
  2(n-1)/n) and the from-scratch ring's share of it;
- ``matmul``: bf16, fp16 and tf32 TFLOP/s at 4096-16384 as a share of the device's
  dense peak (a table of datasheet numbers; an unknown device prints the TFLOP/s only);
- ``memory``: the caching allocator's peak for one GPT training step against the
  chapter 1 planner (:func:`dtlib.memory.formulas.estimate`);
- ``time_ddp``, ``time_fsdp2``: the step-time model's inputs measured on the GPUs
  (matmul FLOP/s, NCCL's alpha-beta), then the overlapped DDP's and FSDP2's step,
  measured against predicted (Chapter 13).

A machine without CUDA gets one line saying so and exit status 0: nothing is claimed.
The whole suite keeps to ``--budget`` seconds (default 480): a check that would start
after it is reported as SKIP. Exit status 1 when any check fails.

Taught in: the README's "On GPUs" section.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from dtlib.models.sizes import size
from dtlib.runtime import launch
from dtlib.runtime.dist import world

# Each check imports the chapter it runs inside itself: on a machine where one
# chapter's code cannot load (an older torch), that check fails and the rest run.

#: Printed lines instead of a table (read by ``python -m dtlib.bench``).
PRINTS_LINES = True
CHECKS = ("ch0", "ch2", "ch3", "ch4", "ch6", "ch7", "ch14", "ch15", "capstone",
          "collectives", "matmul", "memory", "time_ddp", "time_fsdp2")
#: Dense datasheet peaks in TFLOP/s: (bf16, fp16, tf32), matched on the device name.
PEAKS = (("H100 PCIe", (756.0, 756.0, 378.0)), ("H100", (989.4, 989.4, 494.7)),
         ("H200", (989.4, 989.4, 494.7)), ("GH200", (989.4, 989.4, 494.7)),
         ("B200", (2250.0, 2250.0, 1100.0)), ("A100", (312.0, 312.0, 156.0)),
         ("L40S", (362.1, 362.1, 183.0)), ("L4", (121.0, 121.0, 60.0)),
         ("A10", (125.0, 125.0, 62.5)))
#: Tolerances against one process on another device (summation order only, fp32).
LOSS_ATOL, GRAD_ATOL = 1e-4, 1e-5
#: The backend chapters 0 and 2 must have run on (a test of the suite sets "gloo").
EXPECT_BACKEND = "nccl"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``python -m dtlib.bench gpu``."""
    parser.add_argument("--only", nargs="+", choices=CHECKS, default=list(CHECKS),
                        help="run these checks only")
    parser.add_argument("--budget", type=float, default=480.0,
                        help="seconds for the whole suite (default 480)")


def peak_tflops(name: str) -> tuple[float, float, float] | None:
    """Dense (bf16, fp16, tf32) peak TFLOP/s of the device called ``name``."""
    for key, peaks in PEAKS:
        if key in name:
            return peaks
    return None


# ---- rank functions (run by spawn on every GPU) -------------------------------------

def hello_rank() -> dict[str, Any]:
    """Chapter 0: one all-reduce of rank + 1; the backend and device each rank used."""
    w = world()
    t = torch.tensor([w.rank + 1.0], device=w.device)
    dist.all_reduce(t)
    return {"backend": w.backend, "device": str(w.device), "sum": t.item()}


def collectives_rank() -> dict[str, Any]:
    """Chapter 2: every primitive's before/after and the ring's trace (no timings)."""
    from dtlib.chapters.ch02_collectives.runs import primitive_states, ring_trace_states

    states = primitive_states()
    states.pop("barrier")  # times, not values
    return {"states": states, "ring": ring_trace_states(), "backend": world().backend}


def ddp_rank(steps: int) -> dict[str, Any]:
    """Chapter 3: every DDP variant's losses, step-0 gradients and final parameters."""
    from dtlib.chapters.ch03_data_parallel.runs import train_replica
    from dtlib.data_parallel import VARIANTS

    return {v: train_replica(size("tiny"), v, 2, steps) for v in VARIANTS}


def zero_rank() -> dict[str, float]:
    """Chapter 4: ZeRO 1-3 and FSDP2, largest parameter error against one process."""
    from dtlib.bench.zero import train_rank

    runs = [("zero", 1), ("zero", 2), ("zero", 3), ("fsdp2", 3)]
    return {f"{impl}{stage}": train_rank(impl, stage, "gpt", steps=5)["max_abs_err"]
            for impl, stage in runs}


def pipeline_rank() -> dict[str, Any]:
    """Chapter 6: teaching GPipe/1F1B/ZB-H1/ZB-V and torch's 1F1B against one
    process (ZB-V: its messages ordered for NCCL by ``v_p2p_plan``)."""
    from dtlib.chapters.ch06_pipeline_parallel.runs import compare_all

    PP_GPT = dataclasses.asdict(size("pipeline"))  # the chapter's eight blocks

    m = 2 * dist.get_world_size()
    out = compare_all(PP_GPT, batch=2 * m, n_microbatches=m, steps=3,
                      variants=("ours-gpipe", "ours-1f1b", "torch-1f1b",
                                "ours-zb-h1", "ours-zb-v"))
    out.pop("ref_losses")
    return {k: {d: v[d] for d in ("loss_diff", "grad_diff", "param_diff")}
            for k, v in out.items()}


def experts_rank(moe: Any, steps: int) -> dict[str, Any]:
    """Chapter 14: the expert-parallel MoE layer (k = 1, 2, with and without
    dropping) and the MoE GPT trained with experts over every rank."""
    from dataclasses import replace

    from dtlib.chapters.ch14_experts.runs import layer_check, train_moe
    from dtlib.expert_parallel import parallelism as ep_parallelism

    n = dist.get_world_size()
    layers = {(k, cf): layer_check(replace(moe, top_k=k, capacity_factor=cf))
              for k, cf in ((1, None), (2, None), (2, 1.0))}
    run = train_moe(ep_parallelism(ep=n), size("tiny"), moe, n, steps)
    return {"layers": layers, "losses": run.losses, "grads": run.grads,
            "params": run.params}


# ---- the checks: each returns (ok, detail) -------------------------------------------

def low_comm_rank(steps: int) -> dict[str, Any]:
    """Chapter 15 on this world: PowerSGD ours and torch's, DiLoCo, a slow-link DDP."""
    import numpy as np

    from dtlib.low_comm import DiLoCo
    from dtlib.low_comm.link import Method
    from dtlib.low_comm.timing import (BATCH, INNER, LOW_GPT, token_batches,
                                       train_methods)
    from dtlib.models.gpt import build_gpt
    from dtlib.models.run import RunConfig, run_steps

    # a learnable sequence (each token 7 more than the one before, mod 256)
    tokens = (np.arange(40_000) * 7 % 256).astype(np.uint16)
    ours, theirs = train_methods(tokens, [
        Method("powersgd", rank=2, start_iter=2),
        Method("powersgd", rank=2, start_iter=2, library=True)], [steps, steps])
    diloco = run_steps(DiLoCo(2), build_gpt(LOW_GPT, seed=0),
                       token_batches(tokens, LOW_GPT.seq_len, BATCH),
                       RunConfig(2 * steps, optimizer_kwargs=dict(INNER),
                                 record_grads=False))
    slow = train_methods(tokens, [Method("ddp")], [3], (2e-3, 1e-9))[0]
    return {"ours": ours["losses"], "theirs": theirs["losses"],
            "anchor": diloco.params, "diloco_losses": diloco.losses,
            "slow_times": slow["step_times"],
            "slow_held": [sum(seconds for _op, seconds in _held(step))
                          for step in slow["messages"]]}


def _held(messages: list[tuple[str, int]]) -> list[tuple[str, float]]:
    from dtlib.collectives.cost_model import link_seconds

    n = dist.get_world_size()
    return [(op, link_seconds(op, nbytes, n, 2e-3, 1e-9)) for op, nbytes in messages]


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k].cpu() - b[k].cpu()).abs().max()) for k in b)


def check_ch0(n: int, timeout: float) -> tuple[bool, str]:
    res = launch.spawn(hello_rank, n, timeout=timeout, stream=False)
    want = n * (n + 1) / 2
    ok = all(r["sum"] == want and r["backend"] == EXPECT_BACKEND for r in res)
    return ok, (f"{n} ranks, backends {sorted({r['backend'] for r in res})}, "
                f"devices {[r['device'] for r in res]}, all_reduce sum "
                f"{res[0]['sum']:.0f} (want {want:.0f})")


def check_ch2(n: int, timeout: float) -> tuple[bool, str]:
    nccl = launch.spawn(collectives_rank, n, timeout=timeout, stream=False)
    gloo = launch.spawn(collectives_rank, n, timeout=timeout, stream=False,
                        backend="gloo")
    same = [r["states"] == g["states"] and r["ring"] == g["ring"]
            for r, g in zip(nccl, gloo)]
    ok = all(same) and nccl[0]["backend"] == EXPECT_BACKEND
    return ok, (f"{len(nccl[0]['states'])} primitives and the ring on {n} NCCL ranks "
                f"{'equal' if all(same) else 'DIFFERENT from'} the same on gloo")


def check_ch3(n: int, timeout: float) -> tuple[bool, str]:
    from dtlib.models.reference import reference_gpt_run

    steps, lr = 3, 1e-3
    ref = reference_gpt_run(size("tiny"), 2 * n, steps)
    res = launch.spawn(ddp_rank, n, steps, timeout=timeout, stream=False)
    worst: dict[str, float] = {}
    ok = True
    for variant in res[0]:
        runs = [r[variant] for r in res]
        loss = max(abs(sum(r["losses"][k] for r in runs) / n - ref["losses"][k])
                   for k in range(steps))
        grad = max(_max_diff(r["grads"], ref["grads"]) for r in runs)
        param = max(_max_diff(r["params"], ref["params"]) for r in runs)
        worst[variant] = param
        ok &= loss <= LOSS_ATOL and grad <= GRAD_ATOL and param <= lr
    return ok, ("DDP variants vs one process, max |param diff|: "
                + ", ".join(f"{v} {d:.1e}" for v, d in worst.items()))


def check_ch4(n: int, timeout: float) -> tuple[bool, str]:
    res = launch.spawn(zero_rank, n, timeout=timeout, stream=False)
    worst = {k: max(r[k] for r in res) for k in res[0]}
    ok = all(v <= 1e-4 for v in worst.values())  # the CPU tests' bound (fp32)
    return ok, ("vs one process, max |param diff|: "
                + ", ".join(f"{k} {v:.1e}" for k, v in worst.items()))


def check_ch7(n: int, timeout: float) -> tuple[bool, str]:
    from dtlib.chapters.ch07_mixed_precision.across_ranks import compare_variants

    res = launch.spawn(compare_variants, n, "bf16", timeout=timeout, stream=False)
    worst = {k: max(r[k] for r in res) for k in ("grad", "param")}
    r = res[0]
    ok = (worst["grad"] <= r["rel_grad"] and worst["param"] <= r["rel_param"]
          and r["all_gather"] == 2 * 2 * r["n_params"]  # bf16: 2 bytes, 2 gathers
          and r["reduce_scatter"] == 4 * r["n_params"])  # fp32 reduction
    return ok, (f"bf16 policy, ours vs FSDP2 on {n} ranks, relative to the largest "
                f"gradient: grads {worst['grad']:.1e} (<= {r['rel_grad']:.1e}), params "
                f"{worst['param']:.1e} (<= {r['rel_param']:.1e}); bytes a step: "
                f"all-gather {r['all_gather']}, reduce-scatter {r['reduce_scatter']}")


def check_ch6(n: int, timeout: float) -> tuple[bool, str]:
    res = launch.spawn(pipeline_rank, n, timeout=timeout, stream=False)
    worst = {k: {d: max(r[k][d] for r in res) for d in res[0][k]} for k in res[0]}
    ok = all(w["loss_diff"] <= LOSS_ATOL and w["grad_diff"] <= GRAD_ATOL
             and w["param_diff"] <= 1e-2 for w in worst.values())
    return ok, (f"{n} stages vs one process: "
                + ", ".join(f"{k} loss {w['loss_diff']:.1e} grad {w['grad_diff']:.1e}"
                            for k, w in worst.items()))


def check_ch14(n: int, timeout: float) -> tuple[bool, str]:
    from dataclasses import replace

    from dtlib.chapters.ch14_experts.runs import layer_reference, reference_moe_run
    from dtlib.expert_parallel import MoEConfig

    moe, steps = MoEConfig(n_experts=2 * n), 3
    res = launch.spawn(experts_rank, n, moe, steps, timeout=timeout, stream=False)
    worst = 0.0
    for (k, cf), _ in res[0]["layers"].items():
        ref = layer_reference(replace(moe, top_k=k, capacity_factor=cf), n)
        out = torch.cat([r["layers"][k, cf]["out"] for r in res])
        worst = max(worst, float((out - ref["out"]).abs().max()))
    ref = reference_moe_run(size("tiny"), moe, n, steps, n)
    loss = max(abs(a - b) for r in res for a, b in zip(r["losses"], ref.losses))
    grad = max(_max_diff(r["grads"], ref.grads) for r in res)
    param = max(_max_diff(r["params"], ref.params) for r in res)
    ok = max(worst, grad) <= GRAD_ATOL and loss <= LOSS_ATOL and param <= 1e-4
    return ok, (f"MoE layer and GPT, experts over {n} ranks vs one process: layer out "
                f"{worst:.1e}, loss {loss:.1e}, grad {grad:.1e}, param {param:.1e}")


def check_ch15(n: int, timeout: float) -> tuple[bool, str]:
    res = launch.spawn(low_comm_rank, n, 4, timeout=timeout, stream=False)
    hooks = max(abs(a - b) for r in res for a, b in zip(r["ours"], r["theirs"]))
    # every replica restarts from the one anchor: the same bits on every rank
    spread = max(_max_diff(r["anchor"], res[0]["anchor"]) for r in res)
    falls = res[0]["diloco_losses"][-1] < res[0]["diloco_losses"][0]
    slack = min(t - h for r in res for t, h in zip(r["slow_times"][1:],
                                                     r["slow_held"][1:]))
    ok = hooks <= LOSS_ATOL and spread == 0 and falls and slack >= 0
    return ok, (f"PowerSGD ours vs torch's, max |loss diff| {hooks:.1e}; DiLoCo's "
                f"replicas after the outer steps differ by {spread:.1e}, loss "
                f"{'falls' if falls else 'does not fall'}; slow-link DDP step minus "
                f"its link time, least {1e3 * slack:.1f} ms")


def check_capstone(n: int, timeout: float) -> tuple[bool, str]:
    from dtlib.train import loop
    from dtlib.train.data import main as prepare

    with tempfile.TemporaryDirectory() as tmp:
        # a token file of dtlib's own source (bytes: nothing to download)
        prepare(["prepare", os.path.join(os.path.dirname(loop.__file__), "*.py"),
                 "--tokenizer", "bytes", "--out", os.path.join(tmp, "tokens")])
        base = ["--steps", "6", "--micro-batch", "2", "--log-every", "6",
                "--data", os.path.join(tmp, "tokens"), "--vocab-size", "256",
                "--attention", "sdpa", "--strategy", "fsdp"]
        out = os.path.join(tmp, "summary.json")
        # FSDP2 starts on the meta device; the last rank is SIGKILLed in step 4 and
        # torchrun (--max-restarts=1) starts the group again, which resumes from the
        # step-3 checkpoint by itself.
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={n}", "--max-restarts=1", "--monitor_interval=0.1",
               "-m", "dtlib.train", *base, "--save-every", "3", "--ckpt-dir",
               os.path.join(tmp, "ckpt"), "--kill-at-step", "4", "--summary-json", out]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            return False, f"torchrun exited {done.returncode}: {done.stderr[-300:]}"
        with open(out) as f:
            summary = json.load(f)
        many = float(summary["final_loss"])
        # The same global batch on one GPU, in this process (a world of one): the
        # script's own entry point, without a second torchrun start-up.
        one = loop.main([*base, "--accum-steps", str(n)])
    ok = abs(many - one) <= 1e-4 * max(1.0, abs(one)) and summary["start_step"] == 3
    return ok, (f"FSDP2 from meta, killed in step 4, restarted by torchrun, resumed at "
                f"step {summary['start_step']}: final loss {n} ranks {many:.6f} vs "
                f"1 rank x {n} micro-batches {one:.6f}")


def check_collectives(n: int, timeout: float) -> tuple[bool, str]:
    from dtlib.bench.collectives import time_collectives

    if n < 2:
        return True, "SKIP: one GPU, no link to measure"
    rec = launch.spawn(time_collectives, n, [256 * 2**20], ["all_reduce"], 1.0,
                       timeout=timeout, stream=False)[0]
    bw = {r["variant"]: r["busbw_GBps"] for r in rec}
    return bw["torch"] > 0, (f"all_reduce 256 MiB on {n} GPUs: busbw {bw['torch']:.1f} "
                             f"GB/s (nccl-tests definition); the ring from send/recv "
                             f"{bw['ring']:.1f} GB/s = {bw['ring'] / bw['torch']:.0%}")


def check_matmul(n: int, timeout: float) -> tuple[bool, str]:
    from dtlib.bench.matmul import time_matmul

    device = torch.device("cuda", 0)
    name = torch.cuda.get_device_name(device)
    peaks = peak_tflops(name)
    from dtlib.precision.formats import fp32_matmul_precision

    saved = fp32_matmul_precision()
    parts = []
    try:
        for k, (label, dtype) in enumerate((("bf16", torch.bfloat16),
                                            ("fp16", torch.float16),
                                            ("tf32", torch.float32))):
            fp32_matmul_precision("tf32" if label == "tf32" else "ieee")
            best = max((2 * s ** 3 / time_matmul(s, dtype, device, 3, 10, 3) / 1e12, s)
                       for s in (4096, 8192, 16384))
            share = f" = {best[0] / peaks[k]:.0%} of {peaks[k]:.0f}" if peaks else ""
            parts.append(f"{label} {best[0]:.0f} TFLOP/s at {best[1]}{share}")
    finally:
        fp32_matmul_precision(saved)
    return True, f"{name}: " + "; ".join(parts) + ("" if peaks else " (peak unknown)")


def check_memory(n: int, timeout: float) -> tuple[bool, str]:
    from dtlib.memory.formulas import TrainingConfig, estimate
    from dtlib.models.gpt import GPTConfig, build_gpt, token_batch
    from dtlib.runtime.device_memory import memory_stats

    cfg = GPTConfig(vocab_size=8192, seq_len=1024, n_layers=12, hidden=768,
                    n_heads=12)
    batch, device = 4, torch.device("cuda", 0)
    model = build_gpt(cfg, seed=0).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    idx, tgt = token_batch(cfg, batch, seed=0, device=device)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    model(idx, tgt)[1].backward()
    opt.step()
    torch.cuda.synchronize(device)
    stats = memory_stats(device)
    plan = estimate(TrainingConfig(cfg.n_layers, cfg.hidden, cfg.n_heads,
                                   vocab_size=cfg.vocab_size, seq_len=cfg.seq_len,
                                   micro_batch=batch, precision="fp32",
                                   n_params=n_params))
    states = stats.current_bytes / plan.model_states  # params + grads + Adam now
    peak = stats.peak_bytes / plan.total
    del model, opt
    torch.cuda.empty_cache()
    ok = 0.9 <= states <= 1.1 and 0.5 <= peak <= 1.5
    return ok, (f"GPT {n_params / 1e6:.0f}M fp32 AdamW b={batch} s={cfg.seq_len}: "
                f"allocated after step / planner model states = {states:.2f}, "
                f"allocator peak / planner total = {peak:.2f} "
                f"({stats.peak_bytes / 2**30:.2f} vs {plan.total / 2**30:.2f} GiB)")


def _check_time(strategy: str, n: int, timeout: float) -> tuple[bool, str]:
    import math

    from dtlib.bench.time import measure_and_time
    from dtlib.planner.measure import machine_from
    from dtlib.planner.timing import compare

    if n < 2:
        return True, "SKIP: one GPU, no NCCL link to fit"
    got = launch.spawn(measure_and_time, n, (strategy,), 5, timeout=timeout,
                       stream=False)[0]
    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    machine = machine_from([got["machine"]], cores=None, name=name)
    row = compare(got["steps"], machine)[0]
    ok = math.isfinite(row["ratio"]) and row["ratio"] > 0
    return ok, (f"{strategy} on {n} GPUs: measured {row['measured_s'] * 1e3:.2f} ms, "
                f"predicted {row['predicted_s'] * 1e3:.2f} ms (measured / predicted "
                f"{row['ratio']:.2f}; matmul "
                f"{got['machine']['flops_alone'] / 1e12:.1f} TFLOP/s)")


def check_time_ddp(n: int, timeout: float) -> tuple[bool, str]:
    return _check_time("ddp/overlapped", n, timeout)


def check_time_fsdp2(n: int, timeout: float) -> tuple[bool, str]:
    return _check_time("fsdp", n, timeout)


RUNNERS: dict[str, Callable[[int, float], tuple[bool, str]]] = {
    "ch0": check_ch0, "ch2": check_ch2, "ch3": check_ch3, "ch4": check_ch4,
    "ch6": check_ch6, "ch7": check_ch7, "ch14": check_ch14, "ch15": check_ch15,
    "capstone": check_capstone, "collectives": check_collectives,
    "matmul": check_matmul, "memory": check_memory, "time_ddp": check_time_ddp,
    "time_fsdp2": check_time_fsdp2}


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Run the suite; one printed line and one record per check."""
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        print(f"gpu-check: no CUDA device on this machine (torch {torch.__version__}); "
              "nothing checked, nothing claimed", flush=True)
        return []
    n = torch.cuda.device_count()
    start, records = time.monotonic(), []
    for name in args.only:
        left = args.budget - (time.monotonic() - start)
        if left < 20:
            ok, detail, status = True, "out of the time budget", "SKIP"
        else:
            try:
                ok, detail = RUNNERS[name](n, min(left, 240.0))
                status = "SKIP" if detail.startswith("SKIP") else \
                    ("PASS" if ok else "FAIL")
            except Exception as exc:  # one broken check must not hide the others
                ok, status = False, "FAIL"
                detail = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
        print(f"{status}  {name:<12} {detail}", flush=True)
        records.append({"check": name, "status": status, "detail": detail,
                        "seconds": round(time.monotonic() - start, 1)})
    return records


def exit_status(records: list[dict[str, Any]]) -> int:
    """1 when any check failed, else 0 (read by ``python -m dtlib.bench``)."""
    return int(any(r["status"] == "FAIL" for r in records))
