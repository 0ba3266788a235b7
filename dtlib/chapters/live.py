"""Calculators that stay live in the static book: a grid computed by dtlib, looked up
in the reader's browser.

The book is read from disk (``file://``) and offline, where a browser refuses to fetch
files; so a page's calculator carries everything in its own HTML: the grid of every
value its controls can take, computed here at build time by dtlib's own functions, in
a ``<script type="application/json">`` block, and a small script that only looks the
numbers up and shows them. No Python runs in the browser, no formula is rewritten in
JavaScript, and the reader's page starts with no download.

Why a grid and not Python in the page: an interpreter that runs from plain script
files (Brython) would run the planner's own modules, but it adds about 1.5 MB of
interpreter and more of its standard library (``dataclasses`` pulls in ``inspect``,
``typing``, ``re``) to every page that has a calculator, and compiles them at each
page load; the grid adds tens of kB, starts in milliseconds, and holds dtlib's exact
result for every value a control offers (the controls offer only those values).

Before the script runs (or without JavaScript) the calculator shows a note instead:
the static table above it is the built result, and ``make lab`` gives the live
ipywidgets version in JupyterLab.

Both editions of the book show the same executed output, so a calculator carries its
words in English and in Chinese (:func:`both`, from dtlib's catalog): the page's
``<html lang>`` decides which one a reader sees, in the HTML by a style rule and in the
script by ``tr``.

Taught in: Chapter 1, the planner; Chapter 11, choosing the degrees.
"""

from __future__ import annotations

import html
import json
import re
from typing import Any, Sequence

from dtlib.runtime.i18n import _, speaking

__all__ = ["LiveCalculator", "both", "coded_entry", "coded_table", "in_both", "select"]


def in_both(english: str) -> list[str]:
    """``[english, its Chinese]``: what a calculator's script picks from with ``tr``."""
    with speaking("zh_CN"):
        return [english, _(english)]


def both(english: str, markup: bool = False) -> str:
    """HTML of ``english`` and its Chinese, each in a ``lang`` span; the page's
    language shows one (a style rule of the calculator hides the other).

    Args:
        english: the message (one of dtlib's catalog's).
        markup: ``english`` and its translation are HTML already (not escaped).
    """
    en, zh = in_both(english)
    if not markup:
        en, zh = html.escape(en), html.escape(zh)
    return f'<span lang="en">{en}</span><span lang="zh-CN">{zh}</span>'


# Two characters of this alphabet code one entry of a table's list of distinct values.
ALPHABET = ("0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz-_")

# Shared by every calculator's script: read the controls, format like the tests expect.
# fixed(x, d) is JavaScript's toFixed: the decimal nearest to the exact double, ties
# away from zero (tests/rendered/test_live_calculators.py rounds the same way).
_PRELUDE = """
const root = document.getElementById(%(id)s);
const grid = JSON.parse(root.querySelector("script.dtlib-live-grid").textContent);
const out = name => root.querySelector(`[data-out="${name}"]`);
const pick = name => {
  const e = root.querySelector(`select[name="${name}"]`);
  return [e.selectedIndex, grid.controls[name][e.selectedIndex]];
};
const fixed = (x, d) => x.toFixed(d);
// The page's language picks a message's English or Chinese (in_both in live.py).
const ZH = (document.documentElement.lang || "").toLowerCase().startsWith("zh");
const tr = pair => pair[ZH ? 1 : 0];
// Entry [i0][i1]... of a coded table (see coded_table in dtlib/chapters/live.py).
const A = %(alphabet)s;
const lookup = (t, idx) => {
  const flat = idx.reduce((f, i, k) => f * t.shape[k] + i, 0);
  return t.values[A.indexOf(t.codes[2 * flat]) * 64 + A.indexOf(t.codes[2 * flat + 1])];
};
"""

_START = """
root.querySelectorAll("select").forEach(e => e.addEventListener("change", update));
update();
root.querySelector(".dtlib-live-nojs").hidden = true;
root.querySelector(".dtlib-live-ui").hidden = false;
root.dataset.scriptMs = (performance.now() - t0).toFixed(1);
root.dataset.readyMs = performance.now().toFixed(1);  // since navigation began
"""

_STYLE = """
<style>
.dtlib-live { border: 1px solid #ccc; border-radius: 6px; padding: 0.8em 1em;
              margin: 1em 0; }
.dtlib-live label { display: inline-block; margin: 0 1.2em 0.4em 0; }
.dtlib-live select { margin-left: 0.3em; }
.dtlib-live .dtlib-bar { display: flex; height: 1.6em; position: relative;
                         background: #f3f3f3; margin: 0.6em 0; }
.dtlib-live .dtlib-bar span { display: block; height: 100%; }
.dtlib-live .dtlib-limit { position: absolute; top: -0.3em; bottom: -0.3em;
                           border-left: 2px dashed #000; }
.dtlib-live table { margin: 0.4em 0; }
.dtlib-live .dtlib-swatch { display: inline-block; width: 0.9em; height: 0.9em;
                            margin-right: 0.3em; vertical-align: middle; }
html:lang(zh) .dtlib-live [lang="en"], html:not(:lang(zh)) .dtlib-live [lang="zh-CN"]
  { display: none; }
</style>
"""


def coded_table(nested: list) -> dict[str, Any]:
    """A nested list of numbers, stored compactly: its shape, its distinct values, and
    for each entry (in row-major order) two characters naming its value.

    The tables of a calculator repeat few values many times (a ZeRO stage leaves the
    parameters as they are, an optimizer leaves the gradients), so this is several
    times smaller than the nested JSON.

    Args:
        nested: equally long lists down to numbers, e.g. ``[[1, 2], [2, 3]]``.
    Returns:
        ``{"shape": [...], "values": [...], "codes": "..."}``.
    """
    shape, level = [], nested
    while isinstance(level, list):
        if not level:
            raise ValueError("nested has an empty list")
        shape.append(len(level))
        level = level[0]
    flat = list(_flatten(nested, shape))
    values = sorted(set(flat))
    if len(values) > len(ALPHABET) ** 2:
        raise ValueError(f"{len(values)} distinct values: at most "
                         f"{len(ALPHABET) ** 2} fit two characters")
    where = {v: i for i, v in enumerate(values)}
    codes = "".join(ALPHABET[where[v] // 64] + ALPHABET[where[v] % 64] for v in flat)
    return {"shape": shape, "values": values, "codes": codes}


def _flatten(nested: Any, shape: list[int]):
    if not shape:
        if isinstance(nested, list):
            raise ValueError("nested is deeper in some places than in others")
        yield nested
        return
    if not isinstance(nested, list) or len(nested) != shape[0]:
        raise ValueError("nested is not rectangular")
    for item in nested:
        yield from _flatten(item, shape[1:])


def coded_entry(table: dict[str, Any], index: Sequence[int]) -> Any:
    """Entry ``index`` of a :func:`coded_table` (what the page's ``lookup`` does)."""
    flat = 0
    for size, i in zip(table["shape"], index, strict=True):
        flat = flat * size + i
    c = table["codes"][2 * flat:2 * flat + 2]
    return table["values"][ALPHABET.index(c[0]) * 64 + ALPHABET.index(c[1])]


def select(name: str, label: str, options: Sequence[Any], default: Any) -> str:
    """One labelled ``<select>`` whose option i is the grid's value i.

    Args:
        name: the control's name (a key of the grid's ``controls``).
        label: what the reader sees beside it (a message of dtlib's catalog:
            shown in the page's language).
        options: the values, in the grid's order.
        default: the value selected first (one of ``options``).
    Returns:
        The HTML.
    """
    options = list(options)
    if default not in options:
        raise ValueError(f"default={default!r} is not one of {options}")
    opts = "".join(f'<option{" selected" if v == default else ""}>'
                   f"{html.escape(str(v))}</option>" for v in options)
    return (f'<label>{both(label)}<select name="{html.escape(name)}">'
            f"{opts}</select></label>")


class LiveCalculator:
    """A calculator for the static page: controls, outputs, the grid and its script.

    Args:
        ident: the HTML id of the calculator (unique on its page).
        title: its heading (a message of dtlib's catalog, as ``fallback`` is).
        controls: HTML of the controls (see :func:`select`); their names are the
            keys of ``grid["controls"]``.
        outputs: HTML of the outputs (elements with ``data-out`` attributes).
        grid: what the script looks up: ``{"controls": {name: [values]}, ...}``.
        script: JavaScript defining ``function update()`` from the prelude's
            ``grid``, ``pick(name)`` and ``out(name)``.
        fallback: the note shown before (or without) JavaScript.

    Taught in: Chapter 1, the planner; Chapter 11, choosing the degrees.
    """

    def __init__(self, ident: str, title: str, controls: str, outputs: str,
                 grid: dict[str, Any], script: str, fallback: str) -> None:
        if not re.fullmatch(r"[a-z][a-z0-9-]*", ident):
            raise ValueError(f"ident={ident!r} must be lower-case letters, digits, -")
        if "controls" not in grid:
            raise ValueError("grid has no 'controls' entry")
        self.ident, self.title, self.grid = ident, title, grid
        self.controls, self.outputs, self.script = controls, outputs, script
        self.fallback = fallback

    def grid_json(self) -> str:
        """The grid as compact JSON, safe inside a ``<script>`` element."""
        text = json.dumps(self.grid, separators=(",", ":"), allow_nan=False)
        return text.replace("</", "<\\/")

    def _repr_html_(self) -> str:
        code = ("(() => {\nconst t0 = performance.now();\n"
                + _PRELUDE % {"id": json.dumps(self.ident),
                            "alphabet": json.dumps(ALPHABET)} + self.script + _START
                + "})();")
        return (f'{_STYLE}<div class="dtlib-live" id="{self.ident}">'
                f"<p><strong>{both(self.title)}</strong></p>"
                f'<p class="dtlib-live-nojs"><em>{both(self.fallback, markup=True)}'
                "</em></p>"
                f'<div class="dtlib-live-ui" hidden>{self.controls}{self.outputs}</div>'
                f'<script type="application/json" class="dtlib-live-grid">'
                f"{self.grid_json()}</script>"
                f"<script>{code}</script></div>")

    def __repr__(self) -> str:
        return (f"<live calculator {self.title!r}: it runs in the built book's page>")
