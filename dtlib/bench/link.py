"""Slow link: the fit's recovered latency and bandwidth, and each method's wall time
on the link, measured / predicted, in one run.

``python -m dtlib.bench link [--alpha-ms 1] [--mb-per-s 10] [--rounds 3] [--json P]``
first fits Chapter 2's alpha-beta line to all-reduces timed inside
``slow_link(alpha, beta)`` on 2 ranks (recovered / given, for the latency and the
bandwidth), then trains DDP, PowerSGD (rank 2) and DiLoCo (H = 10, 50, 100) on the
book's own text (its prose and dtlib's code, byte tokens) on the fast loopback and on
the slow link, back to back, and prices each slow run with
:func:`dtlib.low_comm.link.predict_on_link`. A record per method: the median ratio
measured / predicted over the rounds and its spread. Goal: every ratio within
Chapter 13's band, 0.75-1.33, on an idle machine.

Taught in: Chapter 15, "On the slow link: measured against predicted".
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from typing import Any

from dtlib.low_comm.link import Method, predict_on_link
from dtlib.low_comm.timing import LOW_GPT, fit_link, time_on_link
from dtlib.models.gpt import build_gpt
from dtlib.planner.timing import BAND
from dtlib.runtime import launch

METHODS = [Method("ddp"), Method("powersgd", rank=2, start_iter=10),
           Method("diloco", inner_steps=10), Method("diloco", inner_steps=50),
           Method("diloco", inner_steps=100)]
STEPS = [20, 20, 20, 50, 100]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``python -m dtlib.bench link``."""
    parser.add_argument("--alpha-ms", type=float, default=1.0,
                        help="the link's latency (ms)")
    parser.add_argument("--mb-per-s", type=float, default=10.0,
                        help="the link's bandwidth (MB/s)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds")


def _tokens() -> Any:
    """The book's own text as byte tokens, read into memory (the token file is
    written to a temporary directory, removed again)."""
    import numpy as np

    from dtlib.train.tokens import open_tokens, prepare_book_text

    with tempfile.TemporaryDirectory(prefix="dtlib-bench-link-") as out:
        prepare_book_text(os.path.join(out, "tokens"))
        return np.array(open_tokens(os.path.join(out, "tokens"))[0])


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """One record for the fit, one per method; prints the in-band count."""
    if not (args.alpha_ms > 0 and args.mb_per_s > 0 and args.rounds >= 1):
        raise ValueError(f"--alpha-ms={args.alpha_ms} and --mb-per-s={args.mb_per_s} "
                         f"must be > 0 and --rounds={args.rounds} >= 1")
    alpha, beta = args.alpha_ms / 1e3, 1 / (args.mb_per_s * 1e6)
    fit = launch.spawn(fit_link, 2, alpha, beta, [2 ** k for k in range(8, 21, 2)],
                       stream=False, timeout=args.timeout)[0]
    records: list[dict[str, Any]] = [{
        "what": "fit", "alpha recovered/given": fit["alpha"] / alpha,
        "bandwidth recovered/given": beta / fit["beta"]}]
    tokens = _tokens()
    model = build_gpt(LOW_GPT)
    shapes = [tuple(p.shape) for p in model.parameters()]
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    ratios: dict[str, list[float]] = {m.label: [] for m in METHODS}
    for _ in range(args.rounds):
        timed = launch.spawn(time_on_link, 2, tokens, METHODS, STEPS, alpha, beta,
                             stream=False, timeout=args.timeout)[0]
        for method, n, run_ in zip(METHODS, STEPS, timed):
            fast = sum(run_["fast"][1:]) / (n - 1)
            predicted = predict_on_link(method, shapes, range(2, n + 1), fast, 2,
                                        alpha, beta,
                                        0 if method.kind == "diloco" else buffers)
            ratios[method.label].append(sum(run_["slow"][1:]) / predicted)
    for label, values in ratios.items():
        median = statistics.median(values)
        records.append({"what": label, "measured/predicted": median,
                        "spread": max(values) - min(values),
                        "in_band": BAND[0] <= median <= BAND[1]})
    inside = sum(r["in_band"] for r in records[1:])
    print(f"{inside} of {len(records) - 1} median ratios in {BAND[0]}-{BAND[1]} over "
          f"{args.rounds} rounds")
    return records
