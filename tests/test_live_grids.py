"""The grids behind the live calculators (Chapters 1 and 11) hold dtlib's numbers.

The browser check (tests/rendered/test_live_calculators.py) compares what the built
pages show with dtlib; these tests check the grids themselves without a browser: the
coded tables give back every entry, and each entry is what dtlib computes for that
setting of the controls.
"""

from __future__ import annotations

import random
from itertools import product

import pytest

from dtlib.chapters import live
from dtlib.chapters.ch01_memory import live as ch01
from dtlib.chapters.ch11_multi_dim import live as ch11
from dtlib.memory import estimate
from dtlib.planner import search


def test_coded_table_gives_back_every_entry() -> None:
    nested = [[[3, 1], [1, 7]], [[7, 7], [2.5, 3]], [[0, 1], [1, 1]]]
    table = live.coded_table(nested)
    assert table["shape"] == [3, 2, 2] and len(table["codes"]) == 2 * 12
    for i, j, k in product(range(3), range(2), range(2)):
        assert live.coded_entry(table, (i, j, k)) == nested[i][j][k]


@pytest.mark.parametrize("bad", [[[1, 2], [3]], [[1, 2], 3], [], [[1], [[2]]]])
def test_coded_table_rejects_a_ragged_list(bad: list) -> None:
    with pytest.raises(ValueError, match="nested"):
        live.coded_table(bad)


def test_coded_table_rejects_more_values_than_two_characters_name() -> None:
    with pytest.raises(ValueError, match="distinct values"):
        live.coded_table(list(range(len(live.ALPHABET) ** 2 + 1)))


def test_select_and_calculator_check_their_arguments() -> None:
    with pytest.raises(ValueError, match="default"):
        live.select("dp", "dp", [1, 2], 3)
    with pytest.raises(ValueError, match="ident"):
        live.LiveCalculator("Bad Id", "t", "", "", {"controls": {}}, "", "")
    with pytest.raises(ValueError, match="controls"):
        live.LiveCalculator("ok", "t", "", "", {}, "", "")


def test_grid_json_cannot_close_its_script_element() -> None:
    calc = live.LiveCalculator("x", "t", "", "", {"controls": {"a": ["</script>"]}},
                               "function update() {}", "note")
    assert "</script>" not in calc.grid_json()
    assert calc._repr_html_().count("</script>") == 2  # the grid's and the code's


def test_memory_grid_is_dtlib_estimate_at_random_settings() -> None:
    grid = ch01.memory_grid()
    keys = list(ch01.CONTROLS)
    rng = random.Random(1)
    for _ in range(200):
        pick = {k: rng.randrange(len(v)) for k, v in ch01.CONTROLS.items()}
        settings = {k: ch01.CONTROLS[k][i] for k, i in pick.items()}
        e = estimate(ch01.page_config(settings))
        states = [pick[k] for k in ("preset", "seq_len", "precision", "optimizer",
                                    "zero_stage", "dp")]
        acts = [pick[k] for k in ("preset", "seq_len", "precision", "micro_batch",
                                  "recompute", "attention")]
        got = [live.coded_entry(grid["states"], [*states, p]) for p in range(3)]
        assert got == [e.params, e.grads, e.optimizer], settings
        assert live.coded_entry(grid["activations"], acts) == e.activations, settings
    assert list(grid["controls"]) == keys


def test_planner_grid_is_dtlib_search(monkeypatch: pytest.MonkeyPatch) -> None:
    # Two settings (a search each), not the page's whole grid: same code path.
    small = {**{k: [v] for k, v in ch11.DEFAULTS.items()},
             "model": ["GPT-3 13B", "Llama 3 405B"], "n_gpus": [64]}
    monkeypatch.setattr(ch11, "CONTROLS", small)
    grid = ch11.planner_grid()
    for i, model in enumerate(small["model"]):
        settings = {**ch11.DEFAULTS, "model": model, "n_gpus": 64}
        ranked = search(*ch11.page_problem(settings),
                    schedules=(settings["schedule"],))
        n, top = grid["rankings"][i][0][0][0][0][0]
        assert n == len(ranked)
        assert top == [[c.label(), e.step_time_s, e.memory_per_gpu_bytes]
                       for c, e in ranked[:ch11.TOP]]
    assert grid["rankings"][1][0][0][0][0][0][0] == 0  # 405B does not fit on 64 GPUs
    # the schedule control: ZB-V's pipelines are ranked where the reader picks it
    zbv = {**ch11.DEFAULTS, "model": "GPT-3 13B", "n_gpus": 128, "schedule": "zb-v"}
    monkeypatch.setattr(ch11, "CONTROLS", {k: [v] for k, v in zbv.items()})
    top = ch11.planner_grid()["rankings"][0][0][0][0][0][0][1]
    ranked = search(*ch11.page_problem(zbv), schedules=("zb-v",))
    assert top == [[c.label(), e.step_time_s, e.memory_per_gpu_bytes]
                   for c, e in ranked[:ch11.TOP]]
    assert {c.schedule for c, _ in ranked if c.pp > 1} == {"zb-v"}
