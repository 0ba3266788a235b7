"""The one loop's surface: ``RunConfig`` refuses bad input naming the field, ``Every``
is the schedule it says, and the callbacks are called at their named points, in the
documented order, with what each point promises (gradients held after the optimizer
step, every callback asked whether to stop). One process, a tiny GPT."""

from __future__ import annotations

import math

import pytest
import torch

from dtlib.models.gpt import GPTConfig, build_gpt, token_batch
from dtlib.models.run import (AfterOptimizerStep, Callback, Every, OnStepEnd,
                              Parallelism, RunConfig, StepEnd, TrainState, run_steps,
                              tensors_by_name)

CFG = GPTConfig(n_layers=1, hidden=16, seq_len=8, vocab_size=32)


def batches(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return token_batch(CFG, 2, seed=step)


def test_every_is_the_schedule_it_names() -> None:
    assert [s for s in range(1, 13) if Every(5, last=True).due(s, 12)] == [5, 10, 12]
    assert [s for s in range(1, 13) if Every(5).due(s, 12)] == [5, 10]
    assert [s for s in range(1, 13) if Every(0, last=True).due(s, 12)] == [12]
    assert not any(Every().due(s, 12) for s in range(1, 13))
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match=r"Every\(n="):
            Every(bad)


@pytest.mark.parametrize("kwargs, names", [
    ({"steps": 2, "start": 3}, "steps=2.*start=3"),
    ({"steps": -1}, "steps=-1"),
    ({"steps": True}, "steps=True"),
    ({"steps": 2, "max_grad_norm": 0.0}, "max_grad_norm=0.0"),
    ({"steps": 2, "optimizer_class": torch.optim.SGD([torch.zeros(1,
                                                      requires_grad=True)], lr=1)},
     "optimizer_class="),
    ({"steps": 2, "save": 5}, "save=5"),
])
def test_run_config_refuses_naming_the_field(kwargs: dict, names: str) -> None:
    with pytest.raises(ValueError, match=names):
        RunConfig(**kwargs)


def test_run_steps_refuses_what_is_not_a_config() -> None:
    with pytest.raises(ValueError, match="config=3: must be a RunConfig"):
        run_steps(Parallelism(), build_gpt(CFG, 0), batches, 3)
    with pytest.raises(ValueError, match="model=None and state.wrapped=None"):
        run_steps(Parallelism(), None, batches, RunConfig(1))


class Recorder(Callback):
    """Notes every call, with what the loop shows at that point."""

    def __init__(self, stop_after: int | None = None) -> None:
        self.calls: list[tuple[str, int]] = []
        self.stop_after = stop_after
        self.before: dict[int, torch.Tensor] = {}
        self.held: dict[int, bool] = {}
        self.moved: dict[int, bool] = {}

    def step_context(self, step: int):
        self.calls.append(("context", step))
        return super().step_context(step)

    def before_optimizer_step(self, step, wrapped, optimizer) -> None:
        self.calls.append(("before_optimizer_step", step))
        self.before[step] = next(wrapped.parameters()).detach().clone()

    def on_optimizer_step(self, step, wrapped, optimizer) -> None:
        self.calls.append(("on_optimizer_step", step))
        p = next(wrapped.parameters())
        self.held[step] = p.grad is not None
        self.moved[step] = not torch.equal(p.detach(), self.before[step])

    def on_save(self, end: StepEnd) -> None:
        self.calls.append(("on_save", end.step))

    def on_eval(self, end: StepEnd) -> None:
        self.calls.append(("on_eval", end.step))

    def on_step_end(self, end: StepEnd) -> None:
        self.calls.append(("on_step_end", end.step))
        assert end.loss == end.result.losses[-1] and end.seconds > 0

    def should_stop(self, end: StepEnd) -> bool:
        self.calls.append(("should_stop", end.step))
        return self.stop_after is not None and end.step >= self.stop_after


def test_callbacks_run_at_their_points_in_order() -> None:
    rec = Recorder()
    config = RunConfig(4, optimizer_class=torch.optim.SGD,
                       optimizer_kwargs={"lr": 0.1}, max_grad_norm=math.inf,
                       save=Every(2), evaluate=Every(3, last=True))
    res = run_steps(Parallelism(), build_gpt(CFG, 0), batches, config,
                    callbacks=[rec])
    want = []
    for s in range(1, 5):
        want += [("context", s), ("before_optimizer_step", s),
                 ("on_optimizer_step", s)]
        want += [("on_save", s)] * (s % 2 == 0) + [("on_eval", s)] * (s in (3, 4))
        want += [("on_step_end", s), ("should_stop", s)]
    assert rec.calls == want
    assert all(rec.held.values()) and all(rec.moved.values())  # grads still held
    assert len(res.losses) == len(res.grad_norms) == len(res.step_times) == 4


def test_a_resume_takes_the_remaining_steps_and_every_callback_is_asked() -> None:
    model = build_gpt(CFG, 0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    first, second = Recorder(stop_after=4), Recorder()
    res = run_steps(Parallelism(), None, batches, RunConfig(6, start=2),
                    TrainState(model, opt), [first, second])
    assert len(res.losses) == 2  # steps 3 and 4, then the stop
    assert [c for c in second.calls if c[0] == "should_stop"] == [
        ("should_stop", 3), ("should_stop", 4)]
    # batch_fn is asked for the batch after i steps done: 2, then 3.
    asked: list[int] = []
    run_steps(Parallelism(), build_gpt(CFG, 0),
              lambda i: asked.append(i) or batches(i), RunConfig(4, start=2))
    assert asked == [2, 3]


def test_the_one_function_callbacks() -> None:
    ends: list[int] = []
    seen: list[int] = []
    res = run_steps(Parallelism(), build_gpt(CFG, 0), batches, RunConfig(5),
                    callbacks=[OnStepEnd(lambda end: ends.append(end.step)
                                         or end.step == 3),
                               AfterOptimizerStep(lambda s, w, o: seen.append(s))])
    assert ends == seen == [1, 2, 3] and len(res.losses) == 3


def test_a_parallelism_keeps_what_it_learned_per_model_not_per_last_call():
    """Two models through one Parallelism: each model's full state is its own (the
    pipeline's cut and ZeRO-1's optimizer are found by the model), and a model the
    Parallelism never saw is refused by name."""
    from dtlib import pipeline_parallel, zero

    small = GPTConfig(vocab_size=32, seq_len=8, n_layers=2, hidden=16, n_heads=2)
    deep = GPTConfig(vocab_size=32, seq_len=8, n_layers=4, hidden=16, n_heads=2)
    par = pipeline_parallel.parallelism("1f1b", 1)
    a = par.apply(build_gpt(small, 0))
    b = par.apply(build_gpt(deep, 1))
    for model, cfg, seed in ((a, small, 0), (b, deep, 1)):
        want = tensors_by_name(build_gpt(cfg, seed))
        got = par.full_state(model)
        assert got.keys() == want.keys()
        assert all(torch.equal(got[n], want[n]) for n in want)
    with pytest.raises(ValueError, match="wrapped=Linear was not returned"):
        par.full_state(torch.nn.Linear(2, 2))

    z = zero.parallelism(1)
    first, second = z.apply(build_gpt(small, 0)), z.apply(build_gpt(small, 1))
    opt = z.make_optimizer(first, torch.optim.SGD, lr=0.1)
    assert z.optimizer_of(first) is opt
    with pytest.raises(ValueError, match="no ShardedOptimizer was made for it"):
        z.full_state(second, grads=True)
