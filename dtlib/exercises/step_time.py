"""Checkers for Chapter 13, "Where the time goes".

The truth is the chapter's overlap rule, played on two streams by
:func:`dtlib.planner.overlap.two_streams`, on cases beyond the page's: a prediction
that adds every bucket (no overlap) or takes the larger of compute and communication
(perfect overlap) fails on them, and says which rule it broke.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any, Callable, Sequence

from dtlib.exercises import (WrongAnswer, as_number, check_close, checker,
                             passed)
from dtlib.planner.overlap import Comm, two_streams
from dtlib.planner.step_time import Machine, bucket_bytes, predict
from dtlib.runtime.i18n import N_, _


def _truth(forward_s: float, backward_s: float, buckets_s: Sequence[float]) -> float:
    k = len(buckets_s)
    chunks = [forward_s] + [backward_s / k] * k
    return two_streams(chunks, [Comm(c, ready_after=i + 1)
                                for i, c in enumerate(buckets_s)]).end_s


#: What ``check_overlapped_ddp`` switches off while the learner's function runs.
_OVERLAPPED_DDP_FORBIDS = {
    'dtlib.exercises.step_time:_truth': N_("the checker's truth"),
    'dtlib.planner.overlap:two_streams': N_("the book's own timeline"),
    'dtlib.planner.overlap:serial': N_("the book's own timeline"),
}


@checker(forbids=_OVERLAPPED_DDP_FORBIDS)
def check_overlapped_ddp(step_time: Callable[[float, float, Sequence[float]], float],
                         cases: tuple[tuple[float, float, tuple[float, ...]], ...] = (
                             (1.0, 2.0, (0.5, 0.5)), (1.0, 3.0, (2.0, 0.1, 0.1)),
                             (2.0, 4.0, (0.3, 0.3, 0.3, 0.3)), (0.5, 1.0, (3.0,)),
                             (1.0, 2.0, (0.2, 1.5))), seed: int | None = None
                         ) -> None:
    """Check ``step_time(forward_s, backward_s, buckets_s)``: the seconds from the
    forward's start until the last bucket's all-reduce ends, for the overlapped DDP on
    a GPU (communication beside compute): backward splits evenly into one chunk per
    bucket, bucket k may start when chunk k ends and the buckets travel one at a time,
    in order.

    Args:
        step_time: the learner's function.
        cases: ``(forward_s, backward_s, buckets_s)`` to try; three more are drawn
            (in milliseconds, one to five buckets).
        seed: seeds the drawn cases (default: a fresh draw each call, see
            :func:`~dtlib.exercises.checker`).
    Returns:
        None (prints "Correct" or raises :class:`WrongAnswer`).

    Taught in: Chapter 13, "An overlap rule per strategy".
    """
    rng = random.Random(seed)
    # milliseconds, as steps of small models take
    drawn = tuple((round(rng.uniform(1e-3, 0.05), 6),
                   round(rng.uniform(0.01, 0.1), 6),
                   tuple(round(rng.uniform(1e-3, 0.05), 6)
                         for _ in range(rng.randint(1, 5)))) for _ in range(3))
    _check_overlap_cases(step_time, tuple(cases) + drawn)
    passed(_("your timeline matches the overlap rule on {value} steps: only what the "
             "last buckets cannot hide is exposed").format(value=len(cases) + 3))


def _check_overlap_cases(step_time: Callable[[float, float, Sequence[float]], float],
                         cases: tuple[tuple[float, float, tuple[float, ...]], ...]
                         ) -> None:
    for fwd, bwd, buckets in cases:
        got = step_time(fwd, bwd, list(buckets))
        got = got if as_number(got) is None else as_number(got)
        where = _("forward {fwd} s, backward {bwd} s, buckets {buckets}").format(
                    fwd=fwd, bwd=bwd, buckets=list(buckets))
        want = _truth(fwd, bwd, buckets)
        if isinstance(got, (int, float)) and not isinstance(got, bool):
            if abs(got - (fwd + bwd + sum(buckets))) < 1e-9 * want < abs(
                    want - (fwd + bwd + sum(buckets))):
                raise WrongAnswer(_("{where}: you added every bucket after the "
                                    "backward; the overlapped DDP starts a bucket as "
                                    "soon as its gradients are ready").format(
                                      where=where))
            if abs(got - max(fwd + bwd, sum(buckets))) < 1e-9 * want < abs(
                    want - max(fwd + bwd, sum(buckets))):
                raise WrongAnswer(_("{where}: perfect overlap is too optimistic: a "
                                    "bucket cannot start before its gradients exist, "
                                    "and the last one starts when backward "
                                    "ends").format(where=where))
        check_close(where, got, want, rel=1e-9, hint=(
            _("play the two queues: chunk k of the backward ends at forward + k * "
              "backward / K; bucket k starts at the later of that and the end of "
              "bucket k - 1")))


#: Ranks of the exercise's measured step.
PREDICT_WORLD = 2


def measure_on_rank() -> dict:
    """On every rank: the machine's inputs and overlapped-DDP steps, measured
    (Chapter 13's page code, fewer sizes and steps), with what drifts probed beside
    each step as the page does: on a busy machine the rate measured at the start is
    not the rate a few seconds later, when the steps run."""
    # loads torch on first use: this module imports without it
    from dtlib.planner.measure import measure_machine
    from dtlib.planner.timing import TIME_GPT, time_strategies

    return {"machine": measure_machine(sizes=(2**12, 2**16, 2**20, 2**22),
                                       repeats=3, cfg=TIME_GPT),
            "step": time_strategies(("ddp/overlapped",), steps=3, probe=True)[0]}


def _probed(machine: Machine, step: dict, around: slice | None = None) -> Machine:
    """``machine`` at the inputs probed around the timed steps (``around``: the
    probes of one step; default all), or as measured when the step has no probes."""
    # loads torch on first use: this module imports without it
    from dtlib.planner.drift import machine_at

    probes = step.get("probes")
    if not probes:
        return machine
    return machine_at(machine, probes[around or slice(None)], step["world_size"])


def _ring(fitted: Machine, n: int) -> tuple[float, float]:
    """The ring all-reduce's alpha and beta on ``n`` ranks of ``fitted``."""
    return fitted.fits.get(("all_reduce", n), (fitted.alpha_s, fitted.beta_s_per_byte))


def _exercise_machine(fitted: Machine, n: int, ranks: int, cores: int | None,
                      share: float | None) -> Machine:
    """The exercise's machine of one case (``ranks`` busy, ``share`` measured or
    None), from ``fitted`` measured on ``n`` ranks."""
    alpha, beta = _ring(fitted, n)
    return Machine("exercise", fitted.flops_per_s, alpha, beta,
                   fitted.optimizer_s_per_param, cores=cores,
                   shared={} if share is None else {ranks: share})


def _cases(measured: dict, cores: int) -> list[tuple[dict, Any, Any]]:
    """(inputs the learner sees, workload, machine) for the measured machine (at the
    inputs probed around its timed steps), its four-rank variant, the same numbers
    with communication on its own engine, and with four cores per rank."""
    # loads torch on first use: this module imports without it
    from dtlib.planner.measure import machine_from
    from dtlib.planner.timing import TIME_GPT, workload_of

    n = measured["step"]["world_size"]
    fitted = _probed(machine_from([measured["machine"]], cores), measured["step"])
    alpha, beta = _ring(fitted, n)
    # the exercise's inputs are the gradient buckets: the loop's own loss all-reduce
    # (Workload.control_collectives) is not among them
    w = dataclasses.replace(workload_of(TIME_GPT, measured["step"]),
                            control_collectives=False)
    out = []
    measured_share = fitted.shared.get(n)  # the ranks' own share, measured
    # and a machine with cores to spare (4 per rank), where a rank's share is capped
    # at a whole core: on a laptop of few cores no other case reaches the cap
    for ranks, c, share in ((n, cores, measured_share), (2 * n, cores, None),
                            (n, None, None), (n, 4 * n, None)):
        m = _exercise_machine(fitted, n, ranks, c, share)
        inputs = {"world_size": ranks, "cores": c, "shared": share,
                  "flops": w.flops(),
                  "flops_per_s": m.flops_per_s,
                  "optimizer_s_per_param": m.optimizer_s_per_param,
                  "n_params": w.psi, "buckets_bytes": bucket_bytes(w),
                  "alpha_s": alpha, "beta_s_per_byte": beta}
        out.append((inputs, w, m))
    return out


def judge_predict_step(predict_step: Callable[[dict], float], measured: dict,
                       cores: int) -> float:
    """The judging half of :func:`check_predict_step`: the learner's prediction on
    each case against the model's; returns measured / predicted of the measured case.

    Taught in: Chapter 13, exercise ch13-ex-predict.
    """
    first = None
    for inputs, w, m in _cases(measured, cores):
        ranks = inputs["world_size"]
        got = predict_step(dict(inputs))
        got = got if as_number(got) is None else as_number(got)
        want = predict("ddp/overlapped", w, m, ranks).total_s
        other = predict("ddp/bucketed", w, m, ranks).total_s  # no overlap at all
        where = _("world_size={ranks}, cores={inputs_cores}").format(
                    ranks=ranks, inputs_cores=inputs['cores'])
        if isinstance(got, (int, float)) and not isinstance(got, bool) and \
                abs(want - other) > 1e-9 * want:
            if abs(got - other) <= 1e-9 * want:
                raise WrongAnswer(_("{where}: your step adds every bucket; with "
                                    "communication on its own engine the buckets hide "
                                    "behind the backward, all but the last").format(
                                      where=where))
        if m.shares_cores(ranks) and isinstance(got, (int, float)) and \
                not isinstance(got, bool) and got < want * (1 - 1e-9):
            raise WrongAnswer(_("{where}: too small: as many ranks as cores leave no "
                                "core for gloo, so nothing hides and the ranks share "
                                "the cores' FLOP/s (at the measured share where "
                                "'shared' gives one)").format(where=where))
        check_close(where, got, want, rel=1e-6, hint=(
            _("compute F / N over the rank's share of the FLOP/s (the measured "
              "'shared' where given), the optimizer over the same share, then the "
              "buckets: added when ranks >= cores, else played on two queues")))
        first = want if first is None else first
    return measured_ratio(measured, cores, first)


def measured_ratio(measured: dict, cores: int, predicted_s: float) -> float:
    """Measured / predicted of the measured case: with probes, the median over the
    timed steps of each step's time over the model at the probes just before and
    after it (as the page's ``compare``); without, the step over ``predicted_s``."""
    # loads torch on first use: this module imports without it
    import statistics

    from dtlib.planner.measure import machine_from

    step = measured["step"]
    if not step.get("probes"):
        return step["step_time_s"] / predicted_s
    n, (_, w, _) = step["world_size"], _cases(measured, cores)[0]
    raw = machine_from([measured["machine"]], cores)
    ratios = []
    for i, t in enumerate(step["step_times_s"]):
        at = _probed(raw, step, slice(i, i + 2))
        m = _exercise_machine(at, n, n, cores, at.shared.get(n))
        ratios.append(t / predict("ddp/overlapped", w, m, n).total_s)
    return statistics.median(ratios)


#: What ``check_predict_step`` switches off while the learner's function runs.
_PREDICT_STEP_FORBIDS = {
    'dtlib.planner.step_time:predict': N_("the book's own model"),
    'dtlib.planner.overlap:two_streams': N_("the book's own timeline"),
    'dtlib.planner.estimate:estimate': N_("the book's own model"),
}


@checker(forbids=_PREDICT_STEP_FORBIDS)
def check_predict_step(predict_step: Callable[[dict], float]) -> None:
    """Check ``predict_step(inputs) -> seconds``: the overlapped DDP's step of
    Chapter 13's GPT from the machine's measured inputs (``world_size``, ``cores``
    or None for a device with its own communication engine, ``shared``: the
    measured fraction of ``flops_per_s`` each rank reaches with ``world_size``
    ranks busy, or None where not measured (then the rule ``min(1, cores / N)``),
    ``flops`` of the whole step, ``flops_per_s`` of one rank alone,
    ``optimizer_s_per_param``,
    ``n_params``, ``buckets_bytes`` in the order they fill, ``alpha_s``,
    ``beta_s_per_byte`` of the ring all-reduce). Backward is two thirds of the
    compute, split over the buckets in proportion to their bytes.

    On 2 real ranks it measures the inputs and three steps with what drifts probed
    beside each (Chapter 13's ``probe_rate``), judges the prediction against the
    model on the measured machine, on 4 ranks of it and on the same numbers with an
    engine and with four cores per rank, then prints measured / predicted (the
    median over the steps, each priced at the probes around it: a rate measured
    once, seconds before the steps, put a busy machine far outside the band).

    Taught in: Chapter 13, exercise ch13-ex-predict.
    """
    import os

    # loads torch on first use: this module imports without it
    from dtlib.planner.timing import BAND
    from dtlib.runtime import launch

    measured = launch.spawn(measure_on_rank, PREDICT_WORLD, timeout=300,
                            stream=False)[0]
    ratio = judge_predict_step(predict_step, measured, os.cpu_count() or 1)
    where = _("inside") if BAND[0] <= ratio <= BAND[1] else _("outside")
    passed(_("your model is the chapter's on four machines; measured / predicted on "
             "{predict_world} ranks here: {ratio:.2f}, {where} the band "
             "{band_0}-{band_1} an idle machine keeps").format(
               predict_world=PREDICT_WORLD, ratio=ratio, where=where, band_0=BAND[0],
               band_1=BAND[1]))
