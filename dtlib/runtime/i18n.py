"""The language of dtlib's own sentences: checkers' feedback, hang reports, errors.

Messages are marked with :func:`_` (``_("Not yet")``, ``_("{n} ranks").format(n=n)``)
and translated through Python's :mod:`gettext`, domain ``dtlib``, from the catalog
``dtlib/locale/<lang>/LC_MESSAGES/dtlib.po`` (compiled to ``dtlib.mo`` with Babel by
``make``; read straight from the ``.po`` when the ``.mo`` is missing, as in a fresh
editable install). The language is ``DTLIB_LANG`` (``en`` or ``zh_CN``; a learner
copy made with ``make exercises LANG=zh_CN`` sets it in its first cell with
:func:`use`), so ranks a notebook starts inherit it.

Taught in: the README, "The Chinese edition".
"""

from __future__ import annotations

import contextlib
import functools
import gettext
import os
from pathlib import Path
from typing import Any, Callable, Iterator

DOMAIN = "dtlib"
LOCALE_DIR = Path(__file__).resolve().parents[1] / "locale"
#: Languages with a catalog (English is the source and needs none).
LANGUAGES = ("en", "zh_CN")
ENV = "DTLIB_LANG"


def language() -> str:
    """The language dtlib speaks now: ``DTLIB_LANG``, else English."""
    lang = os.environ.get(ENV, "").strip() or "en"
    return lang if lang in LANGUAGES else "en"


def use(lang: str) -> None:
    """Speak ``lang`` from now on, here and in every process started from here.

    Raises:
        ValueError: ``lang`` has no catalog.
    """
    if lang not in LANGUAGES:
        raise ValueError(f"lang={lang!r}: dtlib speaks {', '.join(LANGUAGES)}")
    os.environ[ENV] = lang


@contextlib.contextmanager
def speaking(lang: str) -> Iterator[None]:
    """Speak ``lang`` inside the ``with`` block only (a learner copy's language).

    Raises:
        ValueError: ``lang`` has no catalog.
    """
    before = os.environ.get(ENV)
    use(lang)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = before


@functools.lru_cache(maxsize=None)
def _translations(lang: str) -> gettext.NullTranslations:
    if lang == "en":
        return gettext.NullTranslations()
    mo = LOCALE_DIR / lang / "LC_MESSAGES" / f"{DOMAIN}.mo"
    po = mo.with_suffix(".po")
    if mo.is_file() and (not po.is_file() or mo.stat().st_mtime >= po.stat().st_mtime):
        with open(mo, "rb") as f:
            return gettext.GNUTranslations(f)
    if po.is_file():  # no compiled catalog (a fresh checkout): compile it in memory
        try:
            import io

            from babel.messages.mofile import write_mo
            from babel.messages.pofile import read_po
        except ImportError:  # pragma: no cover - babel is in the book's extra
            return gettext.NullTranslations()
        with open(po, "rb") as f:
            catalog = read_po(f, locale=lang)
        buf = io.BytesIO()
        write_mo(buf, catalog)
        buf.seek(0)
        return gettext.GNUTranslations(buf)
    return gettext.NullTranslations()


def _(message: str) -> str:
    """``message`` in the current language (itself where it has no translation)."""
    return _translations(language()).gettext(message)


def N_(message: str) -> str:
    """Mark ``message`` for the catalog without translating it now (gettext's
    convention for a table of messages translated where they are shown)."""
    return message


#: The words a page glues into its own sentence (a verdict: "equal", "fits"), marked
#: for the catalog: :func:`glue_word` glues each in every edition's language.
WORDS = (N_("exactly"), N_("NOT"), N_("equal"), N_("unequal"), N_("equal to the byte"),
         N_("not equal"), N_("fits"), N_("does not fit"), N_("within {d:.0e}"),
         N_("runs"), N_("does not run"))


def ngettext(singular: str, plural: str, n: int) -> str:
    """The singular or plural of a message for ``n``, in the current language."""
    return _translations(language()).ngettext(singular, plural, n)


def glue_key(name: str, lang: str) -> str:
    """The name a value glued as ``name`` has in ``lang``'s edition: ``name`` itself in
    English, ``name__zh_CN`` in Chinese. The Chinese build (and a Chinese learner copy)
    shows that one where it exists, and ``name`` where it does not."""
    return name if lang == "en" else f"{name}__{lang}"


def glue_in_each_language(glue: Callable[..., Any], name: str,
                          make: Callable[[], Any]) -> None:
    """Glue what ``make()`` returns once per language, each under :func:`glue_key`:
    a glued sentence (or word) that dtlib writes reads in each edition's language,
    from the one execution both editions share.

    Args:
        glue: myst-nb's ``glue`` (or a learner copy's), called with ``display=False``.
        name: the name the page's prose uses.
        make: builds the value; it runs once per language, inside :func:`speaking`.
    """
    for lang in LANGUAGES:
        with speaking(lang):
            glue(glue_key(name, lang), make(), display=False)


def glue_word(glue: Callable[..., Any], name: str, word: str, **fields: Any) -> None:
    """Glue one of :data:`WORDS` (formatted with ``fields``) in every language, for
    a page whose sentence reads it: "the formula and torch's count are {equal}".

    Raises:
        ValueError: ``word`` is not in :data:`WORDS` (it would have no translation).
    """
    if word not in WORDS:
        raise ValueError(f"word={word!r} is not one of dtlib's glued words {WORDS}")
    glue_in_each_language(glue, name, lambda: _(word).format(**fields))
