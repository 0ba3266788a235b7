"""Sphinx configuration of the catalogs (``make po``) and the Chinese edition.

It is the English edition's configuration, made from ``_config.yml`` by Jupyter Book's
own function (what ``jupyter-book config sphinx`` writes out), with paths made absolute and, when built with ``-D language=zh_CN``, the strings that live in
configuration rather than in a page (the book's title, the search box) taken from the
catalogs. Nothing here is a second copy of the book.
"""

import os
import sys
from pathlib import Path

from jupyter_book.config import get_final_config

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(ROOT, "_ext"))
_english, _ = get_final_config(
    user_yaml=Path(ROOT, "_config.yml"), sourcedir=Path(ROOT),
    cli_config={"external_toc_path": "_toc.yml", "latex_individualpages": False})
globals().update(_english)

html_static_path = [os.path.join(ROOT, p) for p in html_static_path]  # noqa: F821
bibtex_bibfiles = [os.path.join(ROOT, p) for p in bibtex_bibfiles]  # noqa: F821
locale_dirs = [os.path.join(ROOT, "locale")]
external_toc_path = os.path.join(ROOT, "_toc.yml")
nb_execution_cache_path = os.path.join(ROOT, "_build", ".jupyter_cache")


def _translated(english: str) -> str:
    """``english`` as the intro page's catalog translates it (itself if it does not)."""
    import polib

    po = os.path.join(ROOT, "locale", "zh_CN", "LC_MESSAGES", "book", "intro.po")
    if os.path.exists(po):
        entry = polib.pofile(po).find(english)
        if entry is not None and entry.msgstr and "fuzzy" not in entry.flags:
            return entry.msgstr
    return english


def _chinese(app, config):
    if config.language == "zh_CN":
        config.html_title = _translated(config.html_title)
        config.html_theme_options = {**config.html_theme_options,
                                     "search_bar_text": "搜索本书……"}


def setup(app):
    app.connect("config-inited", _chinese)
