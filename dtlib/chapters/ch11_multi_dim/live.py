"""Chapter 11's parallel planner, live in the static page.

For every value its controls offer (model, GPUs, GPU memory, global batch, sequence
length, pipeline schedule) :func:`dtlib.planner.search` ran here, at build time; the
page keeps how many configurations fit and the fastest few, with the planner's memory
per GPU and estimated step time, and shows the ones the reader's setting selects.

Taught in: Chapter 11, choosing the degrees: a planner.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from dtlib.chapters.live import LiveCalculator, both, in_both, select
from dtlib.planner import (PP_SCHEDULES, ClusterSpec, Estimate, ModelSpec,
                           ParallelConfig, search)
from dtlib.planner.published import GPT_VOCAB, LLAMA3_405B
from dtlib.runtime.i18n import N_

__all__ = ["CONTROLS", "DEFAULTS", "MODELS", "TOP", "page_problem", "page_search",
           "planner_calculator", "planner_grid"]

#: The models the page offers (shapes at sequence length 2048; the control sets it).
MODELS: dict[str, ModelSpec] = {
    "GPT-3 13B": ModelSpec(40, 5120, 40, GPT_VOCAB, 2048),
    "GPT-3 175B": ModelSpec(96, 12288, 96, GPT_VOCAB, 2048),
    "Llama 3 405B": ModelSpec(seq_len=2048, **LLAMA3_405B),
}
#: The values each control offers; the grid holds a search for every combination
#: (144 of them: a few seconds when the book is built).
CONTROLS: dict[str, list[Any]] = {
    "model": list(MODELS),
    "n_gpus": [128, 1024],
    "memory_gib": [40, 80],  # the A100's two sizes
    "global_batch": [512, 2048],
    "seq_len": [2048, 8192],
    "schedule": list(PP_SCHEDULES),  # the pipeline's, where pp > 1 (Chapter 6)
}
DEFAULTS: dict[str, Any] = {"model": "GPT-3 175B", "n_gpus": 1024, "memory_gib": 80,
                            "global_batch": 2048, "seq_len": 2048, "schedule": "1f1b"}
_LABELS = {"model": N_("model"), "n_gpus": N_("GPUs"),
           "memory_gib": N_("GPU memory (GiB)"),
           "global_batch": N_("global batch (sequences)"),
           "seq_len": N_("sequence length"), "schedule": N_("pipeline schedule")}
#: Configurations shown per setting, fastest first.
TOP = 5
# The A100 of the chapter's Megatron-LM runs (40 or 80 GiB: the control sets it).
_GPU = "A100-80GB"


def page_problem(settings: dict[str, Any]) -> tuple[ModelSpec, ClusterSpec, int]:
    """The planner's problem for a setting of the page's controls.

    Args:
        settings: a value per control of :data:`CONTROLS`.
    Returns:
        ``(model, cluster, global_batch)`` for :func:`dtlib.planner.search`.

    Taught in: Chapter 11, choosing the degrees: a planner.
    """
    model = replace(MODELS[settings["model"]], seq_len=settings["seq_len"])
    cluster = ClusterSpec.preset(_GPU, settings["n_gpus"],
                                 memory_bytes=settings["memory_gib"] * 2 ** 30)
    return model, cluster, settings["global_batch"]


def page_search(settings: dict[str, Any]) -> list[tuple[ParallelConfig, Estimate]]:
    """The planner's ranking for a setting of the page's controls: the search of
    :func:`page_problem`, its pipelines run by the chosen schedule.

    Taught in: Chapter 11, choosing the degrees: a planner.
    """
    return search(*page_problem(settings), schedules=(settings["schedule"],))


def planner_grid() -> dict[str, Any]:
    """Every ranking the page can show, from :func:`dtlib.planner.search`.

    Returns:
        ``{"controls", "rankings"}``; ``rankings`` indexed by the controls (in
        :data:`CONTROLS`' order) gives ``[n_fit, [[label, step_s, memory_bytes],
        ...]]`` for the :data:`TOP` fastest configurations that fit.

    Taught in: Chapter 11, choosing the degrees: a planner.
    """
    keys = list(CONTROLS)

    def build(i: int, settings: dict[str, Any]) -> Any:
        if i == len(keys):
            ranked = page_search(settings)
            return [len(ranked), [[c.label(), e.step_time_s, e.memory_per_gpu_bytes]
                                  for c, e in ranked[:TOP]]]
        return [build(i + 1, {**settings, keys[i]: v}) for v in CONTROLS[keys[i]]]

    return {"controls": CONTROLS, "rankings": build(0, {})}


_SCRIPT = """
function update() {
  const [n, top] = %(keys)s.reduce((t, k) => t[pick(k)[0]], grid.rankings);
  out("count").textContent = n ? tr(%(count)s).replace("{n}", n)
                                   .replace("{k}", top.length)
                               : tr(%(none)s);
  out("ranked").innerHTML = top.map(([label, step, mem], i) =>
      `<tr><td>${i + 1}</td><td>${label}</td><td>${fixed(step, 2)}</td>` +
      `<td>${fixed(mem / 1e9, 1)}</td></tr>`).join("");
}
"""


def planner_calculator() -> LiveCalculator:
    """Chapter 11's planner for the static page (see the module's docstring).

    Returns:
        A :class:`~dtlib.chapters.live.LiveCalculator`; a notebook shows its HTML.

    Taught in: Chapter 11, choosing the degrees: a planner.
    """
    controls = "".join(select(k, _LABELS[k], v, DEFAULTS[k])
                       for k, v in CONTROLS.items())
    heads = "".join(f"<th>{both(h)}</th>" for h in (
        N_("rank"), N_("configuration"), N_("step (s)"), N_("memory per GPU (GB)")))
    outputs = (f'<p data-out="count"></p><table class="table"><thead><tr>{heads}</tr>'
               '</thead><tbody data-out="ranked"></tbody></table>')
    fallback = N_("The live planner needs JavaScript; the table above is its ranking "
                  "for GPT-3 175B on 768 A100s. In JupyterLab (<code>make lab</code>) "
                  "call <code>search</code> with your own model and GPUs.")
    words = {"count": in_both(N_("{n} configurations fit; the fastest {k}:")),
             "none": in_both(N_("no configuration fits"))}
    script = _SCRIPT % {"keys": json.dumps(list(CONTROLS)),
                        **{k: json.dumps(v, ensure_ascii=False)
                           for k, v in words.items()}}
    return LiveCalculator("ch11-planner", N_("Fastest configurations that fit, ranked "
                          "by dtlib.planner.search (A100 GPUs, 8 per node)"), controls,
                          outputs, planner_grid(), script, fallback)
