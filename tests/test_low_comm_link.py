"""Chapter 15's link model (dtlib.low_comm.link) against what the methods send.

- What each method puts on the link, step by step (``messages_of_step``: DDP's
  gradients, PowerSGD's plain steps then its uncompressed tensors, P's and Q's,
  DiLoCo's parameters every H steps, the logged loss every step), is what the one
  observer counts when the method trains through the one loop: the same number of
  all-reduces and the same bytes, on 2 and 4 ranks. So the link time the model
  charges is the slow link's own (the same function of the same records).
- ``cluster_step``: the compute is the same for every method; DiLoCo's link time is
  DDP's parameter all-reduce over H; DDP hides behind the backward what fits.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dtlib.collectives.cost_model import link_seconds
from dtlib.low_comm.link import Method, cluster_step, link_step_seconds, messages_of_step
from dtlib.low_comm.timing import LOW_GPT, train_methods
from dtlib.models.gpt import GPTConfig, build_gpt, meta_gpt
from dtlib.runtime import launch

METHODS = [Method("ddp"), Method("powersgd", rank=2, start_iter=2),
           Method("powersgd", rank=1, start_iter=2, min_compression_rate=0),
           Method("diloco", inner_steps=3)]
STEPS = 6
# tiny but nonzero: the held seconds are a function of every record's bytes
ALPHA, BETA = 1e-6, 1e-12


def _tokens() -> np.ndarray:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 256, (20_000,), generator=g).numpy().astype(np.uint16)


@pytest.mark.parametrize("world_size", [2, 4])
def test_the_model_prices_what_each_method_sends(world_size) -> None:
    ranks = launch.spawn(train_methods, world_size, _tokens(), METHODS,
                         [STEPS] * len(METHODS), (ALPHA, BETA), stream=False,
                         timeout=180)
    model = build_gpt(LOW_GPT)
    shapes = [tuple(p.shape) for p in model.parameters()]
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    for r in ranks:
        for method, run in zip(METHODS, r):
            ddp = method.kind != "diloco"
            for s, seen in enumerate(run["messages"], start=1):
                want = messages_of_step(method, shapes, s, buffers if ddp else 0)
                if ddp and s == 2:  # torch DDP's one-off bucket rebuild: broadcasts
                    extra = seen[:len(seen) - len(want)]
                    assert {op for op, _b in extra} == {"broadcast"}, seen
                    seen = seen[len(extra):]
                assert seen == want, (method.label, s)
            if method.kind != "powersgd":  # the held seconds are the model's
                charged = math.fsum(link_step_seconds(
                    method, shapes, s, world_size, ALPHA, BETA, buffers if ddp else 0)
                    for s in range(1, STEPS + 1))
                extra_s = 0.0
                if ddp:  # the rebuild's broadcasts, priced as the link prices them
                    seen2 = run["messages"][1]
                    extra_s = math.fsum(link_seconds(op, b, world_size, ALPHA, BETA)
                                        for op, b in seen2[:len(seen2) - 2])
                assert run["link_s"] == pytest.approx(charged + extra_s, rel=1e-9)
    ddp, powersgd = (sum(b for _op, b in messages_of_step(m, shapes, STEPS))
                     for m in METHODS[:2])
    assert powersgd < ddp / 4  # rank 2 of this GPT's matrices sends far less


def test_the_cluster_model() -> None:
    gpt = meta_gpt(GPTConfig(vocab_size=50257, seq_len=2048, n_layers=24, hidden=2048,
                             n_heads=16))
    shapes = [tuple(p.shape) for p in gpt.parameters()]
    psi = sum(math.prod(s) for s in shapes)
    kw = dict(tokens=2**19, flops_per_s=4e15, replicas=8, latency_s=1e-3)
    slow = {m.label: cluster_step(m, shapes, bandwidth_bytes_per_s=1.25e9, **kw)
            for m in (Method("ddp"), Method("diloco", inner_steps=100),
                      Method("powersgd", rank=4, start_iter=2))}
    computes = {round(v["compute_s"], 12) for v in slow.values()}
    assert computes == {round(6 * psi * 2**19 / 4e15, 12)}
    ring = link_seconds("all_reduce", 4 * psi, 8, 1e-3, 1 / 1.25e9)
    loss = link_seconds("all_reduce", 4, 8, 1e-3, 1 / 1.25e9)
    assert slow["diloco H100"]["comm_s"] == pytest.approx(ring / 100 + loss)
    assert slow["ddp"]["comm_s"] == pytest.approx(ring + loss)
    assert slow["diloco H100"]["step_s"] < slow["ddp"]["step_s"]
    fast = cluster_step(Method("ddp"), shapes, bandwidth_bytes_per_s=1e13, **kw)
    assert fast["exposed_s"] == 0 and fast["step_s"] == fast["compute_s"]


def test_bad_methods_name_the_argument() -> None:
    with pytest.raises(ValueError, match="kind='sgd'"):
        Method("sgd")
    with pytest.raises(ValueError, match="inner_steps=0"):
        Method("diloco", inner_steps=0)
    with pytest.raises(ValueError, match="rank=0"):
        Method("powersgd")
    with pytest.raises(ValueError, match="bandwidth_bytes_per_s=0"):
        cluster_step(Method("ddp"), [(2, 2)], 1, 1.0, 2, 0, 0)
