"""Chapter 1's memory planner, live in the static page.

Every number the page shows was computed here by :func:`dtlib.memory.estimate`, at
build time, for every value its controls offer: the model states (parameters,
gradients, optimizer state) for each model size, sequence length, precision,
optimizer, ZeRO stage and data-parallel size, and the activations for each model,
sequence length, precision, micro-batch, recomputation and attention kind. The page
looks the two up and adds them, as ``MemoryEstimate.total`` does; the verdict is
``MemoryEstimate.fits``'s comparison with the chosen device.

Taught in: Chapter 1, the planner.
"""

from __future__ import annotations

import json
from typing import Any

from dtlib.chapters.ch01_memory.figures import preset_config
from dtlib.chapters.live import LiveCalculator, both, coded_table, in_both, select
from dtlib.runtime.i18n import N_
from dtlib.memory.formulas import ATTENTION, OPTIMIZERS, PRECISIONS, RECOMPUTE, estimate

__all__ = ["CONTROLS", "DEFAULTS", "memory_calculator", "memory_grid", "page_config"]

#: The values each control offers (the grid holds every combination's parts).
CONTROLS: dict[str, list[Any]] = {
    "preset": ["GPT-3 XL (1.3B)", "GPT-3 6.7B", "GPT-3 13B", "GPT-3 175B",
               "Llama-2 7B (approx.)", "Llama-2 13B (approx.)",
               "Llama-2 70B (approx.)"],
    "precision": list(PRECISIONS),
    "optimizer": list(OPTIMIZERS),
    "zero_stage": [0, 1, 2, 3],
    "dp": [2 ** i for i in range(11)],
    "micro_batch": [1, 2, 4, 8, 16],
    "seq_len": [1024, 2048, 4096, 8192],
    "recompute": list(RECOMPUTE),
    "attention": list(ATTENTION),
    "device_gb": [24, 40, 80, 141],
}
DEFAULTS: dict[str, Any] = {
    "preset": "GPT-3 6.7B", "precision": "mixed", "optimizer": "adam",
    "zero_stage": 0, "dp": 8, "micro_batch": 1, "seq_len": 2048, "recompute": "none",
    "attention": "explicit", "device_gb": 80}
_LABELS = {"preset": N_("model"), "precision": N_("precision"),
           "optimizer": N_("optimizer"), "zero_stage": N_("ZeRO stage"),
           "dp": N_("data-parallel GPUs"), "micro_batch": N_("micro-batch"),
           "seq_len": N_("sequence length"), "recompute": N_("recomputation"),
           "attention": N_("attention"), "device_gb": N_("device GB")}
_BAR_NOTE = N_("One bar: the parts stacked; the dashed line is the device's memory.")
_PART_NAMES = {"params": N_("parameters"), "grads": N_("gradients"),
               "optimizer": N_("optimizer state"), "activations": N_("activations")}
# The parts the grid's two tables hold, and what each depends on.
_STATE_KEYS = ("preset", "seq_len", "precision", "optimizer", "zero_stage", "dp")
_ACT_KEYS = ("preset", "seq_len", "precision", "micro_batch", "recompute", "attention")
PARTS = ("params", "grads", "optimizer", "activations")
_COLORS = ("#4C72B0", "#55A868", "#C44E52", "#8172B2")


def page_config(settings: dict[str, Any]):
    """The :class:`~dtlib.memory.TrainingConfig` of a setting of the page's controls.

    Args:
        settings: a value per control of :data:`CONTROLS` (``device_gb`` ignored).
    Returns:
        The configuration (tp = pp = 1: the page is about one data-parallel group).

    Taught in: Chapter 1, the planner.
    """
    fields = {k: v for k, v in settings.items() if k not in ("preset", "device_gb")}
    return preset_config(settings["preset"], **fields)


def _nested(keys: tuple[str, ...], leaf) -> list:
    """A nested list indexed like the controls named ``keys``: leaf(settings)."""
    def build(i: int, settings: dict[str, Any]) -> Any:
        if i == len(keys):
            return leaf(settings)
        return [build(i + 1, {**settings, keys[i]: v}) for v in CONTROLS[keys[i]]]
    return build(0, {})


def memory_grid() -> dict[str, Any]:
    """Every number the page can show, from :func:`dtlib.memory.estimate`.

    Returns:
        ``{"controls", "states", "activations"}``, two
        :func:`~dtlib.chapters.live.coded_table`: ``states`` indexed by the
        controls ``preset, seq_len, precision, optimizer, zero_stage, dp`` and the
        part (params, grads, optimizer) gives bytes; ``activations`` indexed by
        ``preset, seq_len, precision, micro_batch, recompute, attention`` gives the
        activation bytes.

    Taught in: Chapter 1, the planner.
    """
    base = dict(DEFAULTS)

    def states(s: dict[str, Any]) -> list[int]:
        e = estimate(page_config({**base, **s}))
        return [e.params, e.grads, e.optimizer]

    def acts(s: dict[str, Any]) -> int:
        return estimate(page_config({**base, **s})).activations

    return {"controls": CONTROLS,
            "states": coded_table(_nested(_STATE_KEYS, states)),
            "activations": coded_table(_nested(_ACT_KEYS, acts))}


_SCRIPT = """
const at = keys => keys.map(k => pick(k)[0]);
const PARTS = %(parts)s, COLORS = %(colors)s;
function update() {
  const where = at(%(state_keys)s);
  const states = [0, 1, 2].map(p => lookup(grid.states, [...where, p]));
  const acts = lookup(grid.activations, at(%(act_keys)s));
  const parts = [...states, acts];
  const total = parts.reduce((a, b) => a + b, 0);
  const device = pick("device_gb")[1] * 1e9;
  const top = Math.max(total, device);
  PARTS.forEach((p, i) => {
    out(p).textContent = fixed(parts[i] / 1e9, 2);
    const bar = root.querySelector(`.dtlib-bar [data-part="${p}"]`);
    bar.style.width = (100 * parts[i] / top) + "%%";
    bar.style.background = COLORS[i];
  });
  out("total").textContent = fixed(total / 1e9, 2);
  root.querySelector(".dtlib-limit").style.left = (100 * device / top) + "%%";
  out("verdict").textContent = tr(total <= device ? %(fits)s : %(no_fit)s)
      .replace("{gb}", pick("device_gb")[1]);
}
"""


def memory_calculator() -> LiveCalculator:
    """Chapter 1's planner for the static page (see the module's docstring).

    Returns:
        A :class:`~dtlib.chapters.live.LiveCalculator`; a notebook shows its HTML.

    Taught in: Chapter 1, the planner.
    """
    controls = "".join(select(k, _LABELS[k], v, DEFAULTS[k])
                       for k, v in CONTROLS.items())
    rows = "".join(f'<tr><td><span class="dtlib-swatch" style="background:{c}">'
                   f'</span>{both(_PART_NAMES[p])}</td><td data-out="{p}"></td></tr>'
                   for p, c in zip(PARTS, _COLORS))
    bar = "".join(f'<span data-part="{p}"></span>' for p in PARTS)
    # (babel reads no message inside an f-string's braces: name them first)
    per_device, total = both(N_("per device")), both(N_("total"))
    outputs = (f'<div class="dtlib-bar">{bar}<div class="dtlib-limit"></div></div>'
               f"<p><small>{both(_BAR_NOTE)}</small></p>"
               f'<table class="table"><thead><tr><th>{per_device}</th>'
               f'<th>GB</th></tr></thead><tbody>{rows}<tr><td><b>'
               f'{total}</b></td>'
               '<td data-out="total"></td></tr></tbody></table>'
               '<p data-out="verdict"></p>')
    script = _SCRIPT % {"parts": json.dumps(PARTS), "colors": json.dumps(_COLORS),
                        "state_keys": json.dumps(_STATE_KEYS),
                        "act_keys": json.dumps(_ACT_KEYS),
                        "fits": json.dumps(in_both(N_("fits in one {gb} GB device")),
                                           ensure_ascii=False),
                        "no_fit": json.dumps(in_both(N_("does not fit in one {gb} GB "
                                                        "device")), ensure_ascii=False)}
    fallback = N_("The live calculator needs JavaScript; the table above is the same "
                  "estimate for a few presets. In JupyterLab (<code>make lab</code>) "
                  "the planner widget above is live.")
    return LiveCalculator("ch1-memory-calculator",
                          N_("Memory per device (GB = 10⁹ bytes), computed by "
                             "dtlib.memory.estimate"), controls, outputs, memory_grid(),
                          script, fallback)
