"""Shortcuts: while a learner's function runs under a checker, what the exercise asks
them to build raises, from wherever it is reached (every alias, captured or not, on
every rank), and the exercise's text says what is switched off."""

from __future__ import annotations

import functools
import importlib
import inspect
import json
import pkgutil
import re
from pathlib import Path

import pytest
from torch.utils.data import DistributedSampler

import dtlib.exercises as ex
from dtlib.exercises import WrongAnswer, checker, passed
from dtlib.exercises.tripwires import (ShortcutTaken, allowed_sentence, guarded,
                                       resolve, shortcut_in, tripwires)

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
CAPTURED_ITER = DistributedSampler.__iter__  # taken before any check, as a cell might


def _checkers() -> dict[str, object]:
    found = {}
    for info in pkgutil.iter_modules(ex.__path__):
        module = importlib.import_module(f"dtlib.exercises.{info.name}")
        for name, obj in vars(module).items():
            if name.startswith("check_") and callable(obj) and hasattr(obj, "forbids"):
                found[name] = obj
    return found


def _exercise_texts() -> dict[str, str]:
    """check_* name -> the text of the exercise whose solution cell calls it."""
    texts = {}
    for path in sorted(NOTEBOOKS.glob("*.ipynb")):
        text = None
        for cell in json.loads(path.read_text())["cells"]:
            source = "".join(cell["source"])
            if cell["cell_type"] == "markdown" and "```{exercise}" in source:
                text = source
            elif cell["cell_type"] == "code" and text is not None:
                for name in re.findall(r"(check_\w+)\(", source):
                    texts.setdefault(name, text)
    return texts


# ---- the mechanism ---------------------------------------------------------------

class _Thing:
    def method(self) -> str:
        return "real"

    def uses_super(self) -> str:  # a closure over __class__
        return super().__repr__()[:1]


def _plain(x: int) -> int:
    return x + 1


def _make_closure():
    k = 5

    def inner(x: int) -> int:
        return x + k

    return inner


_CLOSURE = _make_closure()
HERE = __name__


def test_a_tripwire_is_reached_from_every_alias_and_put_back_after() -> None:
    alias, part, bound = _plain, functools.partial(_plain, 1), _Thing().method
    forbidden = {f"{HERE}:_plain": "the answer", f"{HERE}:_Thing.method": "the answer",
                 f"{HERE}:_Thing.uses_super": "the answer",
                 f"{HERE}:_CLOSURE": "the answer"}
    with tripwires(forbidden):
        for call in (lambda: alias(1), part, bound, lambda: _Thing().uses_super(),
                     lambda: _CLOSURE(1)):
            with pytest.raises(ShortcutTaken, match="your code called `"):
                call()
        with tripwires(forbidden):  # nested: the inner block disarms nothing
            pass
        with pytest.raises(ShortcutTaken):
            alias(1)
    assert (alias(1), part(), bound(), _Thing().uses_super(), _CLOSURE(1)) == (
        2, 2, "real", "<", 6)


def test_guarded_arms_only_during_the_learners_call() -> None:
    truth = {f"{HERE}:_plain": "the checker's truth"}
    cheat = guarded(lambda x: _plain(x), truth)
    honest = guarded(lambda x: x + 1, truth)
    assert honest(1) == _plain(1) == 2  # the truth still runs outside the call
    with pytest.raises(ShortcutTaken, match=r"`tests?.*_plain` \(the checker's truth\)"):
        cheat(1)
    assert inspect.signature(guarded(_plain, truth)).parameters.keys() == {"x"}


def test_a_rank_report_carries_the_tripwires_line() -> None:
    report = ("rank 1 failed:\nTraceback (most recent call last):\n  ...\n"
              "dtlib.exercises.ShortcutTaken: your code called `m.f` (the answer): "
              "this exercise asks you to write it yourself Hint: h\n")
    assert shortcut_in(report) == ("your code called `m.f` (the answer): this exercise "
                                   "asks you to write it yourself Hint: h")
    assert shortcut_in("rank 1 failed: ValueError: no") is None


def test_a_checker_turns_a_shortcut_into_feedback_without_a_seed_note() -> None:
    @checker(forbids={f"{HERE}:_plain": "the answer"})
    def check_demo(fn, seed=None) -> None:
        if fn(1) != 2:
            raise WrongAnswer("wrong")
        passed("ok")

    check_demo(lambda x: x + 1)
    with pytest.raises(ShortcutTaken) as caught:
        check_demo(lambda x: _plain(x))
    assert "seed" not in str(caught.value)
    with pytest.raises(WrongAnswer, match=r"wrong \(cases drawn with seed 3"):
        check_demo(lambda x: x, seed=3)


# ---- every checker's list, and its exercise's text ------------------------------

def test_every_forbidden_function_exists_on_this_torch() -> None:
    missing = [(name, target) for name, check in _checkers().items()
               for target in check.forbids if resolve(target) is None]
    assert not missing


def test_every_checkers_truth_is_switched_off() -> None:
    """A function of a checker's module named for the truth is forbidden there."""
    for info in pkgutil.iter_modules(ex.__path__):
        module = importlib.import_module(f"dtlib.exercises.{info.name}")
        forbidden = {t for name, c in vars(module).items()
                     if name.startswith("check_") and hasattr(c, "forbids")
                     for t in c.forbids}
        truths = {f"{module.__name__}:{name}" for name, obj in vars(module).items()
                  if inspect.isfunction(obj) and obj.__module__ == module.__name__
                  and "truth" in name}
        assert truths <= forbidden, (module.__name__, truths - forbidden)


def test_each_exercise_text_says_what_its_checker_switches_off() -> None:
    texts, checks = _exercise_texts(), _checkers()
    shown = [name for name in texts if name in checks and checks[name].forbids]
    assert len(shown) >= 25
    for name in shown:
        want = " ".join(allowed_sentence(checks[name].forbids).split())
        assert want in " ".join(texts[name].split()), (name, want)


# ---- the shortcuts the issue names, each rejected ---------------------------------

def test_torchs_sampler_captured_before_the_check_is_refused() -> None:
    from dtlib.exercises.data_parallel import check_sampler_indices

    def sampler_indices(n, world_size, rank, epoch, seed):
        sampler = DistributedSampler(range(n), num_replicas=world_size, rank=rank,
                                     seed=seed)
        sampler.set_epoch(epoch)
        return list(CAPTURED_ITER(sampler))

    with pytest.raises(ShortcutTaken, match="DistributedSampler.__iter__"):
        check_sampler_indices(sampler_indices)


def test_the_checkers_truth_is_refused() -> None:
    from dtlib.exercises import pipeline_parallel as pp, trace_reading, zero
    from dtlib.memory.formulas import model_state_bytes
    from dtlib.pipeline_parallel.schedules import simulate
    from dtlib.planner.trace import exposed_comm

    def stage_bytes(n, stage, world_size):
        s = model_state_bytes(n, zero_stage=stage, dp=world_size)
        return {"params": s.params, "grads": s.grads, "optimizer": s.optimizer}

    def first_backward(schedule, stage, p, m, t_f, t_b):
        events = simulate(schedule, p, m, t_f, t_b)
        return min(e.start for e in events if e.stage == stage and e.kind == "B")

    with pytest.raises(ShortcutTaken, match="model_state_bytes"):
        zero.check_stage_memory(stage_bytes)
    with pytest.raises(ShortcutTaken, match="schedules.simulate"):
        pp.check_first_backward(first_backward)
    with pytest.raises(ShortcutTaken, match="exposed_comm"):
        trace_reading.check_exposed_comm(lambda ev: exposed_comm(ev)["exposed_us"])


def test_the_books_f_is_refused_on_ranks() -> None:
    from dtlib.exercises.tensor_parallel import check_column_parallel

    def column_parallel(x, weight_shard, bias_shard):
        import torch.nn.functional as F

        from dtlib.tensor_parallel.mappings import copy_to_tp

        return F.linear(copy_to_tp(x), weight_shard, bias_shard)

    with pytest.raises(ShortcutTaken, match=r"your code called `dtlib\.tensor_parallel"
                                          r"\.mappings\.(copy_to_tp|CopyToParallel)"):
        check_column_parallel(column_parallel)


def test_the_books_pipeline_step_is_refused_on_ranks() -> None:
    from dtlib.exercises.pipeline_parallel import check_pipeline_step

    def pipeline_step(stage, micro_batches, targets, act_shape):
        from dtlib.pipeline_parallel.schedules import pipeline_step as book

        return book(stage, micro_batches, targets, act_shape)

    with pytest.raises(ShortcutTaken, match="schedules.pipeline_step"):
        check_pipeline_step(pipeline_step)


def test_a_mesh_where_the_grid_is_built_by_hand_is_refused() -> None:
    from dtlib.exercises.multi_dim import check_grid_groups

    def build_groups(dp, tp):
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
        return mesh.get_group("tp"), mesh.get_group("dp")

    with pytest.raises(ShortcutTaken, match="init_device_mesh"):
        check_grid_groups(build_groups)


def average_bucket(group, bucket):
    # travels to the ranks as source, like a notebook cell's hook
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import (
        allreduce_hook)

    return allreduce_hook(group, bucket)


def test_torchs_allreduce_hook_is_refused_inside_ddp() -> None:
    from dtlib.exercises.data_parallel import check_bucket_hook

    with pytest.raises(ShortcutTaken, match="allreduce_hook"):
        check_bucket_hook(average_bucket)
