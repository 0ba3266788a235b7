"""Chapter 13's checker: it rejects the kinds of wrong answer it names (no overlap,
perfect overlap, a wrong queue) and accepts valid alternatives."""

from __future__ import annotations

import pytest

from dtlib.exercises import WrongAnswer
from dtlib.exercises import step_time as st


def _queue(forward_s, backward_s, buckets_s):
    k, free = len(buckets_s), 0.0
    for i, c in enumerate(buckets_s):
        free = max(forward_s + (i + 1) * backward_s / k, free) + c
    return max(free, forward_s + backward_s)


def _closed_form(forward_s, backward_s, buckets_s):
    # the same queue written as a max over which bucket starts the final run
    k = len(buckets_s)
    return max([forward_s + backward_s] + [
        forward_s + (i + 1) * backward_s / k + sum(buckets_s[i:]) for i in range(k)])


def _no_overlap(forward_s, backward_s, buckets_s):
    return forward_s + backward_s + sum(buckets_s)


def _perfect_overlap(forward_s, backward_s, buckets_s):
    return max(forward_s + backward_s, sum(buckets_s))


def _last_bucket_only(forward_s, backward_s, buckets_s):
    return forward_s + backward_s + buckets_s[-1]


@pytest.mark.parametrize("answer", [_queue, _closed_form])
def test_overlapped_ddp_accepts(answer, capsys) -> None:
    st.check_overlapped_ddp(answer)
    assert "Correct" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, says", [(_no_overlap, "added every bucket"),
                                         (_perfect_overlap, "perfect overlap"),
                                         (_last_bucket_only, "too")])
def test_overlapped_ddp_rejects(wrong, says) -> None:
    with pytest.raises(WrongAnswer, match=says):
        st.check_overlapped_ddp(wrong)


# ---- predict a step from the measured inputs (the judging half, synthetic inputs) ----

MEASURED = {  # what measure_on_rank returns, in the shape it returns it
    "machine": {"flops_alone": 2e10, "flops_roof": 2.2e10, "flops_shared": 1.9e10,
                "flops_model": 1.1e10,
                "optimizer_s_per_param": 4e-8, "world_size": 2, "device": "cpu",
                "fits": {"all_reduce": (2e-4, 2e-9, None),
                         "reduce_scatter": (3e-4, 4e-9, None),
                         "all_gather": (3e-4, 4e-9, "too noisy")}},
    "step": {"strategy": "ddp/overlapped", "world_size": 2, "step_time_s": 0.5,
             "n_params": 3_300_000, "n_tensors": 53}}


def _two_queues(inp, engine_rule=True, share_rule=True):
    n, cores = inp["world_size"], inp["cores"]
    share = 1.0 if cores is None or not share_rule else min(1.0, cores / n)
    if inp["shared"] is not None and share_rule:
        share = inp["shared"]  # measured with these ranks busy
    compute = inp["flops"] / n / (inp["flops_per_s"] * share)
    opt = inp["n_params"] * inp["optimizer_s_per_param"] / share
    sizes = inp["buckets_bytes"]
    comm = [2 * (n - 1) * inp["alpha_s"] + 2 * (n - 1) / n * b * inp["beta_s_per_byte"]
            for b in sizes]
    shared = cores is not None and n >= cores
    if (shared and share_rule) or not engine_rule:
        return compute + opt + sum(comm)
    done, free = compute / 3, 0.0  # the forward ends, backward chunks follow
    for b, c in zip(sizes, comm):
        done += 2 * compute / 3 * b / sum(sizes)
        free = max(done, free) + c
    return max(free, compute) + opt


def _right(inp):
    return _two_queues(inp)


def _never_overlaps(inp):
    return _two_queues(inp, engine_rule=False)


def _always_overlaps(inp):
    return _two_queues(inp, share_rule=False)


def _rule_not_measured(inp):
    return _two_queues({**inp, "shared": None})  # the rule where a share is measured


def test_predict_step_accepts_the_model_and_reports_the_measured_ratio() -> None:
    from dtlib.chapters.ch13_time.runs import compare, machine_from

    ratio = st.judge_predict_step(_right, MEASURED, cores=2)
    machine = machine_from([MEASURED["machine"]], cores=2)
    assert ratio == pytest.approx(compare([MEASURED["step"]], machine)[0]["ratio"],
                                  rel=1e-12)  # the same model, the same inputs


@pytest.mark.parametrize("wrong, says", [(_never_overlaps, "adds every bucket"),
                                         (_always_overlaps, "nothing hides"),
                                         (_rule_not_measured, "measured share")])
def test_predict_step_rejects(wrong, says) -> None:
    with pytest.raises(WrongAnswer, match=says):
        st.judge_predict_step(wrong, MEASURED, cores=2)
