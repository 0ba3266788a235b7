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
                "optimizer_s_per_param": 4e-8, "copy_s_per_byte": 2e-10,
                "world_size": 2, "device": "cpu",
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
    import dataclasses

    from dtlib.chapters.ch13_time.runs import TIME_GPT, machine_from, workload_of
    from dtlib.planner.step_time import predict

    ratio = st.judge_predict_step(_right, MEASURED, cores=2)
    machine = machine_from([MEASURED["machine"]], cores=2)
    step = MEASURED["step"]
    # the same model on the same inputs, which are the gradient buckets only (the
    # loop's loss all-reduce, counted on the page, is not among the exercise's inputs)
    w = dataclasses.replace(workload_of(TIME_GPT, step), control_collectives=False)
    want = predict("ddp/overlapped", w, machine, step["world_size"]).total_s
    assert ratio == pytest.approx(step["step_time_s"] / want, rel=1e-12)


def _probe(slow: float) -> dict:
    """A probe of a machine ``slow`` times slower than MEASURED says (the GPT's pass
    of 1e9 FLOPs, which MEASURED's rate runs in 0.05 s)."""
    return {"flops": 1e9, "alone_s": 0.05 * slow, "all_s": 0.05 * slow / 0.95,
            "optimizer_s_per_param": 4e-8 * slow, "copy_s_per_byte": 2e-10 * slow}


def test_predict_step_prices_each_step_at_the_probes_beside_it() -> None:
    """The machine slowed down between its measurement and the steps (a busy
    machine): the inputs are those probed around the steps, and the ratio is the
    median of each step over the model at the probes just before and after it."""
    import dataclasses
    import statistics

    from dtlib.chapters.ch13_time.runs import TIME_GPT, machine_from, workload_of
    from dtlib.planner.drift import machine_at
    from dtlib.planner.step_time import predict

    probes = [_probe(3.0), _probe(3.0), _probe(2.0), _probe(4.0)]
    step = {**MEASURED["step"], "step_time_s": 1.5, "step_times_s": [1.4, 1.5, 1.6],
            "probes": probes}
    measured = {**MEASURED, "step": step}
    seen = []

    def right(inp):
        seen.append(inp)
        return _two_queues(inp)

    ratio = st.judge_predict_step(right, measured, cores=2)
    assert seen[0]["flops_per_s"] == pytest.approx(1e9 / 0.05 / 3.0)  # probed, not 2e10
    assert seen[0]["shared"] == pytest.approx(0.95)
    raw = machine_from([MEASURED["machine"]], cores=2)
    w = dataclasses.replace(workload_of(TIME_GPT, step), control_collectives=False)
    want = statistics.median(
        t / predict("ddp/overlapped", w, machine_at(raw, probes[i:i + 2], 2), 2).total_s
        for i, t in enumerate(step["step_times_s"]))
    assert ratio == pytest.approx(want, rel=1e-9)
    # priced at the rate measured once, at the start (three times the steps' rate),
    # the same steps read far slower than predicted: what a busy machine printed
    once = st.judge_predict_step(_right, {**measured, "step": {
        k: v for k, v in step.items() if k != "probes"}}, cores=2)
    assert once > 1.5 * ratio


@pytest.mark.parametrize("wrong, says", [(_never_overlaps, "adds every bucket"),
                                         (_always_overlaps, "nothing hides"),
                                         (_rule_not_measured, "measured share")])
def test_predict_step_rejects(wrong, says) -> None:
    with pytest.raises(WrongAnswer, match=says):
        st.judge_predict_step(wrong, MEASURED, cores=2)


# ---- find the exposed communication in a trace (hand-made traces, no launch) ----

def _sweep(events, rounded=False):
    # a sweep over the boundaries: count open communication and compute spans
    comm_threads = {t for name, t, *_ in events if name.startswith(("gloo:", "nccl"))}
    edges = []
    for name, thread, start, end in events:
        if rounded:  # whole microseconds, as a trace viewer shows them
            start, end = round(start), round(end)
        if name.startswith(("gloo:", "nccl")):
            kind = 0
        elif name.startswith("aten::") and thread not in comm_threads:
            kind = 1
        else:
            continue
        edges += [(start, kind, 1), (end, kind, -1)]
    edges.sort()
    open_, total, last = [0, 0], 0.0, None
    for t, kind, step in edges:
        if last is not None and open_[0] > 0 and open_[1] == 0:
            total += t - last
        open_[kind] += step
        last = t
    return total


def _subtract(events):
    # the chapter's own helpers: communication's spans minus the compute's
    from dtlib.planner.trace import exposed_comm
    return exposed_comm(events)["exposed_us"]


def _comm_total(events):
    from dtlib.planner.trace import exposed_comm
    return exposed_comm(events)["comm_us"]


def _comm_summed(events):
    return sum(e[3] - e[2] for e in events if e[0].startswith("gloo:"))


def _compute_total(events):
    from dtlib.planner.trace import intervals
    return sum(t - s for s, t in intervals(events, False))


def _idle(events):
    span = max(e[3] for e in events) - min(e[2] for e in events)
    return span - _compute_total(events)


def test_trace_hand_made_truths() -> None:
    from dtlib.exercises import trace_reading as tr

    # trace 1: gloo 2-8 and 4-12 ms, compute 0-6, 9-10, 16-20: exposed 6-9, 10-12
    # trace 2: gloo 5-15 ms, compute 0-10 and 11-12 ms: exposed 10-11 and 12-15
    # trace 3: gloo 0.5-1.5 and 2.5-8 ms (two events), compute 0-1 and 2-6 (nested):
    # exposed 1-1.5 and 6-8
    truths = [tr.judge_exposed_comm(_sweep, ev, "t") for ev in tr.HAND_TRACES]
    assert truths == [5_000.0, 4_000.0, 2_500.0]
    assert tr.band_us(tr.HAND_TRACES[0]) == 1 + 3  # one comm span, three compute


@pytest.mark.parametrize("answer", [_sweep, _subtract,
                                    lambda ev: _sweep(ev, rounded=True)])
def test_trace_accepts(answer) -> None:
    from dtlib.exercises import trace_reading as tr

    for ev in tr.HAND_TRACES:
        tr.judge_exposed_comm(answer, ev, "hand-made")


@pytest.mark.parametrize("wrong, says", [
    (_comm_total, "all the communication"), (_comm_summed, "sums the communication"),
    (_compute_total, "compute time"), (_idle, "idle gaps"),
    (lambda ev: _sweep(ev) * 1e-6, "too small")])  # seconds, not microseconds
def test_trace_rejects(wrong, says) -> None:
    from dtlib.exercises import trace_reading as tr

    with pytest.raises(WrongAnswer, match=says):
        for ev in tr.HAND_TRACES:
            tr.judge_exposed_comm(wrong, ev, "hand-made")


def _overlap_from_one(forward_s, backward_s, buckets_s):
    # the queue's clock starts at 1 s, not 0: right whenever the first chunk ends
    # after a second (the page's cases), wrong on millisecond steps
    k, free = len(buckets_s), 1.0
    for i, seconds in enumerate(buckets_s):
        free = max(forward_s + (i + 1) * backward_s / k, free) + seconds
    return free


def test_overlap_checker_draws_cases_and_names_their_seed(monkeypatch) -> None:
    from dtlib.exercises import SEED_VARIABLE
    from dtlib.exercises.step_time import check_overlapped_ddp

    with pytest.raises(WrongAnswer, match=r"seed 123: check_overlapped_ddp\(\.\.\., "
                                          r"seed=123\) or DTLIB_EXERCISE_SEED=123 "
                                          r"draws them again"):
        check_overlapped_ddp(_overlap_from_one, seed=123)
    monkeypatch.setenv(SEED_VARIABLE, "7")  # what a learner sets to reproduce a run
    with pytest.raises(WrongAnswer, match="seed 7:"):
        check_overlapped_ddp(_overlap_from_one)
    monkeypatch.setenv(SEED_VARIABLE, "seven")
    with pytest.raises(ValueError, match="DTLIB_EXERCISE_SEED='seven': give an integer"):
        check_overlapped_ddp(_overlap_from_one)
