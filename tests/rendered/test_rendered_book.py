"""The built book as a reader sees it: every page of `_build/html` opened in headless
Chromium with no network, after MathJax has run.

Checks, over every page: no paragraph of pipes (a Markdown table printed as text); every
math element typeset (MathJax output present, so its assets were found locally); nothing
the page loads comes from off-site; no measured quantity printed as inf/nan; no library
traceback frame in an output; every image has alt text; no figure is shrunk so far that
its labels fall under 9 pt; no shown code cell only glues values; no code block
scrolls sideways at 1280 px. The pages of both editions are checked (the Chinese one
is `_build/html/zh_CN`). A full-page screenshot of each chapter goes to
`_build/screenshots/` for review (a Chinese chapter's as `zh_CN-<chapter>.png`),
stitched from viewport tiles whose seams are checked (each tile overlaps the previous
one and must agree with it there; no band repeated across a seam).

`make test` skips this module when there is no built book (or no Chromium);
`make check-book` (run by `.ci/run` after `make book`) sets DTLIB_REQUIRE_BOOK=1, which
turns a missing book or browser into a failure. DTLIB_BOOK_HTML points at another build.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from cdp_pipe import (INSTALL_HINT, Browser, find_chromium, repeated_band,
                      rows_differing)

ROOT = Path(__file__).resolve().parents[2]
HTML = Path(os.environ.get("DTLIB_BOOK_HTML", ROOT / "_build" / "html")).resolve()
SHOTS = HTML.parent / "screenshots"
REQUIRED = os.environ.get("DTLIB_REQUIRE_BOOK") == "1"
SKIP_DIRS = {"_static", "_sources", "_images", "_downloads", "_panels_static"}
# How long a page may take to typeset its math (MathJax runs once per page load).
MATH_TIMEOUT_MS = 20000

# One pass over the page in the browser, returning everything the checks need.
COLLECT_JS = r"""
(async () => {
  const mj = window.MathJax;
  if (mj && mj.startup && mj.startup.promise) {
    await Promise.race([mj.startup.promise,
                        new Promise(r => setTimeout(r, %(timeout)d))]);
  }
  const text = e => (e.innerText || e.textContent || "").trim();
  const short = s => s.replace(/\s+/g, " ").slice(0, 160);
  const main = document.querySelector("main") || document.body;
  const math = [...main.querySelectorAll(".math")];
  const offsite = u => /^(https?:)?\/\//i.test(u || "");
  const needs = [
    ...[...document.querySelectorAll("script[src]")].map(e => e.getAttribute("src")),
    ...[...document.querySelectorAll("link[href]")]
        .filter(e => /stylesheet|preload|icon|modulepreload/i.test(e.rel))
        .map(e => e.getAttribute("href")),
    ...[...document.querySelectorAll("img[src], iframe[src], source[src]")]
        .map(e => e.getAttribute("src")),
  ].filter(offsite);
  const outputs = [...main.querySelectorAll(".cell_output")];
  return {
    pipes: [...main.querySelectorAll("p")].map(text)
        .filter(t => t.startsWith("|") && (t.match(/\|/g) || []).length >= 4)
        .map(short),
    math_total: math.length,
    math_raw: math.filter(e => !e.querySelector("mjx-container")
                                && !e.matches("mjx-container"))
        .map(e => short(e.textContent)),
    offsite_refs: needs,
    // A glued value with the text right after it (its unit, if any), and table cells.
    values: [
      ...[...main.querySelectorAll(".pasted-text, .pasted-inline")].map(e =>
          text(e) + " " + ((e.nextSibling && e.nextSibling.textContent) || "")
              .trim().slice(0, 12)),
      ...[...main.querySelectorAll("td, th")].map(text)],
    outputs: outputs.map(e => e.textContent),
    // A shown code cell whose every statement is a glue(...) call: nothing to learn.
    glue_only: [...main.querySelectorAll(".cell .cell_input")].map(text)
        .filter(src => {
          const top = src.split("\n").filter(l => l.trim() && !/^[\s)\]}#]/.test(l));
          return top.length > 0 && top.every(l => /^glue\(/.test(l));
        }).map(short),
    // A code block wider than its column scrolls sideways: the reader loses its end.
    scrolling_code: [...main.querySelectorAll("pre")]
        .filter(e => e.scrollWidth > e.clientWidth + 1)
        .map(e => `${e.scrollWidth} px in ${e.clientWidth} px: ` + short(text(e))),
    // A figure wider than the text column is shrunk to fit: matplotlib's 10 pt labels
    // stay >= 9 pt only if it is shrunk by at most a tenth.
    images_shrunk: [...main.querySelectorAll(".cell_output img")]
        .filter(e => e.naturalWidth && e.clientWidth / e.naturalWidth < 0.9)
        .map(e => `${e.naturalWidth} px shown at ${e.clientWidth} px`),
    // Sphinx's fallback alt is the image's file name, matplotlib's "<Figure size ...>":
    // neither describes the figure.
    images_without_alt: [...main.querySelectorAll("img")]
        .filter(e => {
          const alt = (e.getAttribute("alt") || "").trim();
          return !alt || /\.(png|jpe?g|svg|gif)$/i.test(alt) || /^<Figure/.test(alt);
        })
        .map(e => e.getAttribute("src")),
  };
})()
""" % {"timeout": MATH_TIMEOUT_MS}

# A measured value that is not finite: inf/nan with a unit (a glued value in prose, a
# table cell, an output line), a table cell that is only inf/nan, or an output that
# prints one as a named value ("loss=nan"). A bare glued "inf" is allowed: it is how
# the book shows an overflow ("70000 becomes inf in fp16").
UNIT = r"\s*(?:%|[KMGT]i?B(?:/s)?\b|s\b|ms\b|us\b|µs\b|x\b|GFLOP)"
NONFINITE_WITH_UNIT = re.compile(r"(?<![\w.])[-+]?(?:inf|nan)" + UNIT, re.IGNORECASE)
NONFINITE_CELL = re.compile(r"^[-+]?(?:inf|nan|infinity)$", re.IGNORECASE)
NONFINITE_NAMED = re.compile(r"\w\s*[=:]\s*[-+]?(?:inf|nan)\b", re.IGNORECASE)
# A frame of a library's source in a traceback shown to the reader: Python's
# 'File "/.../site-packages/torch/...", line N' or IPython's 'File /.../torch/...:N, in'.
LIBRARY_FRAME = re.compile(
    r'^\s*File "?\S*?(?:site-packages|dist-packages|/lib/python3\.\d+)/')


def _pages() -> list[Path]:
    if not HTML.is_dir():
        return []
    # The root index.html only redirects to the first page (a meta refresh).
    return sorted(p for p in HTML.rglob("*.html")
                  if not SKIP_DIRS & set(p.relative_to(HTML).parts)
                  and 'http-equiv="refresh"' not in p.read_text()[:2000].lower())


def _unavailable() -> str | None:
    if not _pages():
        return (f"no built book in {HTML}: run `make book` first "
                "(`make check-book` requires it)")
    if find_chromium() is None:
        return f"no Chromium to render the book: {INSTALL_HINT}"
    return None


def _browser() -> Browser:
    """A browser for the built book (skip or fail when there is none), warmed up: a
    fresh Chromium spends its first capture creating its compositor, so that happens
    on a tiny page and no chapter's call carries it."""
    reason = _unavailable()
    if reason:
        if REQUIRED:
            pytest.fail(reason)
        pytest.skip(reason)
    return Browser.warm(find_chromium())


@pytest.fixture(scope="module")
def rendered() -> dict[str, dict]:
    """Every page loaded once, offline: the page's collected facts and its requests."""
    browser = _browser()
    facts: dict[str, dict] = {}
    try:
        for page in _pages():
            name = str(page.relative_to(HTML))
            requests = browser.load(page.as_uri())
            try:
                info = browser.evaluate(COLLECT_JS)
            except RuntimeError as err:
                raise RuntimeError(f"{name}: {err}") from None
            info["offsite_requests"] = [u for u in requests
                                        if re.match(r"(https?|wss?|ftp):", u)]
            facts[name] = info
    finally:
        browser.close()
    return facts


def _shot(name: str) -> Path:
    """The screenshot of page ``name`` (``notebooks/01_memory.html``, or the Chinese
    edition's ``zh_CN/notebooks/01_memory.html`` as ``zh_CN-01_memory.png``)."""
    rel = Path(name)
    prefix = "zh_CN-" if rel.parts[0] == "zh_CN" else ""
    return SHOTS / f"{prefix}{rel.stem}.png"


def _is_chapter(name: str) -> bool:
    return name.removeprefix("zh_CN/").startswith("notebooks/")


@pytest.fixture(scope="module")
def screenshots() -> dict[str, dict]:
    """A full-page screenshot of every chapter, saved to SHOTS: per chapter its
    seams and the seams whose overlap disagreed (a fixture of its own, so that the
    pages' checks and the photographs each have their own time limit)."""
    browser = _browser()
    SHOTS.mkdir(parents=True, exist_ok=True)
    shots: dict[str, dict] = {}
    try:
        for page in _pages():
            name = str(page.relative_to(HTML))
            if not _is_chapter(name):
                continue
            browser.load(page.as_uri())
            seams, bad = browser.screenshot(_shot(name))
            shots[name] = {"seams": seams, "seam_mismatches": bad}
    finally:
        browser.close()
    return shots


def _report(found: dict[str, list[str]], what: str) -> str:
    total = sum(len(v) for v in found.values())
    lines = [f"{total} {what} on {len(found)} page(s):"]
    for page, items in found.items():
        lines.append(f"  {page}: {len(items)}")
        lines += [f"      {item!r}" for item in items[:3]]
    return "\n".join(lines)


def _check(rendered: dict[str, dict], key: str, what: str) -> None:
    found = {p: f[key] for p, f in rendered.items() if f[key]}
    assert not found, _report(found, what)


def test_book_has_chapters(rendered: dict[str, dict]) -> None:
    chapters = [p for p in rendered if p.startswith("notebooks/")]
    assert len(chapters) >= 10, f"only {len(chapters)} chapter pages in {HTML}"


def test_no_paragraph_of_pipes(rendered: dict[str, dict]) -> None:
    """A table must be an HTML table, not its Markdown source printed as a paragraph."""
    _check(rendered, "pipes", "Markdown tables printed as a paragraph of pipes")


def test_every_math_element_is_typeset(rendered: dict[str, dict]) -> None:
    """MathJax (shipped with the book) turned every math span into rendered math."""
    total = sum(f["math_total"] for f in rendered.values())
    assert total > 0, "no math element found: did the pages change shape?"
    found = {p: f["math_raw"] for p, f in rendered.items() if f["math_raw"]}
    assert not found, _report(found, f"of {total} math elements left as raw TeX")


def test_nothing_loads_from_off_site(rendered: dict[str, dict]) -> None:
    """No script, style, font or image the page needs comes from the network."""
    found = {p: sorted(set(f["offsite_requests"] + f["offsite_refs"]))
             for p, f in rendered.items() if f["offsite_requests"] or f["offsite_refs"]}
    assert not found, _report(found, "off-site assets requested")


def test_no_measured_value_is_inf_or_nan(rendered: dict[str, dict]) -> None:
    """A failed fit or an empty measurement must be explained, not printed as inf/nan."""
    found = {}
    for page, f in rendered.items():
        bad = [v for v in f["values"]
               if NONFINITE_WITH_UNIT.match(v) or NONFINITE_CELL.match(v)]
        for out in f["outputs"]:
            bad += [m.group(0) for pattern in (NONFINITE_WITH_UNIT, NONFINITE_NAMED)
                    for m in pattern.finditer(out)]
        if bad:
            found[page] = bad
    assert not found, _report(found, "values printed as inf/nan")


def test_no_library_frame_in_outputs(rendered: dict[str, dict]) -> None:
    """An error demo shows the error a reader must recognise, not library internals."""
    found = {}
    for page, f in rendered.items():
        frames = [line.strip() for out in f["outputs"] for line in out.splitlines()
                  if LIBRARY_FRAME.search(line)]
        if frames:
            found[page] = frames
    assert not found, _report(found, "library traceback lines in outputs")


def test_no_shown_cell_is_glue_only(rendered: dict[str, dict]) -> None:
    """A cell that only glues values is hidden (remove-input): the page shows code
    that teaches and the outputs that matter."""
    _check(rendered, "glue_only", "shown code cells that only glue")


def test_no_code_block_scrolls_sideways(rendered: dict[str, dict]) -> None:
    """At the 1280 px a reader's window has, every code block fits its column (long
    lines wrap): nothing is cut at the right edge."""
    _check(rendered, "scrolling_code", "code blocks that scroll sideways at 1280 px")


def test_every_image_has_alt_text(rendered: dict[str, dict]) -> None:
    _check(rendered, "images_without_alt", "images without alt text")


def test_figures_are_legible_at_page_width(rendered: dict[str, dict]) -> None:
    """Figures are drawn at the page's width (about 7 in at 100 dpi), not shrunk."""
    _check(rendered, "images_shrunk", "figures shrunk by more than 10 % to fit the page")


def test_each_chapter_has_a_screenshot(rendered: dict[str, dict],
                                       screenshots: dict[str, dict]) -> None:
    chapters = [p for p in rendered if _is_chapter(p)]
    missing = [c for c in chapters if not _shot(c).is_file()]
    assert not missing, f"no screenshot for {missing} in {SHOTS}"


def test_screenshot_seams_match_the_page(screenshots: dict[str, dict]) -> None:
    """Each tile overlaps the one above it, and the rows seen twice agree (a tile
    pasted at the wrong row, or captured before its scroll was painted, fails)."""
    _check(screenshots, "seam_mismatches", "screenshot seams that differ from the page")


def test_screenshots_repeat_no_band_at_a_seam(screenshots: dict[str, dict]) -> None:
    """No band of rows is repeated right across a seam of a saved screenshot."""
    from PIL import Image

    found = {}
    for page, f in screenshots.items():
        with Image.open(_shot(page)) as image:
            image = image.convert("RGB")
            bands = [f"{k} rows at {seam}" for seam in f["seams"]
                     if (k := repeated_band(image, seam))]
        if bands:
            found[page] = bands
    assert not found, _report(found, "bands repeated at screenshot seams")


def _page_image(height: int = 600, width: int = 200):
    """A synthetic page: a distinct grey ramp per row with a few text-like marks."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    for y in range(0, height, 20):
        draw.text((5 + (y * 7) % 60, y), f"line {y}", fill="black")
    return image


def test_seam_checks_catch_a_tile_pasted_at_the_wrong_row() -> None:
    """Runs without a book: a stitch whose second tile starts 40 rows early repeats a
    band and differs from the page; the right stitch passes both checks."""
    from PIL import Image

    page = _page_image()
    tile, seam = 300, 300
    good = Image.new("RGB", page.size, "white")
    bad = Image.new("RGB", page.size, "white")
    for img, start in ((good, seam), (bad, seam - 40)):
        img.paste(page.crop((0, 0, page.width, tile)), (0, 0))
        img.paste(page.crop((0, start, page.width, start + tile)), (0, seam))
    assert repeated_band(good, seam) == 0
    assert rows_differing(good, 150, page.crop((0, 150, page.width, 450))) is None
    assert repeated_band(bad, seam) == 40
    assert rows_differing(bad, 150, page.crop((0, 150, page.width, 450))) is not None
