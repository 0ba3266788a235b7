"""Chapters 1 and 7: the build-on-ranks exercises reject each kind of wrong answer and
accept the valid alternatives.

Every answer runs in one launch of 2 gloo ranks (each on the same ranks, in turn); the checker's own verdict (``judge_*``) then reads each answer's
results, as ``check_*`` does after its own launch.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dtlib.exercises import WrongAnswer
from dtlib.exercises import memory as mem
from dtlib.exercises import precision as prec
from dtlib.runtime import launch


# ---- Chapter 1: a layer's saved activations, counted on two ranks -------------------

def _count(layer, x, *, dedup=True, params=False, reduce="sum", unit="bytes"):
    skip = set() if params else {p.untyped_storage().data_ptr()
                                 for p in layer.parameters()}
    saved = []

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in skip and (not dedup or st.data_ptr() not in
                                          {k for k, _ in saved}):
            saved.append((st.data_ptr(), st.nbytes() if unit == "bytes"
                          else t.numel()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x)
    n = sum(v for _, v in saved)
    if reduce == "none":
        return n
    total = torch.tensor([n], dtype=torch.int64, device=x.device)
    if reduce == "gather":  # a valid alternative: gather every count, then add
        parts = [torch.zeros_like(total) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, total)
        return int(sum(p.item() for p in parts))
    dist.all_reduce(total, op=dist.ReduceOp.MAX if reduce == "max" else
                    dist.ReduceOp.SUM)
    return int(total.item())


def right_count(layer, x):
    return _count(layer, x)


def gathered_count(layer, x):
    return _count(layer, x, reduce="gather")


def local_count(layer, x):
    return _count(layer, x, reduce="none")


def max_count(layer, x):
    return _count(layer, x, reduce="max")


def undeduplicated_count(layer, x):
    return _count(layer, x, dedup=False)


def count_with_params(layer, x):
    return _count(layer, x, params=True)


def element_count(layer, x):
    return _count(layer, x, unit="elements")


SAVED_ANSWERS = {"right": right_count, "gathered": gathered_count,
                 "local": local_count, "max": max_count,
                 "undeduplicated": undeduplicated_count, "params": count_with_params,
                 "elements": element_count}


@pytest.fixture(scope="module")
def saved_results(launched):
    return launched["saved"]


@pytest.mark.parametrize("name", ["right", "gathered"])
def test_saved_bytes_accepts_a_sum_over_ranks(saved_results, name, capsys):
    mem.judge_saved_bytes(saved_results[name])
    assert "Correct" in capsys.readouterr().out


@pytest.mark.parametrize("name, match", [
    ("local", "rank 0 returned"), ("max", "one rank's own count"),
    ("undeduplicated", "too many"), ("params", "too many"),
    ("elements", "too few")])
def test_saved_bytes_rejects(saved_results, name, match):
    with pytest.raises(WrongAnswer, match=match):
        mem.judge_saved_bytes(saved_results[name])


def test_saved_bytes_truth_is_the_measured_block():
    # The formula the checker holds answers to equals what measure_gpt_layer measures
    # (the difference of two models), for a shape the checker uses.
    from dtlib.memory import measure_gpt_layer
    from dtlib.models.gpt import GPTConfig

    s, h, a, b0, _ = mem.SAVED_CASES[0]
    cfg = GPTConfig(n_layers=1, seq_len=s, hidden=h, n_heads=a)
    assert measure_gpt_layer(cfg, b0) == mem.saved_bytes_truth(s, h, a, (b0,))


# ---- Chapter 7: a loss-scaler step that the ranks agree on ------------------------

def _scaler(grads, scale, tracker, interval, *, agree=True, nan=True,
            reset_on_growth=True, reset_on_skip=True, unscale=True, op="max",
            looks_at=None):
    if looks_at is not None:  # one tensor, or one element, stands for all
        bad = ~torch.isfinite(looks_at(grads)).all()
    elif nan:
        bad = torch.stack([(~torch.isfinite(g)).any() for g in grads]).any()
    else:  # looks for inf only
        bad = torch.stack([torch.isinf(g).any() for g in grads]).any()
    found = bad.float().reshape(1)
    if agree:
        dist.all_reduce(found, op=dist.ReduceOp.MAX if op == "max" else
                        dist.ReduceOp.SUM)
    if unscale:
        for g in grads:
            g.div_(scale)
    if found.item() > 0:
        return True, scale * 0.5, 0 if reset_on_skip else tracker
    tracker += 1
    if tracker == interval:
        return False, scale * 2.0, 0 if reset_on_growth else tracker
    return False, scale, tracker


def right_scaler(g, s, t, i):
    return _scaler(g, s, t, i)


def summed_flag_scaler(g, s, t, i):  # valid: SUM of flags, then "> 0"
    return _scaler(g, s, t, i, op="sum")


def inf_only_scaler(g, s, t, i):
    return _scaler(g, s, t, i, nan=False)


def no_tracker_reset_on_growth(g, s, t, i):
    return _scaler(g, s, t, i, reset_on_growth=False)


def no_tracker_reset_on_skip(g, s, t, i):
    return _scaler(g, s, t, i, reset_on_skip=False)


def local_scaler(g, s, t, i):
    return _scaler(g, s, t, i, agree=False)


def not_unscaling(g, s, t, i):
    return _scaler(g, s, t, i, unscale=False)


def first_element_of_the_second(g, s, t, i):  # where the checker once poisoned
    return _scaler(g, s, t, i, looks_at=lambda gs: gs[1][0])


def last_tensor_only(g, s, t, i):
    return _scaler(g, s, t, i, looks_at=lambda gs: gs[-1])


SCALER_ANSWERS = {"right": right_scaler, "grads[1][0]": first_element_of_the_second,
                  "grads[-1]": last_tensor_only, "summed": summed_flag_scaler,
                  "inf_only": inf_only_scaler,
                  "growth_tracker": no_tracker_reset_on_growth,
                  "skip_tracker": no_tracker_reset_on_skip, "local": local_scaler,
                  "not_unscaled": not_unscaling}


def _every_answer(saved, scaler):
    return ([mem.saved_on_rank(a) for a in saved],
            [prec.scaler_on_rank(a) for a in scaler])


@pytest.fixture(scope="module")
def launched():
    """Both chapters' answers, in one launch of 2 ranks."""
    saved, scaler = list(SAVED_ANSWERS), list(SCALER_ANSWERS)
    ranks = launch.spawn(_every_answer, 2, [SAVED_ANSWERS[n] for n in saved],
                         [SCALER_ANSWERS[n] for n in scaler], timeout=120,
                         stream=False)
    return {"saved": {n: [ranks[0][0][i], ranks[1][0][i]] for i, n in enumerate(saved)},
            "scaler": {n: [ranks[0][1][i], ranks[1][1][i]]
                       for i, n in enumerate(scaler)}}


@pytest.fixture(scope="module")
def scaler_results(launched):
    return launched["scaler"]


# One host read per tensor is refused: tests/test_exercises.py::test_scaler_step_checker.
@pytest.mark.parametrize("name", ["right", "summed"])
def test_scaler_accepts(scaler_results, name, capsys):
    prec.judge_scaler_steps(scaler_results[name])
    assert "Correct" in capsys.readouterr().out


@pytest.mark.parametrize("name, match", [
    ("inf_only", "nan.*skip=False"), ("growth_tracker", "growth_tracker="),
    ("skip_tracker", "growth_tracker="), ("local", "the ranks disagree"),
    ("not_unscaled", "not unscaled"), ("grads[1][0]", "skip=False"),
    ("grads[-1]", "skip=False")])
def test_scaler_rejects(scaler_results, name, match):
    with pytest.raises(WrongAnswer, match=match):
        prec.judge_scaler_steps(scaler_results[name])


def test_scaler_truth_matches_the_scaler_the_chapter_builds():
    from dtlib.precision.loss_scaling import simulate_scale

    for interval, flags in prec.SCALER_CASES:
        overflows = [any(f) for f in flags]
        assert [t[1] for t in prec.scaler_truth(overflows, interval)] == \
            simulate_scale(overflows, 2.0 ** 16, 2.0, 0.5, interval)
        assert any(f == "nan" and other is None for f, other in flags) or \
            any(f is None and other == "nan" for f, other in flags)


# ---- Chapter 7: constants of any format; Chapter 1: make it fit with a margin ------

def test_format_constants_rejects_a_lookup_of_the_known_formats():
    known = {(5, 10): torch.float16, (8, 7): torch.bfloat16, (8, 23): torch.float32,
             (11, 52): torch.float64}

    def lookup(e, m):
        fi = torch.finfo(known.get((e, m), torch.float32))
        return fi.eps, fi.smallest_normal * fi.eps, fi.max

    with pytest.raises(WrongAnswer, match="6 exponent and 9 mantissa"):
        prec.check_format_constants(lookup)
    with pytest.raises(WrongAnswer, match="largest"):  # the all-ones exponent used
        prec.check_format_constants(lambda e, m: (
            2.0 ** -m, 2.0 ** (2 - 2 ** (e - 1) - m),
            (2 - 2.0 ** -m) * 2.0 ** (2 ** (e - 1))))


def test_fit_accepts_every_margin_up_to_the_recommended_one(capsys):
    device = 80.0
    seen = set()
    for k in range(11):  # margins 0 .. RESERVED_MAX_FRACTION of the device
        answer = mem.fitting_combinations(
            device, k / 10 * mem.RESERVED_MAX_FRACTION * device)
        seen.add(frozenset(answer))
        mem.check_fitting_combinations(answer)
    assert len(seen) >= 2  # the margin changes the answer, and both are accepted
    assert capsys.readouterr().out.count("Correct") == 11
    too_big = mem.fitting_combinations(device, 3 * mem.RESERVED_MAX_FRACTION * device)
    if too_big != min(seen, key=len):
        with pytest.raises(WrongAnswer, match="left out"):
            mem.check_fitting_combinations(too_big)
    # a set no margin gives: a cheaper pair left out while a dearer one is kept
    truth = mem.fitting_combinations(device)
    with pytest.raises(WrongAnswer):
        mem.check_fitting_combinations(truth - {(3, "full")})
