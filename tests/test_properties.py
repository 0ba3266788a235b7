"""Properties that must hold for every input, not just the examples the chapters use."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dtlib.collectives.algorithms import chunk_bounds
from dtlib.exercises.strip import BEGIN, END, strip_source
from dtlib.memory.formulas import activation_bytes, model_state_bytes


@given(numel=st.integers(0, 10_000), world_size=st.integers(1, 64))
def test_chunks_partition_the_tensor_like_tensor_split(numel: int, world_size: int) -> None:
    bounds = chunk_bounds(numel, world_size)
    assert len(bounds) == world_size
    assert bounds[0][0] == 0 and bounds[-1][1] == numel
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))  # contiguous
    sizes = [e - s for s, e in bounds]
    assert sizes == [len(c) for c in torch.arange(numel).tensor_split(world_size)]


@given(n_params=st.integers(1, 10**12), dp=st.integers(1, 4096),
       precision=st.sampled_from(["fp32", "mixed"]))
def test_each_zero_stage_holds_no_more_than_the_previous(n_params: int, dp: int,
                                                         precision: str) -> None:
    totals = [model_state_bytes(n_params, zero_stage=s, dp=dp, precision=precision).total
              for s in range(4)]
    assert totals == sorted(totals, reverse=True)
    # ZeRO-3 partitions everything: a padded shard at 16 bytes per parameter in both
    # precisions (2 + 2 + 12 mixed, 4 + 4 + 8 fp32).
    assert totals[3] == 16 * math.ceil(n_params / dp)


@given(s=st.integers(1, 8192), b=st.integers(1, 64), head_dim=st.integers(1, 256),
       a=st.sampled_from([1, 2, 4, 8, 16, 32, 64]), tp=st.sampled_from([1, 2, 4, 8]),
       sp=st.booleans())
def test_sdpa_keeps_what_selective_recompute_keeps(s: int, b: int, head_dim: int,
                                                   a: int, tp: int, sp: bool) -> None:
    if a % tp:
        tp = 1
    kw = dict(tp=tp, sequence_parallel=sp)
    args = (s, b, a * head_dim, a, 1)
    sdpa = activation_bytes(*args, attention="sdpa", **kw)
    # A fused kernel stores exactly what selective recomputation keeps, never more
    # than an explicit attention, and full recomputation stores the same either way.
    assert sdpa == activation_bytes(*args, recompute="selective", **kw)
    assert sdpa <= activation_bytes(*args, **kw)
    assert activation_bytes(*args, attention="sdpa", recompute="full", **kw) == \
        activation_bytes(*args, recompute="full", **kw)


code_lines = st.lists(st.text(st.characters(blacklist_categories=("Cs",),
                                            blacklist_characters="\r\n\x0b\x0c\x1c\x1d"
                                            "\x1e\x85\u2028\u2029"), max_size=30),
                      max_size=10)


@settings(max_examples=200)
@given(before=code_lines, solution=code_lines, after=code_lines,
       indent=st.sampled_from(["", "    ", "        "]))
def test_strip_keeps_everything_but_the_solution(before, solution, after, indent) -> None:
    before = [x for x in before if x.strip() not in (BEGIN, END)]
    after = [x for x in after if x.strip() not in (BEGIN, END)]
    solution = [x for x in solution if x.strip() not in (BEGIN, END)]
    src = "\n".join([*before, indent + BEGIN, *solution, indent + END, *after]) + "\n"
    out = strip_source(src)
    expected = "\n".join([*before, indent + "# YOUR CODE HERE",
                          indent + "raise NotImplementedError", *after]) + "\n"
    assert out == expected
    no_markers = "\n".join(before) + "\n"
    assert strip_source(no_markers) == no_markers
