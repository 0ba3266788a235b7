"""Sphinx extension: every page links to the same page in the other edition.

The English edition is built into ``_build/html`` and the Chinese one into
``_build/html/zh_CN`` from the same executed notebooks. Each page gets a link, by a
relative path, to its twin: it works from ``file://`` with no server and offline, which
is how most readers open the book. ``<link rel="alternate" hreflang=...>`` tells a
browser (and a search engine, where the book is served) the same.
"""

from __future__ import annotations

from typing import Any

#: language -> (the folder of its edition under _build/html, its name in itself).
EDITIONS = {"en": ("", "English"), "zh_CN": ("zh_CN", "中文")}


def twin_href(pagename: str, language: str) -> tuple[str, str, str]:
    """The relative address of ``pagename`` in the other edition, its language and name.

    Args:
        pagename: Sphinx's page name (``notebooks/01_memory``).
        language: the language of the edition being built (``en`` or ``zh_CN``).
    """
    here = EDITIONS.get(language, EDITIONS["en"])[0]
    other = "en" if here else "zh_CN"
    there, name = EDITIONS[other]
    up = "../" * (pagename.count("/") + (1 if here else 0))
    return f"{up}{there + '/' if there else ''}{pagename}.html", other, name


def _add_link(app: Any, pagename: str, templatename: str, context: dict,
              doctree: Any) -> None:
    if doctree is None or "body" not in context:
        return
    href, other, _ = twin_href(pagename, app.config.language or "en")
    lang = other.replace("_", "-")
    label = "Read this page in English" if other == "en" else "阅读本页中文版"
    notice = ""
    if other == "en" and pagename in _pending(app):
        notice = ('<div class="admonition note translation-pending"><p>'
                  "本页的中文翻译尚未完成：还没有译出的段落暂以英文显示。"
                  f'<a href="{href}" hreflang="{lang}" lang="{lang}">英文版</a>'
                  "是完整的。</p></div>\n")
    context["body"] = (
        f'<p class="edition-switch"><a href="{href}" hreflang="{lang}" lang="{lang}">'
        f'{label}</a></p>\n' + notice + context["body"])
    context["metatags"] = context.get("metatags", "") + (
        f'\n<link rel="alternate" hreflang="{lang}" href="{href}" />')


def _pending(app: Any) -> set[str]:
    """The pages of this edition whose translation is not finished
    (``locale/<language>/pending.txt``, one page name first on each line)."""
    import os

    found: set[str] = set()
    for folder in app.config.locale_dirs:
        path = os.path.join(app.srcdir, folder, app.config.language, "pending.txt")
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                found |= {line.split("#", 1)[0].split()[0] for line in f
                          if line.split("#", 1)[0].strip()}
    return found


def _alt_texts_as_messages(app: Any, doctree: Any) -> None:
    """For the catalogs (the gettext builder only): each figure's alt text, which a
    code cell's metadata holds (``mystnb.image.alt``) and no paragraph does, becomes a
    message of its page, numbered as myst-nb numbers the cell's lines."""
    import json

    from docutils import nodes

    source = doctree.get("source") or ""
    if app.builder.name != "gettext" or not source.endswith(".ipynb"):
        return
    with open(source, encoding="utf-8") as f:
        cells = json.load(f).get("cells", [])
    for i, cell in enumerate(cells):
        image = cell.get("metadata", {}).get("mystnb", {}).get("image", {})
        alt = (image.get("alt") or "").strip() if isinstance(image, dict) else ""
        if alt:
            para = nodes.paragraph(alt, alt)
            para.source, para.line = source, 10000 * (i + 1) + 1
            doctree.append(para)


def _translate_alt_texts(app: Any, doctree: Any, docname: str) -> None:
    """In an edition of another language, each figure's alt text from its catalog."""
    from docutils import nodes
    from sphinx.locale import init as init_locale
    from sphinx.util.i18n import docname_to_domain

    if not app.config.language or app.config.language == "en":
        return
    domain = docname_to_domain(docname, app.config.gettext_compact)
    catalog, found = init_locale(list(app.config.locale_dirs), app.config.language,
                                 domain)
    if not found:
        return
    for image in doctree.findall(nodes.image):
        alt = (image.get("alt") or "").strip()
        if alt:
            image["alt"] = catalog.gettext(alt)


def setup(app: Any) -> dict:
    app.connect("html-page-context", _add_link)
    app.connect("doctree-read", _alt_texts_as_messages)
    app.connect("doctree-resolved", _translate_alt_texts)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
