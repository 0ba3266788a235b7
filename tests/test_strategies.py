"""The book's one strategy table (dtlib.planner.strategies): the capstone, Chapter 13
and ``bench time`` all build their Parallelism from its rows."""

from __future__ import annotations

import pytest
import torch

from dtlib.planner.step_time import MODELLED
from dtlib.planner.strategies import STRATEGIES, Options, capstone_names, one_rank_names
from dtlib.planner.timing import DATA_PARALLEL, build
from dtlib.runtime import launch
from dtlib.train.config import STRATEGY_NAMES, parse_args
from dtlib.train.job import strategy_options


def test_every_priced_strategy_and_every_flag_value_is_a_row():
    assert set(MODELLED) <= set(STRATEGIES)
    assert capstone_names() == STRATEGY_NAMES
    assert set(DATA_PARALLEL) == set(one_rank_names()) & set(MODELLED)
    assert "tp" not in DATA_PARALLEL and "1f1b" not in DATA_PARALLEL


@pytest.mark.parametrize("name, option", [("ddp", Options(tp=2)),
                                          ("zero-2", Options(n_micro=8)),
                                          ("tp", Options(bucket_cap_mb=4.0)),
                                          ("1f1b", Options(mp_policy=object()))])
def test_a_row_refuses_an_option_it_does_not_read(name, option):
    with pytest.raises(ValueError, match="does not read it; it reads"):
        STRATEGIES[name].parallelism(option)


def test_tp_must_be_a_positive_integer():
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="tp="):
            STRATEGIES["fsdp"].parallelism(Options(tp=bad))


def test_chapter_13_builds_only_what_the_model_prices():
    with pytest.raises(ValueError, match="strategy='ddp' not allowed"):
        build("ddp")  # torch's DDP: the capstone's, not priced by the model


def test_the_flags_choose_the_capstone_rows_options():
    bf16 = parse_args(["--strategy", "fsdp", "--precision", "bf16"])
    o = strategy_options(bf16, STRATEGIES["fsdp"])
    assert o.mp_policy.param_dtype == torch.bfloat16 and o.tp == 1
    ddp = parse_args(["--strategy", "ddp", "--precision", "bf16"])
    assert strategy_options(ddp, STRATEGIES["ddp"]) == Options()  # autocast instead


def _built() -> dict[str, str]:
    out = {}
    for name in STRATEGIES:
        row = STRATEGIES[name]
        o = Options(tp=2) if "tp" in row.options else Options()
        par = row.parallelism(o)
        out[name] = f"{type(par).__name__} {getattr(par, 'name', '')}"
    return out


def test_every_row_builds_its_techniques_parallelism_on_two_ranks():
    got = launch.spawn(_built, 2, stream=False)[0]
    assert got == {
        "ddp": "DataParallelism ddp/torch", "ddp/naive": "DataParallelism ddp/naive",
        "ddp/bucketed": "DataParallelism ddp/bucketed",
        "ddp/overlapped": "DataParallelism ddp/overlapped",
        "zero-1": "ZeroParallelism zero-1", "zero-2": "ZeroParallelism zero-2",
        "zero-3": "ZeroParallelism zero-3",
        "fsdp": "Composed fsdp1xtp2",  # tp=2: FSDP2 x DTensor TP on a (1, 2) mesh
        "tp": "TensorParallel tp/ours", "gpipe": "PipelineParallel pp/ours-gpipe",
        "1f1b": "PipelineParallel pp/ours-1f1b",
        "zb-h1": "PipelineParallel pp/ours-zb-h1",
        "zb-v": "PipelineParallel pp/ours-zb-v-v2"}


def test_a_pipeline_row_says_when_the_model_has_too_few_blocks():
    assert STRATEGIES["zb-v"].fits(4, 2) is None
    assert STRATEGIES["zb-v"].fits(4, 4) == ("4 blocks cannot make 8 stages (2 a rank "
                                             "on 4 ranks)")
    assert STRATEGIES["1f1b"].fits(4, 4) is None and STRATEGIES["1f1b"].fits(4, 5)
    assert STRATEGIES["ddp/naive"].fits(1, 64) is None


def test_bench_time_refuses_when_no_strategy_can_run_on_the_ranks_given():
    import argparse

    from dtlib.bench import time as bench_time

    parser = argparse.ArgumentParser()
    bench_time.add_arguments(parser)
    args = parser.parse_args(["--strategies", "zb-v", "--world-sizes", "4"])
    with pytest.raises(ValueError, match="--strategies zb-v on --world-sizes 4: none "
                                         "can run: zb-v on 4 ranks: 4 blocks cannot "
                                         "make 8 stages"):
        bench_time.run(args)
