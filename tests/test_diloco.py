"""Chapter 15 (first part): local SGD and DiLoCo (dtlib.low_comm.diloco), proven.

- H = 1 with an outer SGD of lr 1 and no momentum, inner SGD with momentum (linear in
  the gradient): the average of the replicas' one-step updates is data parallelism's
  step, so the ranks train as one process does (Chapter 6's GPT and optimizer, its
  derived tolerances), on 2 and 4 gloo ranks.
- Any H, DiLoCo's Nesterov outer step: the ranks equal the one-process simulation of
  the replicas (``simulate_diloco``, run at the ranks' thread count: a CPU matmul's
  blocking, hence its rounding, depends on it); each replica's inner steps are the
  same kernels on the same rows, so the only difference is the order the all-reduce sums
  the n pseudo-gradients in: at most (n - 1) eps of the summed magnitudes per outer
  step, and the last bit of the anchor it moves, carried into the next rounds
  (bounded as Chapter 6's SGD trajectories are).
- What travels: one all-reduce of every parameter per outer step, 1/H of DDP's
  all-reduces of the gradients, the same bytes each, counted by the one observer.
- A run stopped between outer steps and resumed from the saved replica and
  OuterStepping state (anchor, both optimizers, steps taken) is the same run, bit
  for bit.
"""

from __future__ import annotations

import pytest
import torch

from test_pipeline_parallel import _scale, loss_rel, param_atol

from dtlib.chapters.ch06_pipeline_parallel.runs import LR, OPTIMIZER, PP_GPT, reference
from dtlib.collectives.accounting import count_comms
from dtlib.low_comm import DiLoCo, simulate_diloco
from dtlib.models.gpt import GPTConfig, build_gpt
from dtlib.models.reference import gpt_batches
from dtlib.models.run import RunConfig, TrainState, run_steps
from dtlib.runtime import launch

BATCH = 8


def _train(inner_steps: int, outer_lr: float, outer_momentum: float, steps: int
           ) -> dict:
    """On every rank: DiLoCo trains Chapter 6's GPT with its optimizer; the
    parameters after ``steps`` and the all-reduces issued."""
    cfg = GPTConfig(**PP_GPT)
    opt = dict(OPTIMIZER)
    config = RunConfig(steps, optimizer_class=opt.pop("optimizer_class"),
                       optimizer_kwargs=opt)
    par = DiLoCo(inner_steps, outer_lr, outer_momentum)
    with count_comms() as log:
        res = run_steps(par, build_gpt(cfg, seed=0), gpt_batches(cfg, BATCH), config)
    sizes = [r.bytes for r in log.records if r.op == "all_reduce"]
    return {"params": res.params, "losses": res.losses, "all_reduce_bytes": sizes}


@pytest.mark.parametrize("world_size", [2, 4])
def test_one_inner_step_and_a_plain_outer_step_is_data_parallel(world_size) -> None:
    steps = 4
    ref = reference(PP_GPT, BATCH, steps)
    g = _scale(ref)
    for r in launch.spawn(_train, world_size, 1, 1.0, 0.0, steps, stream=False,
                          timeout=120):
        torch.testing.assert_close(r["losses"], ref["losses"], atol=0,
                                   rtol=loss_rel(BATCH))
        for n, q in r["params"].items():
            torch.testing.assert_close(q, ref["params"][n], rtol=0,
                                       atol=param_atol(BATCH, steps, g), msg=n)
    # not vacuous: training moved the parameters far more than the tolerance
    start = build_gpt(GPTConfig(**PP_GPT), seed=0).state_dict()
    moved = max((ref["params"][n] - start[n]).abs().max().item() for n in ref["params"])
    assert moved > 100 * param_atol(BATCH, steps, g)


@pytest.mark.parametrize("world_size", [2, 4])
def test_any_h_equals_the_one_process_simulation(world_size) -> None:
    h, rounds = 3, 2
    ranks = launch.spawn(_train, world_size, h, 0.7, 0.9, h * rounds, stream=False,
                         timeout=120)
    cfg = GPTConfig(**PP_GPT)
    opt = dict(OPTIMIZER)
    before = torch.get_num_threads()
    torch.set_num_threads(launch.threads_per_rank(world_size))  # the ranks' kernels
    try:
        sim = simulate_diloco(build_gpt(cfg, seed=0), gpt_batches(cfg, BATCH),
                              h * rounds, world_size, h, 0.7, 0.9,
                              opt.pop("optimizer_class"), **opt)
    finally:
        torch.set_num_threads(before)
    # the all-reduce's order: (n - 1) eps of the summed magnitudes per outer step,
    # through the outer step's lr (1 + momentum)^2, and the anchor's own last bit
    # (its update's rounding may land either side), into the next rounds' inner
    # steps (twice, as Chapter 6's SGD bound doubles for the feedback)
    eps = torch.finfo(torch.float32).eps
    atol = 2 * rounds * eps * (0.7 * 1.9 ** 2 * (world_size - 1) * sim["max_delta_sum"]
                               + sim["max_param"])
    for r in ranks:
        for n, q in r["params"].items():
            torch.testing.assert_close(q, sim["params"][n], rtol=0, atol=atol, msg=n)
        torch.testing.assert_close(r["losses"], sim["losses"], atol=0,
                                   rtol=loss_rel(BATCH))
    # not vacuous: the outer step moved the anchor far more than the tolerance
    start = build_gpt(cfg, seed=0).state_dict()
    moved = max((sim["params"][n] - start[n]).abs().max().item() for n in sim["params"])
    assert moved > 1e3 * atol
    # DiLoCo is not DDP: its replicas drift apart between outer steps
    ref = reference(PP_GPT, BATCH, h * rounds)
    assert max((sim["params"][n] - ref["params"][n]).abs().max().item()
               for n in sim["params"]) > 1e3 * atol


def test_an_outer_step_sends_the_parameters_once_every_h_steps() -> None:
    h, rounds = 3, 2
    r = launch.spawn(_train, 2, h, 0.7, 0.9, h * rounds, stream=False, timeout=120)[0]
    n_params = sum(p.numel() for p in build_gpt(GPTConfig(**PP_GPT)).parameters())
    big = [b for b in r["all_reduce_bytes"] if b > 64]  # the logged loss's are 4 B
    assert big == [4 * n_params] * rounds  # DDP: h * rounds of them, the same size
    assert len(r["all_reduce_bytes"]) - len(big) == h * rounds  # one loss a step


def test_bad_settings_name_the_argument() -> None:
    with pytest.raises(ValueError, match="inner_steps=0"):
        DiLoCo(0)
    with pytest.raises(ValueError, match="outer_lr=0"):
        DiLoCo(2, 0)
    with pytest.raises(ValueError, match="outer_momentum=1.0"):
        DiLoCo(2, 0.7, 1.0)
    cfg = GPTConfig(**PP_GPT)
    with pytest.raises(ValueError, match="steps=5 must be a multiple of inner_steps=2"):
        simulate_diloco(build_gpt(cfg), gpt_batches(cfg, BATCH), 5, 2, 2)


def _resumed(inner_steps: int, stop: int, steps: int) -> dict:
    """On every rank: ``stop`` steps, the replica and its OuterStepping state saved
    (in memory) and loaded into a fresh model and DiLoCo, then on to ``steps``; and
    the same ``steps`` in one go."""
    cfg = GPTConfig(**PP_GPT)
    opt = dict(OPTIMIZER)
    kind = opt.pop("optimizer_class")

    def run(start: int, end: int, saved: dict | None = None):
        par = DiLoCo(inner_steps)
        config = RunConfig(end, start=start, optimizer_class=kind, optimizer_kwargs=opt,
                           record_grads=False)
        model = build_gpt(cfg, seed=0)
        optimizer = par.make_optimizer(model, kind, **opt)
        if saved is not None:  # what a checkpoint of the run restores
            model.load_state_dict(saved["model"])
            optimizer.load_state_dict(saved["optimizer"])
        res = run_steps(par, None, gpt_batches(cfg, BATCH), config,
                        TrainState(wrapped=model, optimizer=optimizer))
        return res, {"model": {k: v.clone() for k, v in model.state_dict().items()},
                     "optimizer": optimizer.state_dict()}

    whole, _ = run(0, steps)
    _, saved = run(0, stop)
    resumed, _ = run(stop, steps, saved)
    return {"whole": whole.params, "resumed": resumed.params}


def test_a_run_resumed_mid_outer_step_is_the_same_run() -> None:
    # H = 3, stopped after step 4 (one inner step into the second outer round): the
    # anchor, both optimizers' state and the step count come back, bit for bit
    for r in launch.spawn(_resumed, 2, 3, 4, 6, stream=False, timeout=120):
        assert r["whole"].keys() == r["resumed"].keys()
        for n, q in r["whole"].items():
            assert torch.equal(q, r["resumed"][n]), n
