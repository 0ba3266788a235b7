"""The Chinese edition as its reader sees it (`_build/html/zh_CN`, built by `make book`).

`test_rendered_book.py` runs every check of the English pages on these pages too (it
walks the whole of `_build/html`). This module adds what only a translation can get
wrong: a paragraph of prose still in English, mojibake, Chinese drawn as empty boxes
(no CJK font), the page's language, the theme's own strings, and the link from every
page to its twin in the other edition (by a relative path, so it works from
`file://`). Each detector is shown catching a planted defect.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from dtlib.exercises import catalogs
from cdp_pipe import Browser, find_chromium

import test_rendered_book as book

HTML = book.HTML
ZH = HTML / "zh_CN"

# Prose, with code, math, program output and the bibliography's entries taken out.
PROSE_JS = r"""
(() => {
  const main = document.querySelector("main") || document.body;
  const skip = ".cell_output, .cell_input, pre, .highlight, .bibliography, " +
               ".citation, .edition-switch, .footnote, script, style";
  const bare = e => {
    const c = e.cloneNode(true);
    c.querySelectorAll("code, .math, mjx-container, pre, .pasted-text, " +
                       ".pasted-inline, " + skip).forEach(x => x.remove());
    return (c.innerText || c.textContent || "").replace(/\s+/g, " ").trim();
  };
  const blocks = [...main.querySelectorAll(
      "p, li, h1, h2, h3, h4, th, td, figcaption, caption, dt, dd, .admonition-title")]
      .filter(e => !e.closest(skip)).filter(e => !e.querySelector("p, li"));
  return {
    lang: document.documentElement.lang,
    prose: blocks.map(bare).filter(Boolean),
    text: main.innerText,
    search: (document.querySelector("input[type=search], .search-button__default-text,"
                                    + " .search-button-field") || {}).placeholder ||
            (document.querySelector(".search-button__default-text") || {}).innerText ||
            "",
    sidebar: [...document.querySelectorAll(".bd-sidebar-primary .caption-text")]
        .map(e => e.innerText.trim()),
    pending: !!main.querySelector(".translation-pending"),
    titles: [...main.querySelectorAll(".admonition-title")]
        .map(e => (e.innerText || "").replace(/\s+/g, " ").trim()),
  };
})()
"""

# Whether each character is drawn with a glyph: drawn alone on a canvas in the page's
# body font, a character no installed font has comes out as the .notdef box (the same
# pixels as an unassigned code point) or as nothing.
GLYPHS_JS = r"""
((chars) => {
  const c = document.createElement("canvas"); c.width = 48; c.height = 48;
  const g = c.getContext("2d", {willReadFrequently: true});
  const probe = document.querySelector("main p") || document.body;
  const family = getComputedStyle(probe).fontFamily;
  g.font = "32px " + family;
  const draw = ch => { g.clearRect(0, 0, 48, 48); g.fillText(ch, 4, 38);
                       return Array.from(g.getImageData(0, 0, 48, 48).data); };
  const notdef = draw("\u0378").join(",");
  return chars.map(ch => {
    const px = draw(ch);
    const ink = px.some((v, i) => i % 4 === 3 && v > 0);
    return !ink || px.join(",") === notdef;
  });
})
"""

LATIN_WORD = re.compile(r"[A-Za-z][A-Za-z'-]+")
CJK = re.compile(r"[\u3400-\u9fff]")
# UTF-8 read as Latin-1 or cp1252, or the replacement character: a continuation byte
# (0x80-0xBF) shows as U+0080-U+00BF or as cp1252's letters for 0x80-0x9F; a Chinese
# character's lead byte (0xE3-0xE9) as ã-é, so 数 reads "æ•°".
_CONT = ("\u0080-\u00bf\u0152\u0153\u0160\u0161\u0178\u017d\u017e\u0192\u02c6"
         "\u02dc\u2013-\u203a\u20ac\u2122")
MOJIBAKE = re.compile(f"\ufffd|[\u00c2\u00c3][{_CONT}]|[\u00e3-\u00e9][{_CONT}]{{2}}")


def still_english(block: str, min_words: int = 5) -> bool:
    """A block of prose with no Chinese and at least ``min_words`` English words."""
    return not CJK.search(block) and len(LATIN_WORD.findall(block)) >= min_words


def english_titles(titles: list[str]) -> list[str]:
    """Admonition titles (an exercise's, its solution's) left in English: no Chinese in
    the title (in an exercise's, in the part its parentheses hold) and an English
    word that is neither code (a name with an underscore) nor a term the glossary
    keeps in English: "练习 1 (Predict an all-reduce)", "Solution"."""
    out = []
    for t in titles:
        own = t.split("(", 1)[-1]
        words = [w for w in LATIN_WORD.findall(re.sub(r"\b\w*_\w*\b", " ", own))
                 if w.lower() not in _KEPT_WORDS]
        if words and not CJK.search(own):
            out.append(t)
    return out


#: words a Chinese title keeps in English: the glossary's kept terms
_KEPT_WORDS = {w.lower() for t in catalogs.glossary() if t.chinese == t.english
               for w in LATIN_WORD.findall(t.english)}


def _zh_pages() -> list[Path]:
    return [p for p in book._pages() if ZH in p.parents]


@pytest.fixture(scope="module")
def zh_rendered() -> dict[str, dict]:
    if not _zh_pages():
        reason = f"no Chinese edition in {ZH}: run `make book` first"
        if book.REQUIRED:
            pytest.fail(reason)
        pytest.skip(reason)
    browser = book._browser()
    facts = {}
    try:
        for page in _zh_pages():
            browser.load(page.as_uri())
            info = browser.evaluate(PROSE_JS)
            chars = sorted(set(CJK.findall(info["text"])))[:60]
            drawn = browser.evaluate(f"({GLYPHS_JS})({chars!r})".replace(
                "'", '"')) if chars else []
            info["boxes"] = [ch for ch, box in zip(chars, drawn) if box]
            info["chars"] = chars
            facts[str(page.relative_to(ZH))] = info
    finally:
        browser.close()
    return facts


def test_the_chinese_edition_has_every_page_of_the_english_one() -> None:
    english = {str(p.relative_to(HTML)) for p in book._pages() if ZH not in p.parents}
    chinese = {str(p.relative_to(ZH)) for p in _zh_pages()}
    if not chinese:
        pytest.skip("no Chinese edition built")
    assert english == chinese, (f"only in English: {sorted(english - chinese)}; "
                                f"only in Chinese: {sorted(chinese - english)}")


def test_every_page_links_to_its_twin_by_a_relative_path() -> None:
    pages = book._pages()
    if not _zh_pages():
        pytest.skip("no Chinese edition built")
    broken = []
    for page in pages:
        if page.name in ("genindex.html", "search.html"):  # Sphinx's, not a page's
            continue
        html = page.read_text(encoding="utf-8")
        m = re.search(r'class="edition-switch"><a href="([^"]+)"', html)
        if not m:
            broken.append(f"{page.relative_to(HTML)}: no link to the other edition")
            continue
        href = m.group(1)
        target = (page.parent / href).resolve()
        if "://" in href or href.startswith("/") or not target.is_file():
            broken.append(f"{page.relative_to(HTML)}: {href} is not a file beside it")
        elif (ZH in page.parents) == (ZH in target.parents) or \
                target.relative_to(ZH if ZH in target.parents else HTML) != \
                page.relative_to(ZH if ZH in page.parents else HTML):
            broken.append(f"{page.relative_to(HTML)}: {href} is not the same page")
    assert not broken, "\n".join(broken[:20])


def test_pages_say_they_are_chinese(zh_rendered) -> None:
    wrong = {p: f["lang"] for p, f in zh_rendered.items() if f["lang"] != "zh-CN"}
    assert not wrong, f"<html lang> is not zh-CN on {wrong}"


def _is_pending(page: str) -> bool:
    return page.removesuffix(".html") in catalogs.pending()


def test_no_paragraph_of_prose_is_still_english(zh_rendered) -> None:
    # A page whose translation is listed as unfinished (locale/zh_CN/pending.txt)
    # shows its untranslated paragraphs in English, and says so (the next test).
    found = {p: [b[:120] for b in f["prose"] if still_english(b)]
             for p, f in zh_rendered.items() if not _is_pending(p)}
    found = {p: v for p, v in found.items() if v}
    assert not found, book._report(found, "blocks of prose still in English")


def test_exercise_and_solution_titles_are_chinese(zh_rendered) -> None:
    # sphinx-exercise keeps an exercise's title where the gettext builder does not
    # look, and its catalog has no Chinese "Solution": _ext/editions.py supplies both
    found = {p: english_titles(f["titles"]) for p, f in zh_rendered.items()
             if not _is_pending(p)}
    found = {p: v for p, v in found.items() if v}
    assert not found, book._report(found, "exercise or solution titles in English")
    assert any(t.startswith("练习") for f in zh_rendered.values() for t in f["titles"])


def test_a_page_still_being_translated_says_so_and_no_other_does(zh_rendered) -> None:
    wrong = {p: f["pending"] for p, f in zh_rendered.items()
             if f["pending"] != _is_pending(p)}
    assert not wrong, ("pages whose notice 'translation not finished' disagrees with "
                       f"locale/zh_CN/pending.txt (True: shown): {wrong}")


def test_no_mojibake(zh_rendered) -> None:
    found = {p: MOJIBAKE.findall(f["text"])[:5] for p, f in zh_rendered.items()
             if MOJIBAKE.search(f["text"])}
    assert not found, book._report(found, "mojibake sequences")


def test_chinese_is_drawn_with_glyphs_not_boxes(zh_rendered) -> None:
    assert any(f["chars"] for f in zh_rendered.values()), "no Chinese text on any page"
    found = {p: f["boxes"] for p, f in zh_rendered.items() if f["boxes"]}
    assert not found, book._report(found, "characters drawn as empty boxes (install "
                                   "a CJK font, e.g. Debian's fonts-noto-cjk)")


def test_the_theme_speaks_chinese(zh_rendered) -> None:
    intro = zh_rendered.get("book/intro.html")
    assert intro is not None, sorted(zh_rendered)[:5]
    assert CJK.search(intro["search"] or ""), f"search box reads {intro['search']!r}"
    assert intro["sidebar"] and all(CJK.search(c) for c in intro["sidebar"]), \
        f"the table of contents' parts read {intro['sidebar']}"


def test_the_detectors_catch_planted_defects() -> None:
    """Without a book: English prose, mojibake and a character no font has."""
    assert still_english("This paragraph was never translated into Chinese at all.")
    assert not still_english("数据并行让每个 rank 持有完整的模型副本。")
    assert not still_english("`torch.distributed` all-reduce")  # names, not prose
    assert MOJIBAKE.search("æ•°æ®å¹¶è¡Œ")  # 数据并行 as UTF-8 read as cp1252
    assert MOJIBAKE.search("caf\ufffd") and not MOJIBAKE.search("数据并行 café")
    assert english_titles(["练习 1 (Predict an all-reduce)", "Solution", "解答",
                           "练习 5 (all-reduce)",
                           "练习 2 (预测一次 all-reduce)", "练习 3 (以 reduce_dtype 做 "
                           "reduce-scatter)", "练习 4 (分发)"]) == [
        "练习 1 (Predict an all-reduce)", "Solution"]
    binary = find_chromium()
    if binary is None:
        pytest.skip("no Chromium for the glyph check")
    browser = Browser.warm(binary)
    try:
        browser.load("data:text/html;charset=utf-8,<main><p>x</p></main>")
        drawn = browser.evaluate(f'({GLYPHS_JS})(["A", "\\u{{10FFFD}}"])')
    finally:
        browser.close()
    assert drawn == [False, True], drawn
