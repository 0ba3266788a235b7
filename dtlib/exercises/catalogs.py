"""The Chinese edition's catalogs: what a translation must keep, and its glossary.

The book's prose lives once, in the notebooks and pages; Sphinx's gettext builder cuts
it into messages (one per paragraph, heading, list item or table cell) and
``locale/zh_CN/LC_MESSAGES/**/*.po`` holds a translation of each. A translation may
reword everything except what the build or the reader depends on verbatim:

* roles: ``{glue:text}`name:fmt```, ``{cite:p}`key```, ``{eval}`expr``` whole; for a
  role with a title (``{doc}`Chapter 2 <02_collectives>```) the role and its target,
  the title being prose;
* math (``$...$``, ``$$...$$``), inline code, a link's address;
* the numbers written in digits.

:func:`problems` lists, per message, what a translation lost, added or changed, and
where it is untranslated, fuzzy or out of step with the glossary (``book/glossary.md``).
``python -m dtlib.exercises.catalogs check [PO...]`` prints them; ``make test`` runs the
same check over every catalog (``tests/test_catalogs.py``).

Taught in: the README, "The Chinese edition".
"""

from __future__ import annotations

import re
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LOCALE = ROOT / "locale"
GLOSSARY = ROOT / "book" / "glossary.md"

_TOKEN = re.compile(
    r"(?P<role>\{(?P<name>[A-Za-z][\w:.-]*)\}`(?P<body>[^`]*)`)"
    r"|(?P<code>(?P<ticks>`+)(?P<src>.+?)(?P=ticks))"
    r"|(?P<dmath>\$\$.+?\$\$)"
    r"|(?P<math>(?<![\\$])\$[^$\s](?:[^$]*?[^$\s\\])?\$)"
    r"|\]\((?P<url>[^)\s]+)\)"
    r"|(?P<auto><https?://[^>\s]+>)",
    re.S)
_TITLED = re.compile(r"^(?P<title>.*?)\s*<(?P<target>[^<>]+)>$", re.S)
_DIGITS = re.compile(r"(?<![\w.])\d+(?:[.,]\d+)*")


def tokens(text: str) -> list[str]:
    """What a translation of ``text`` must keep verbatim, in order of appearance.

    Args:
        text: one message (MyST source of a paragraph, heading, item or cell).

    Returns:
        Each role (a titled role as ``{role}<target>``), math span, inline code span
        and link address as a string.
    """
    found = []
    for m in _TOKEN.finditer(text):
        if m.group("role"):
            titled = _TITLED.match(m.group("body"))
            if titled and m.group("name") in ("doc", "ref", "numref", "term",
                                               "download", "prf:ref"):
                found.append(f"{{{m.group('name')}}}<{titled.group('target')}>")
            else:
                found.append(m.group("role"))
        elif m.group("url"):
            found.append(f"({m.group('url')})")
        else:
            found.append(m.group(0))
    return found


def prose(text: str) -> str:
    """``text`` with every kept span removed (what the glossary and digits read)."""
    return _TOKEN.sub(" ", text)


def fields(text: str) -> list[str]:
    """The ``str.format`` fields of one of dtlib's messages (``{n}``, ``{got!r}``)."""
    return re.findall(r"(?<!\{)\{[A-Za-z_]\w*(?:![rsa])?(?::[^{}]*)?\}(?!\})", text)


def numbers(text: str) -> Counter[str]:
    """The numbers written in digits in the prose of ``text`` (not in code or math)."""
    return Counter(_DIGITS.findall(prose(text)))


@dataclass(frozen=True)
class Term:
    """One glossary row: an English term and the Chinese a translation must use."""

    english: str
    chinese: str

    @property
    def pattern(self) -> re.Pattern[str]:
        words = [re.escape(w) for w in re.split(r"[- ]", self.english)]
        return re.compile(r"(?<![\w-])" + r"[- ]?".join(words)
                          + r"(?:s|es|ing)?(?![\w-])", re.I)

    def required(self, msgid: str) -> bool:
        return bool(self.pattern.search(prose(msgid)))

    def used(self, msgstr: str) -> bool:
        if self.chinese == self.english:  # kept in English
            return bool(self.pattern.search(prose(msgstr)))
        return self.chinese in prose(msgstr)


def glossary(path: Path = GLOSSARY) -> list[Term]:
    """The rows of the glossary page's table (``| English | 中文 | Note |``)."""
    terms = []
    for line in path.read_text(encoding="utf-8").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|") or len(cells) < 2:
            continue
        if cells[0] in ("English", "") or set(cells[0]) <= set("-: "):
            continue
        terms.append(Term(cells[0], cells[1]))
    if not terms:
        raise ValueError(f"{path}: no glossary table (| English | 中文 | Note |)")
    return terms


@dataclass(frozen=True)
class Problem:
    """What is wrong with one message of one catalog."""

    po: str
    msgid: str
    what: str

    def __str__(self) -> str:
        short = self.msgid if len(self.msgid) <= 90 else self.msgid[:87] + "..."
        return f"{self.po}: {self.what}\n    msgid: {short!r}"


def entry_problems(msgid: str, msgstr: str, fuzzy: bool = False,
                   terms: list[Term] | None = None) -> list[str]:
    """What one translation gets wrong, each as a sentence (empty: nothing).

    Args:
        msgid: the English message.
        msgstr: its translation ("" when untranslated).
        fuzzy: the catalog marks the entry fuzzy (its English changed since).
        terms: the glossary to hold the translation to (None: not checked).
    """
    if not msgstr:
        return ["untranslated"]
    out = []
    if fuzzy:
        out.append("fuzzy: the English changed since this was translated; "
                   "translate it again and drop the fuzzy flag")
    want, got = Counter(tokens(msgid)), Counter(tokens(msgstr))
    if want != got:
        lost = list((want - got).elements())
        added = list((got - want).elements())
        parts = []
        if lost:
            parts.append(f"drops {lost}")
        if added:
            parts.append(f"adds {added}")
        out.append("the translation " + " and ".join(parts)
                   + " (roles, glue names, math, inline code and links pass "
                   "through unchanged)")
    nw, ng = numbers(msgid), numbers(msgstr)
    if nw != ng:
        out.append(f"numbers differ: the English has {sorted(nw.elements())}, the "
                   f"translation {sorted(ng.elements())}")
    for term in terms or ():
        if term.required(msgid) and not term.used(msgstr):
            out.append(f"glossary: {term.english!r} is {term.chinese!r} in this "
                       "edition (book/glossary.md)")
    return out


def pending(lang: str = "zh_CN", locale: Path = LOCALE) -> dict[str, str]:
    """The pages whose translation is not finished yet: ``locale/<lang>/pending.txt``,
    one ``docname  why`` per line (``#`` starts a comment).

    Their untranslated messages are shown in English and each such page says so at its
    top; every message they do translate is held to the same checks as any other.
    A page leaves the list when its last message is translated (a test insists).
    """
    path = locale / lang / "pending.txt"
    out = {}
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            line = line.split("#", 1)[0].strip()
            if line:
                name, _sep, why = line.partition(" ")
                out[name] = why.strip()
    return out


def catalog_files(lang: str = "zh_CN", locale: Path = LOCALE) -> list[Path]:
    """Every ``.po`` of the book's edition ``lang``."""
    return sorted((locale / lang / "LC_MESSAGES").rglob("*.po"))


def docname(po: Path) -> str:
    """The page a catalog translates (``.../LC_MESSAGES/notebooks/07_x.po``:
    ``notebooks/07_x``)."""
    parts = po.with_suffix("").parts
    if "LC_MESSAGES" in parts:
        return "/".join(parts[len(parts) - parts[::-1].index("LC_MESSAGES"):])
    return po.stem


def problems(paths: list[Path] | None = None, terms: list[Term] | None = None,
             waiting: dict[str, str] | None = None) -> list[Problem]:
    """Every problem of every message in ``paths`` (default: the zh_CN catalogs).

    The glossary page's own catalog is held to the tokens but not to the glossary
    (its English column is the English term). A message left untranslated on a page
    listed in ``waiting`` (default: :func:`pending`) is not a problem; everything
    else about that page is checked.
    """
    import polib

    if terms is None:
        terms = glossary()
    if waiting is None:
        waiting = pending() if paths is None else {}
    found = []
    for path in paths if paths is not None else catalog_files():
        rel = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)
        own = None if path.stem == "glossary" else terms
        later = docname(path) in waiting
        for e in polib.pofile(str(path)):
            if e.obsolete or not e.msgid or (later and not e.msgstr):
                continue
            for what in entry_problems(e.msgid, e.msgstr, "fuzzy" in e.flags, own):
                found.append(Problem(rel, e.msgid, what))
    return found


def pending_problems(lang: str = "zh_CN", locale: Path = LOCALE) -> list[str]:
    """What is wrong with ``pending.txt``: a page it names that has no catalog, or
    whose every message is translated (take it off the list: it is done)."""
    import polib

    pages = {docname(p): p for p in catalog_files(lang, locale)}
    out = []
    for name in pending(lang, locale):
        if name not in pages:
            out.append(f"{name}: no such page has a catalog")
        elif not any(not e.msgstr for e in polib.pofile(str(pages[name]))
                     if e.msgid and not e.obsolete):
            out.append(f"{name}: every message is translated; remove it from "
                       f"locale/{lang}/pending.txt")
    return out


def extract(root: Path, out: Path) -> Path:
    """The book's messages as Sphinx's gettext builder cuts them, one ``.pot`` per page.

    Runs ``sphinx-build -b gettext`` on ``root`` (a checkout: its ``_ext/conf.py`` is
    the configuration) without executing a notebook, into ``out``.

    Args:
        root: the folder holding ``_config.yml``, ``_toc.yml``, the pages and ``_ext``.
        out: where the templates go (``out/notebooks/01_memory.pot``, ...).

    Returns:
        ``out``.
    """
    import subprocess

    cmd = [sys.executable, "-m", "sphinx", "-q", "-b", "gettext", "-c",
           str(root / "_ext"), "-D", "nb_execution_mode=off", str(root), str(out),
           "-d", str(out / ".doctrees")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    return out


def out_of_step(pot_dir: Path, lang_dir: Path) -> list[Problem]:
    """Messages of the sources that a catalog lacks, and catalog messages no source has.

    Args:
        pot_dir: templates just extracted (:func:`extract`).
        lang_dir: the edition's ``LC_MESSAGES`` folder.

    Returns:
        One problem per message: new or changed English without a translation (the
        catalog still translates the old sentence), or a translation of a sentence the
        sources no longer have. ``make po`` brings the catalogs in step.
    """
    import polib

    found = []
    pots = {p.relative_to(pot_dir).with_suffix(""): p for p in pot_dir.rglob("*.pot")
            if ".doctrees" not in p.parts}
    pos = {p.relative_to(lang_dir).with_suffix(""): p for p in lang_dir.rglob("*.po")}
    for page in sorted(set(pots) | set(pos)):
        po_path = lang_dir / f"{page}.po"
        rel = (str(po_path.relative_to(ROOT)) if po_path.is_relative_to(ROOT)
               else str(po_path))
        want = ({e.msgid for e in polib.pofile(str(pots[page]))} if page in pots
                else set())
        have = ({e.msgid for e in polib.pofile(str(pos[page])) if not e.obsolete}
                if page in pos else set())
        want.discard("")
        have.discard("")
        if page not in pos:
            found.append(Problem(rel, "", "no catalog for this page: run make po"))
            continue
        for msgid in sorted(want - have):
            found.append(Problem(rel, msgid, "the English is new or changed and the "
                                 "catalog has no entry for it (run make po, then "
                                 "translate)"))
        for msgid in sorted(have - want):
            found.append(Problem(rel, msgid, "no page has this English any more (run "
                                 "make po: the entry becomes obsolete or fuzzy)"))
    return found


def _flexible(msgid: str) -> re.Pattern[str]:
    """``msgid`` as it may stand in a cell: Sphinx joined its lines with spaces."""
    return re.compile(r"\s+".join(re.escape(w) for w in msgid.split()))


def translate_notebook(nb: dict, po_path: Path) -> tuple[dict, list[str]]:
    """``nb`` with each markdown cell's messages replaced by their translations.

    A message's ``#:`` comment names the cell it came from (myst-nb numbers a
    notebook's lines ``10000 * (cell + 1) + line``); the message's text is found in
    that cell, its lines joined as Sphinx joined them, and replaced. Structure
    (headings' ``#``, list markers, table pipes, directive fences) stays as it was,
    and code is untouched; a code cell's message is its figure's alt text.

    Args:
        nb: a notebook as JSON (changed in place).
        po_path: the page's catalog.

    Returns:
        The notebook, and the messages left in English: untranslated or fuzzy, or
        not found in their cell (none for a complete catalog in step with the
        notebook).
    """
    import polib

    cells = nb.get("cells", [])
    by_cell: dict[int, list[polib.POEntry]] = {}
    missed = []
    for e in polib.pofile(str(po_path)):
        if e.obsolete or not e.msgid:
            continue
        if not e.msgstr or "fuzzy" in e.flags:
            missed.append(e.msgid)
            continue
        for _file, line in e.occurrences:
            if line and line.isdigit():
                by_cell.setdefault(int(line) // 10000 - 1, []).append(e)
    for at, entries in sorted(by_cell.items()):
        if 0 <= at < len(cells) and cells[at].get("cell_type") == "code":
            # a figure's alt text, in the code cell's metadata (mystnb.image.alt)
            image = cells[at].get("metadata", {}).get("mystnb", {}).get("image", {})
            for e in entries:
                if isinstance(image, dict) and image.get("alt", "").strip() == e.msgid:
                    image["alt"] = e.msgstr
                else:
                    missed.append(e.msgid)
            continue
        if not 0 <= at < len(cells) or cells[at].get("cell_type") != "markdown":
            missed += [e.msgid for e in entries]
            continue
        text = "".join(cells[at]["source"]) if isinstance(cells[at]["source"], list) \
            else cells[at]["source"]
        # longest first, each replaced by a marker until all are placed: a short
        # message (a table cell) never matches inside a longer one or a translation
        done: list[str] = []
        for e in sorted(entries, key=lambda e: -len(e.msgid)):
            marker = f"\x00{len(done)}\x00"
            text, n = _flexible(e.msgid).subn(lambda _: marker, text, count=1)
            if n:
                done.append(e.msgstr)
            else:
                missed.append(e.msgid)
        cells[at]["source"] = re.sub("\x00(\\d+)\x00", lambda m: done[int(m[1])],
                                     text)
    return nb, missed


def compile_mo(po_path: Path, mo_path: Path) -> Path:
    """Write the ``.mo`` gettext reads from dtlib's catalog.

    ``pybabel compile`` is not used: it takes any ``%`` followed by a space and a
    letter for a %-placeholder ("20 % of the device" has "% o") and refuses the
    translation, though dtlib's messages are ``str.format`` ones.
    """
    import polib

    mo_path.parent.mkdir(parents=True, exist_ok=True)
    polib.pofile(str(po_path)).save_as_mofile(str(mo_path))
    return mo_path


def main(argv: list[str] | None = None) -> int:
    """``check [PO...]``: print each problem; exit status 1 when there is one.
    ``compile PO MO``: see :func:`compile_mo`."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) == 3 and args[0] == "compile":
        compile_mo(Path(args[1]), Path(args[2]))
        return 0
    if not args or args[0] != "check":
        print("usage: python -m dtlib.exercises.catalogs check [PO...] | compile PO MO",
              file=sys.stderr)
        return 2
    paths = [Path(p).resolve() for p in args[1:]] or None
    found = problems(paths)
    for p in found:
        print(p)
    n = len(paths) if paths else len(catalog_files())
    print(f"{len(found)} problem(s) in {n} catalog(s)")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
