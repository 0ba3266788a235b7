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


def _is_exercise_title(node: Any) -> bool:
    """sphinx-exercise's node for the title an ``{exercise}`` fence gives."""
    return type(node).__name__ == "exercise_subtitle"


def _title_text(node: Any) -> str:
    """An exercise title as its fence wrote it (smart quotes made straight again, as
    the page's other messages keep them)."""
    text = node.astext().strip()
    for curly, straight in (("\u2019", "'"), ("\u2018", "'"), ("\u201c", '"'),
                            ("\u201d", '"')):
        text = text.replace(curly, straight)
    return text


def _exercise_titles_as_messages(app: Any, doctree: Any) -> None:
    """For the catalogs (the gettext builder only): each exercise's title, which
    sphinx-exercise keeps in a node the gettext builder skips, becomes a message of
    its page, at the line of its ``{exercise}`` fence."""
    from docutils import nodes

    if app.builder.name != "gettext":
        return
    for node in list(doctree.findall(_is_exercise_title)):
        title = _title_text(node)
        if title:
            para = nodes.paragraph(title, title)
            para.source = node.parent.source or doctree.get("source")
            para.line = node.parent.line
            doctree.append(para)


def _page_catalog(app: Any, docname: str) -> Any:
    """The catalog of ``docname`` in this edition's language (None: English, or no
    catalog)."""
    from sphinx.locale import init as init_locale
    from sphinx.util.i18n import docname_to_domain

    if not app.config.language or app.config.language == "en":
        return None
    domain = docname_to_domain(docname, app.config.gettext_compact)
    catalog, found = init_locale(list(app.config.locale_dirs), app.config.language,
                                 domain)
    return catalog if found else None


def _translate_exercise_titles(app: Any, doctree: Any) -> None:
    """In an edition of another language, each exercise's title from its catalog
    (when the page is read: sphinx-exercise folds the title into another node when
    the page is resolved)."""
    from docutils import nodes

    catalog = _page_catalog(app, app.env.docname)
    if catalog is None:
        return
    for node in doctree.findall(_is_exercise_title):
        title = _title_text(node)
        if title and catalog.gettext(title) != title:
            node.children = []
            node += nodes.Text(catalog.gettext(title))


def _exercise_words(app: Any) -> None:
    """sphinx-exercise's own words (its "Solution" has no Chinese in its catalog):
    ``_ext/locale/<language>/LC_MESSAGES/exercise.po``, compiled here, is added to
    its message catalog (a message it has keeps its translation)."""
    import os

    from sphinx.util.i18n import CatalogInfo

    language = app.config.language
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "locale")
    folder = os.path.join(here, language or "", "LC_MESSAGES")
    if not language or not os.path.isfile(os.path.join(folder, "exercise.po")):
        return
    CatalogInfo(folder, "exercise", "utf-8").write_mo(language)
    app.add_message_catalog("exercise", here)


def _translate_alt_texts(app: Any, doctree: Any, docname: str) -> None:
    """In an edition of another language, each figure's alt text from its catalog."""
    from docutils import nodes

    catalog = _page_catalog(app, docname)
    if catalog is None:
        return
    for image in doctree.findall(nodes.image):
        alt = (image.get("alt") or "").strip()
        if alt:
            image["alt"] = catalog.gettext(alt)


# Sphinx parses each translated message of a page as a small document of its own;
# myst-nb gives that one a fresh notebook renderer with no glue data, and has dropped
# the page's renderer by then, so a glue role in a translation ({glue:text}`x`) would
# find nothing. The page's renderer is kept when the page is parsed and its messages'
# glue roles read it while Sphinx's Locale transform translates the page.
_RENDERERS: dict[str, Any] = {}   # docname -> the renderer of its notebook
_PARSING: list[str | None] = []   # the page being parsed (None: a message of one)
_PAGE_RENDERER: list[Any] = []    # the renderer of the page being translated


def _keep_page_renderer(parse: Any) -> Any:
    def wrapped(self: Any, inputstring: str, document: Any) -> Any:
        message = str(document.get("source", "")).endswith("<translated>")
        _PARSING.append(None if message else document.settings.env.docname)
        try:
            return parse(self, inputstring, document)
        finally:
            _PARSING.pop()
    wrapped.dtlib_wrapped = True
    return wrapped


def _record_renderer(load: Any) -> Any:
    def wrapped(name: str) -> Any:
        cls = load(name)

        def make(*args: Any, **kwargs: Any) -> Any:
            made = cls(*args, **kwargs)
            if _PARSING and _PARSING[-1]:
                _RENDERERS[_PARSING[-1]] = made
            return made
        return make
    wrapped.dtlib_wrapped = True
    return wrapped


def _with_page_renderer(apply: Any) -> Any:
    def wrapped(self: Any, **kwargs: Any) -> Any:
        _PAGE_RENDERER.append(_RENDERERS.pop(self.env.docname, None))
        try:
            return apply(self, **kwargs)
        finally:
            _PAGE_RENDERER.pop()
    wrapped.dtlib_wrapped = True
    return wrapped


def _in_language(retrieve: Any, document: Any, key: str) -> Any:
    """The value glued for this edition's language (``key__zh_CN``, glued by
    dtlib.runtime.i18n.glue_in_each_language) where there is one, else ``key``'s."""
    from myst_nb.ext.glue.utils import RetrievalError

    env = getattr(document.settings, "env", None)
    lang = getattr(getattr(env, "config", None), "language", None) or "en"
    if lang != "en":
        try:
            return retrieve(document, f"{key}__{lang}")
        except RetrievalError:
            pass
    return retrieve(document, key)


def _glue_from_page(retrieve: Any) -> Any:
    def wrapped(document: Any, key: str) -> Any:
        page = _PAGE_RENDERER[-1] if _PAGE_RENDERER else None
        if page is None:
            return _in_language(retrieve, document, key)
        own = document.attributes.get("nb_renderer")   # restored: it is not pickled
        document["nb_renderer"] = page
        try:
            return _in_language(retrieve, document, key)
        finally:
            document["nb_renderer"] = own
    wrapped.dtlib_wrapped = True
    return wrapped


def _glue_in_translations() -> None:
    from myst_nb import sphinx_
    from myst_nb.ext.glue import directives, roles
    from sphinx.transforms import i18n

    for owner, name, wrap in ((sphinx_.Parser, "parse", _keep_page_renderer),
                              (sphinx_, "load_renderer", _record_renderer),
                              (i18n.Locale, "apply", _with_page_renderer),
                              (roles, "retrieve_glue_data", _glue_from_page),
                              (directives, "retrieve_glue_data", _glue_from_page)):
        if not getattr(getattr(owner, name), "dtlib_wrapped", False):
            setattr(owner, name, wrap(getattr(owner, name)))


def _translate_toctree_captions(app: Any, doctree: Any) -> None:
    """In an edition of another language, the table of contents' part captions from
    the root page's catalog: the toctrees _toc.yml inserts are added after Sphinx's
    Locale transform has run, so it never sees their captions."""
    from sphinx import addnodes

    trees = [t for t in doctree.findall(addnodes.toctree) if t.get("caption")]
    catalog = _page_catalog(app, app.env.docname) if trees else None
    if catalog is None:
        return
    for tree in trees:
        tree["caption"] = catalog.gettext(tree["caption"])


def setup(app: Any) -> dict:
    _glue_in_translations()
    _exercise_words(app)
    app.connect("html-page-context", _add_link)
    app.connect("doctree-read", _alt_texts_as_messages)
    app.connect("doctree-read", _exercise_titles_as_messages)
    app.connect("doctree-read", _translate_exercise_titles)
    # before Sphinx's toctree collector (priority 500) records the captions
    app.connect("doctree-read", _translate_toctree_captions, priority=400)
    app.connect("doctree-resolved", _translate_alt_texts)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
