"""The memory planner: a stacked-bar chart of per-device memory and its widget.

``plot_memory(cfg)`` draws, for the configuration's settings, one bar per ZeRO
stage (params / grads / optimizer / activations) against the device's memory;
``planner()`` wraps it in ipywidgets sliders. matplotlib and ipywidgets are imported
inside the functions, so ``import dtlib.chapters.ch01_memory.figures`` stays light.

Taught in: Chapter 1, the planner.
"""

from __future__ import annotations

import html
import io
from dataclasses import replace
from typing import Any

from dtlib.chapters.tables import Table
from dtlib.memory.formulas import GB, TrainingConfig, estimate

# GPT-3 sizes from Brown et al. 2020, Table 2.1 (V = 50257, s = 2048). The table
# prints n_heads = 24 for XL and d_model = 5140 for 13B, inconsistent with its
# d_head = 128; we use 16 heads and 5120 so that heads x d_head = d_model.
_GPT3 = dict(vocab_size=50257, seq_len=2048)
PRESETS: dict[str, dict] = {
    "GPT-3 Small (125M)": dict(n_layers=12, hidden=768, n_heads=12, **_GPT3),
    "GPT-3 Medium (350M)": dict(n_layers=24, hidden=1024, n_heads=16, **_GPT3),
    "GPT-3 Large (760M)": dict(n_layers=24, hidden=1536, n_heads=16, **_GPT3),
    "GPT-3 XL (1.3B)": dict(n_layers=24, hidden=2048, n_heads=16, **_GPT3),
    "GPT-3 2.7B": dict(n_layers=32, hidden=2560, n_heads=32, **_GPT3),
    "GPT-3 6.7B": dict(n_layers=32, hidden=4096, n_heads=32, **_GPT3),
    "GPT-3 13B": dict(n_layers=40, hidden=5120, n_heads=40, **_GPT3),
    "GPT-3 175B": dict(n_layers=96, hidden=12288, n_heads=96, **_GPT3),
    # Open models: published parameter counts; their activations are estimated with
    # the GPT formula (4h MLP, one K/V per head): an approximation for SwiGLU / GQA.
    # Modelled with a fused attention kernel (FlashAttention or PyTorch's
    # scaled_dot_product_attention, as torchtitan's Llama runs): no s x s matrix kept.
    "Llama-2 7B (approx.)": dict(n_layers=32, hidden=4096, n_heads=32,
                                 vocab_size=32000, seq_len=4096,
                                 n_params=6_738_415_616, attention="sdpa"),
    "Llama-2 13B (approx.)": dict(n_layers=40, hidden=5120, n_heads=40,
                                  vocab_size=32000, seq_len=4096,
                                  n_params=13_015_864_320, attention="sdpa"),
    "Llama-2 70B (approx.)": dict(n_layers=80, hidden=8192, n_heads=64,
                                  vocab_size=32000, seq_len=4096,
                                  n_params=68_976_648_192, attention="sdpa"),
}
_PARTS = (("params", "#4C72B0"), ("grads", "#55A868"), ("optimizer", "#C44E52"),
          ("activations", "#8172B2"))


def preset_config(name: str, **overrides) -> TrainingConfig:
    """A :class:`~dtlib.memory.TrainingConfig` for a preset model, with overrides.

    Args:
        name: a key of :data:`PRESETS`.
        **overrides: any TrainingConfig field (micro_batch, dp, zero_stage, ...).
    Returns:
        The validated configuration.

    Taught in: Chapter 1, the planner.
    """
    if name not in PRESETS:
        raise ValueError(f"name={name!r} is not one of {sorted(PRESETS)}")
    return TrainingConfig(**{**PRESETS[name], **overrides})


def plot_memory(cfg: TrainingConfig, device_gb: float = 80.0, ax=None,
                title: str | None = None):
    """Stacked bars of per-device memory for ZeRO stages 0-3 at ``cfg``'s settings.

    The bar of ``cfg.zero_stage`` is outlined; a dashed line marks ``device_gb``.

    Args:
        cfg: the configuration (its zero_stage is the highlighted bar).
        device_gb: device memory in GB (1e9 bytes).
        ax: a matplotlib Axes to draw on; a new figure if None.
        title: overrides the title, which otherwise states what fits.
    Returns:
        The matplotlib Figure.

    Taught in: Chapter 1, the planner.
    """
    import matplotlib.pyplot as plt

    if not isinstance(cfg, TrainingConfig):
        raise ValueError(f"cfg={cfg!r} must be a TrainingConfig")
    if not device_gb > 0:
        raise ValueError(f"device_gb={device_gb!r} must be > 0")
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 4))
    stages = range(4)
    ests = [estimate(replace(cfg, zero_stage=s)) for s in stages]
    bottom = [0.0] * 4
    for part, color in _PARTS:
        vals = [getattr(e, part) / GB for e in ests]
        ax.bar(stages, vals, bottom=bottom, color=color, label=part, width=0.6)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.bar([cfg.zero_stage], [bottom[cfg.zero_stage]], width=0.6, fill=False,
           edgecolor="black", linewidth=2)
    # The device line is named in the legend, and the legend stands right of the
    # axes: a label drawn at the line overlapped a bar taller than the device.
    ax.axhline(device_gb, color="black", linestyle="--", linewidth=1,
               label=f"{device_gb:g} GB device")
    ax.set_xticks(list(stages), [f"ZeRO-{s}" if s else "DP (stage 0)" for s in stages])
    ax.set_ylabel("memory per device (GB)")
    ax.set_xlabel(f"dp={cfg.dp} tp={cfg.tp} pp={cfg.pp}, micro_batch="
                  f"{cfg.micro_batch}, s={cfg.seq_len}, recompute={cfg.recompute}, "
                  f"{cfg.attention} attention, {cfg.precision}")
    ax.set_ylim(0, max(max(bottom), device_gb) * 1.15)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=9)
    if title is None:
        fit = [s for s, e in zip(stages, ests) if e.fits(device_gb)]
        title = (f"{cfg.params / 1e9:.1f}B params: fits {device_gb:g} GB from ZeRO-"
                 f"{fit[0]} on" if fit else
                 f"{cfg.params / 1e9:.1f}B params: no ZeRO stage fits {device_gb:g} GB")
    ax.set_title(title)
    ax.figure.tight_layout()
    return ax.figure


def planner(preset: str = "GPT-3 6.7B", device_gb: float = 80.0):
    """An interactive planner: presets, sliders, and :func:`plot_memory`.

    Needs a running kernel to react; built headless (nbval, the book's build) it
    renders once with the defaults and does not error.

    Args:
        preset: the initial key of :data:`PRESETS`.
        device_gb: the initial device memory in GB.
    Returns:
        An ``ipywidgets.VBox``.

    Taught in: Chapter 1, the planner.
    """
    import ipywidgets as w
    import matplotlib.pyplot as plt

    if preset not in PRESETS:
        raise ValueError(f"preset={preset!r} is not one of {sorted(PRESETS)}")
    pow2 = [2 ** i for i in range(11)]
    c = dict(
        preset=w.Dropdown(options=list(PRESETS), value=preset, description="model"),
        device_gb=w.Dropdown(options=[24.0, 40.0, 80.0, 141.0], value=device_gb,
                             description="device GB"),
        seq_len=w.SelectionSlider(options=[2 ** i for i in range(8, 16)], value=2048,
                                  description="seq_len"),
        micro_batch=w.SelectionSlider(options=pow2[:7], value=1,
                                      description="micro_batch"),
        dp=w.SelectionSlider(options=pow2, value=8, description="dp"),
        tp=w.SelectionSlider(options=pow2[:4], value=1, description="tp"),
        pp=w.SelectionSlider(options=pow2[:5], value=1, description="pp"),
        zero_stage=w.IntSlider(value=0, min=0, max=3, description="zero_stage"),
        recompute=w.ToggleButtons(options=["none", "selective", "full"],
                                  description="recompute"),
        precision=w.ToggleButtons(options=["mixed", "fp32"], description="precision"),
        sequence_parallel=w.Checkbox(value=False, description="sequence parallel"),
    )

    # The chart is an Image widget redrawn on every change, not an Output widget:
    # headless executors (nbclient under the book build) can wait forever on an
    # Output widget's captured messages, and an image needs no output capture.
    image = w.Image(format="png")
    message = w.HTML()

    def redraw(_change: object = None) -> None:
        settings = {k: v.value for k, v in c.items()}
        preset_name, gb = settings.pop("preset"), settings.pop("device_gb")
        try:
            cfg = preset_config(preset_name, **settings)
        except ValueError as err:  # e.g. tp not dividing the heads: say so, no crash
            message.value = f"<b>invalid setting:</b> {html.escape(str(err))}"
            return
        message.value = ""
        fig = plot_memory(cfg, gb)
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
        plt.close(fig)
        image.value = buf.getvalue()

    for control in c.values():
        control.observe(redraw, names="value")
    redraw()
    out = w.VBox([message, image])
    return w.VBox([w.HBox([c["preset"], c["device_gb"]]),
                   w.HBox([w.VBox([c[k] for k in ("seq_len", "micro_batch", "dp",
                                                  "tp", "pp", "zero_stage")]),
                           w.VBox([c["recompute"], c["precision"],
                                   c["sequence_parallel"]])]),
                   out])


def preset_table(configs: dict[str, TrainingConfig], device_gb: float = 80.0) -> Any:
    """Per-device memory of several configurations at every ZeRO stage, as a table:
    the static stand-in for :func:`planner` where no kernel runs (the built book).

    Args:
        configs: a label per configuration (see :func:`preset_config`).
        device_gb: device memory in GB (1e9 bytes), for the "fits" column.
    Returns:
        A :class:`dtlib.chapters.tables.Table` (HTML in the book, text when printed).

    Taught in: Chapter 1, the planner.
    """
    if not configs:
        raise ValueError("configs is empty: give at least one labelled TrainingConfig")
    rows = []
    for label, cfg in configs.items():
        totals = [estimate(replace(cfg, zero_stage=s)) for s in range(4)]
        fit = [s for s, e in enumerate(totals) if e.fits(device_gb)]
        row = {"configuration": label,
               "params": f"{cfg.params / 1e9:.1f}B",
               "activations GB": f"{totals[0].activations / GB:.1f}"}
        for s, e in enumerate(totals):
            row[f"ZeRO-{s} GB" if s else "DP GB"] = f"{e.total / GB:.1f}"
        row[f"fits {device_gb:g} GB"] = (f"from ZeRO-{fit[0]}" if fit and fit[0]
                                        else "with DP" if fit else "no")
        rows.append(row)
    return Table(rows)
