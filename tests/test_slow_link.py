"""Chapter 15's slow link (dtlib.collectives.slow_link), proven without trusting a clock.

Time on a shared CI machine only ever runs late, so every claim here is a lower bound
or a count, never an upper bound on seconds:

- each collective holds the link for what the alpha-beta model charges its recorded
  message (``link_seconds`` of the observer's record), and a blocking collective
  takes at least that long; async ones queue on the one link (each starts when the
  one before has left), so a step takes at least the sum;
- torch DDP's reducer takes its all-reduce's future, not its wait: it is held too,
  so a DDP step lasts at least its buckets' link time; and the numbers a run
  computes are those of the fast link, bit for bit;
- a link of alpha = beta = 0 charges nothing.
"""

from __future__ import annotations

import math
import time

import pytest
import torch
import torch.distributed as dist

from dtlib.collectives.cost_model import collective_time, link_seconds
from dtlib.collectives.slow_link import SlowLinkSteps, slow_link
from dtlib.data_parallel import parallelism
from dtlib.models.gpt import GPTConfig, build_gpt
from dtlib.models.reference import gpt_batches
from dtlib.models.run import RunConfig, run_steps
from dtlib.runtime import launch

ALPHA, BETA = 20e-3, 1 / 20e6  # 20 ms, 20 MB/s: far above loopback's own costs
TINY = dict(vocab_size=64, seq_len=16, n_layers=2, hidden=32, n_heads=2)


def _blocking(alpha: float, beta: float) -> dict:
    sizes = [1, 1024, 64 * 1024]
    spent, issued = [], []
    with slow_link(alpha, beta) as link:
        for n in sizes:
            x = torch.ones(n)
            t = time.monotonic()
            dist.all_reduce(x)
            spent.append(time.monotonic() - t)
        t = time.monotonic()
        works = [dist.all_reduce(torch.ones(n), async_op=True) for n in sizes]
        issued.append(time.monotonic() - t)
        for w in works:
            w.wait()
        issued.append(time.monotonic() - t)
        records = [(r.op, r.bytes, r.group_size) for r in link.log.records]
    return {"spent": spent, "held": link.held, "records": records, "async": issued}


@pytest.mark.parametrize("world_size", [2, 4])
def test_each_collective_holds_the_link_for_its_alpha_beta_time(world_size) -> None:
    for r in launch.spawn(_blocking, world_size, ALPHA, BETA, stream=False, timeout=120):
        assert [op for op, _, _ in r["records"]] == ["all_reduce"] * 6
        expected = [collective_time("ring", "all_reduce", b, n, ALPHA, BETA)
                    for _, b, n in r["records"]]
        assert r["held"] == pytest.approx(expected, rel=1e-12)
        assert r["records"][1][1] == 4 * 1024
        for spent, held in zip(r["spent"], r["held"]):
            assert spent >= held  # a blocking all-reduce waits its time out
        # issuing three async all-reduces does not wait; they queue on the one link
        issue, done = r["async"]
        assert issue < 2 * (world_size - 1) * ALPHA
        assert done >= math.fsum(r["held"][3:])


def test_a_link_of_nothing_charges_nothing() -> None:
    assert link_seconds("all_reduce", 1e9, 4, 0, 0) == 0
    assert link_seconds("all_reduce", 1e9, 1, 1, 1) == 0  # one rank: no wire
    assert link_seconds("send", 100, 2, 1e-3, 1e-6) == pytest.approx(1e-3 + 1e-4)
    assert link_seconds("all_gather", 800, 4, 1e-3, 1e-6) == pytest.approx(
        3e-3 + 600e-6)


def _ddp_steps(alpha: float, beta: float, steps: int) -> dict:
    cfg = GPTConfig(**TINY)
    callback = SlowLinkSteps(alpha, beta)
    config = RunConfig(steps, optimizer_kwargs={"lr": 1e-2}, record_grads=False)
    res = run_steps(parallelism("torch"), build_gpt(cfg, seed=0),
                    gpt_batches(cfg, 8), config, callbacks=[callback])
    link = callback.link
    return {"params": res.params, "step_times": res.step_times,
            "held": link.held, "ops": [r.op for r in link.log.records]}


def test_torch_ddp_waits_for_its_buckets_on_the_slow_link() -> None:
    fast = launch.spawn(_ddp_steps, 2, 0.0, 0.0, 3, stream=False, timeout=120)
    slow = launch.spawn(_ddp_steps, 2, ALPHA, BETA, 3, stream=False, timeout=120)
    for f, s in zip(fast, slow):
        for n, q in f["params"].items():  # the slow link changes no number
            assert torch.equal(q, s["params"][n]), n
        # the last step's collectives: the gradient bucket(s) and the logged loss
        last = s["held"][-len(s["ops"]):]
        assert "all_reduce" in s["ops"] and len(s["held"]) >= len(s["ops"])
        assert s["step_times"][-1] >= math.fsum(last) > 0
        assert math.fsum(f["held"]) == 0


def test_a_bad_link_names_the_argument() -> None:
    with pytest.raises(ValueError, match="alpha=-1"):
        slow_link(-1, 0)
    with pytest.raises(ValueError, match="beta=nan"):
        SlowLinkSteps(0, float("nan"))
    with pytest.raises(ValueError, match="op='allreduce'"):
        link_seconds("allreduce", 1, 2, 0, 0)
