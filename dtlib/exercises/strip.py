"""Write learner notebooks: every solution replaced by a stub.

The nbgrader convention: lines between ``### BEGIN SOLUTION`` and ``### END SOLUTION``
in a code cell are the solution. What replaces them depends on what they were:

- inside a function (indented): ``raise NotImplementedError``, so the function keeps
  its ``def`` line and docstring;
- a whole top-level function: its ``def`` line and docstring, then
  ``raise NotImplementedError``;
- top-level code computing values the rest of the cell uses: ``name = ...`` for each
  of them, so the cell runs and its checker says "not attempted yet";
- anything else: ``raise NotImplementedError``.

Outputs are dropped. Nothing a learner wrote is ever overwritten: the tool records a
hash of every file it writes (``.written.json`` in the output folder) and, on the next
run, keeps any learner copy whose content no longer matches that record (the learner
edited it) or that it never wrote; ``force=True`` (``--force``) overwrites them anyway.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from dtlib.exercises.lab import placeholder
from dtlib.runtime.i18n import LANGUAGES, _, speaking
from dtlib.exercises.references import Reference, cited, readable_citations, \
    references_cell
from dtlib.exercises.references import load as load_references

BEGIN = "### BEGIN SOLUTION"
END = "### END SOLUTION"
_HERE = "# YOUR CODE HERE"


def _assigned(tree: ast.Module) -> list[str]:
    """Names the top-level statements of ``tree`` assign, in order."""
    names: list[str] = []
    for stmt in ast.walk(tree):
        targets = []
        if isinstance(stmt, ast.Assign):
            targets = stmt.targets
        elif isinstance(stmt, (ast.AugAssign, ast.AnnAssign)):
            targets = [stmt.target]
        for t in targets:
            for n in ast.walk(t):
                if isinstance(n, ast.Name) and n.id not in names:
                    names.append(n.id)
    return names


def _stub(solution: list[str], indent: str, after: str) -> str:
    """What replaces one solution (its lines, the BEGIN marker's indentation, and the
    cell's text after the END marker)."""
    fallback = f"{indent}{_HERE}\n{indent}raise NotImplementedError\n"
    if indent:
        return fallback
    text = "".join(solution)
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return fallback
    lines = text.splitlines(keepends=True)
    if len(tree.body) == 1 and isinstance(tree.body[0], ast.FunctionDef):
        fn = tree.body[0]
        first = fn.body[0]
        if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                and isinstance(first.value.value, str):
            keep = first.end_lineno  # the signature and the docstring
        else:  # the signature only: comments in the body may give the answer away
            keep = max([fn.lineno] + [n.end_lineno for n in ast.walk(fn.args)
                                      if hasattr(n, "end_lineno")]
                       + ([fn.returns.end_lineno] if fn.returns else []))
            while keep < len(lines) and not lines[keep - 1].split("#")[0] \
                    .rstrip().endswith(":"):
                keep += 1
        body_indent = re.match(r"\s*", lines[first.lineno - 1]).group(0)
        return ("".join(lines[fn.lineno - 1 - len(fn.decorator_list):keep])
                + f"{body_indent}{_HERE}\n{body_indent}raise NotImplementedError\n")
    if any(isinstance(s, (ast.FunctionDef, ast.ClassDef)) for s in tree.body):
        return fallback
    used = [n for n in _assigned(tree) if re.search(rf"\b{re.escape(n)}\b", after)]
    if not used:
        return fallback
    return f"{_HERE}: replace each ... by your answer\n" + "".join(
        f"{n} = ...\n" for n in used)


def strip_source(source: str) -> str:
    """Return ``source`` with each marked solution replaced by a stub (module
    docstring).

    Raises:
        ValueError: a BEGIN without END, an END without BEGIN, or nested markers.
    """
    out: list[str] = []
    lines = source.splitlines(keepends=True)
    inside = False
    solution: list[str] = []
    indent = ""
    for number, line in enumerate(lines, start=1):
        mark = line.strip()
        if mark == BEGIN:
            if inside:
                raise ValueError(f"line {number}: nested '{BEGIN}'")
            inside, solution = True, []
            indent = line[: len(line) - len(line.lstrip())]
        elif mark == END:
            if not inside:
                raise ValueError(f"line {number}: '{END}' without '{BEGIN}'")
            inside = False
            out.append(_stub(solution, indent, "".join(lines[number:])))
        elif inside:
            solution.append(line)
        else:
            out.append(line)
    if inside:
        raise ValueError(f"'{BEGIN}' without '{END}'")
    return "".join(out)


_GLUE_TEXT = re.compile(r"\{glue:text\}`([^`:]+)(?::([^`]*))?`")
_GLUE_MD = re.compile(r"```\{glue:md\}\s*(\S+)\n(?::[^\n]*\n)*```")
# A solution fence anywhere in a cell (alone, or before the next exercise's text).
_SOLUTION_FENCE = re.compile(r"```\{solution-(?:start|end)\}[^\n]*\n(?::[^\n]*\n)*```"
                             r"[ \t]*(?:\n|$)")
#: The first code cell of a learner copy whose prose quotes glued numbers.
GLUE_SETUP = (
    "# Learner copy: the numbers in the prose come from your own run. JupyterLab with\n"
    "# jupyterlab-myst shows each once the cell that computes it has run (make lab).\n"
    "from dtlib.exercises.lab import record_glue\n\n"
    "record_glue()"
)


def setup_source(glue_used: bool, lang: str) -> str:
    """The set-up cell of a learner copy: the glued numbers' recorder, and in a copy
    in another language than English the language of the checkers' feedback."""
    parts = []
    if glue_used:
        code = GLUE_SETUP[GLUE_SETUP.index("from dtlib"):]
        parts.append(_("# Learner copy: the numbers in the prose come from your own "
                       "run. JupyterLab with\n# jupyterlab-myst shows each once the "
                       "cell that computes it has run (make lab).") + "\n" + code)
    if lang != "en":
        parts.append(_("# The checkers answer in the language of this copy.") + "\n"
                     "from dtlib.runtime.i18n import use\n\n"
                     f"use({lang!r})")
    return "\n\n".join(parts)


def glue_expression(name: str, fmt: str, where: str) -> str:
    """The ``{eval}`` expression a learner copy's prose shows a glued number with: it
    imports what it calls (a kernel that has not run the set-up cell evaluates it
    too) and names, for its note until then, the cell that computes the number."""
    args = ", ".join(json.dumps(a, ensure_ascii=False) for a in (name, fmt, where))
    return f'__import__("dtlib").glued({args})'


_GLUE_CALL = re.compile(r"""\bglue\(\s*(f?)["']([^"'{]*)""")
_HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)


def _source(cell: dict) -> str:
    src = cell.get("source", "")
    return src if isinstance(src, str) else "".join(src)


def _heading(cells: list[dict], before: int) -> str | None:
    """The last Markdown heading in ``cells[:before]``, as plain text."""
    for cell in reversed(cells[:before]):
        if cell.get("cell_type") == "markdown":
            found = _HEADING.findall(_source(cell))
            if found:
                # Plain text: no code ticks, emphasis, roles, link targets or math.
                text = re.sub(r"[`*_$]|\\[a-z]+|\{[^}]*\}|\[|\]\([^)]*\)", "",
                              found[-1])
                text = re.sub(r"\s+", " ", text).strip()
                return text if len(text) <= 48 else text[:47].rstrip() + "…"
    return None


def where_computed(cells: list[dict], name: str, at: int) -> str:
    """Which cell computes glued ``name``, as seen from cell ``at``: "run the cell
    above", "run the cell below" (same section) or 'run “Heading”'.

    A cell computes it if it calls ``glue("name", ...)``, or
    ``glue(f"prefix{...}", ...)`` with the longest prefix of ``name`` (a loop's values).
    """
    best, best_len = None, -1
    for i, cell in enumerate(cells):
        if cell.get("cell_type") != "code":
            continue
        for m in _GLUE_CALL.finditer(_source(cell)):
            f, text = m[1], m[2]
            exact = not f and text == name
            if exact or (f and name.startswith(text) and len(text) > best_len):
                best, best_len = i, (len(name) + 1 if exact else len(text))
    if best is None:
        return _("run the cells above")
    lo, hi = sorted((best, at))
    between = any(c.get("cell_type") == "markdown" and _HEADING.search(_source(c))
                  for c in cells[lo + 1:hi + 1])
    if not between:
        return _("run the cell above") if best < at else _("run the cell below")
    heading = _heading(cells, best + 1)
    return (_("run “{heading}”").format(heading=heading) if heading
            else _("run the cells above"))


def readable_markdown(text: str, where: Callable[[str], str] | None = None
                      ) -> tuple[str, list[str]]:
    """Markdown for JupyterLab: each glue role becomes an ``{eval}`` of
    :func:`dtlib.glued` (see :mod:`dtlib.exercises.lab`), whose value the learner's
    own run supplies.

    Args:
        where: glued name -> the note shown until its cell has run (default "run the
            cells above").
    Returns:
        The new text, and the ``(expression, note)`` of each ``{eval}`` role in it.
    """
    found: list[tuple[str, str]] = []

    def role(name: str, fmt: str) -> str:
        note = where(name) if where else _("run the cells above")
        expr = glue_expression(name, fmt, note)
        found.append((expr, note))
        return "{eval}`%s`" % expr

    text = _GLUE_TEXT.sub(lambda m: role(m[1], m[2] or ""), text)
    return _GLUE_MD.sub(lambda m: role(m[1], ""), text), found


def saved_results(found: list[tuple[str, str]]) -> list[dict]:
    """jupyterlab-myst's saved results of a cell's ``{eval}`` roles (its
    ``user_expressions`` metadata), which a copy shows before any cell has run: each
    role's note, as the kernel would give it."""
    return [{"expression": expr,
             "result": {"status": "ok", "metadata": {},
                        "data": {"text/plain": repr(placeholder(note))}}}
            for expr, note in found]


def strip_notebook(nb: dict, refs: dict[str, Reference] | None = None,
                   lang: str = "en") -> tuple[dict, int]:
    """Strip every code cell of ``nb`` (a notebook as JSON); return it and the count.

    Markdown becomes readable in JupyterLab (:func:`readable_markdown`; the book's
    solution fences, empty once the solution is gone, are dropped wherever they stand,
    and a cell left with nothing else goes too); citations are written out and linked
    to a References cell at the end (:mod:`dtlib.exercises.references`).

    Args:
        refs: the bibliography (:func:`dtlib.exercises.references.load`); needed when
            the notebook cites.
        lang: the copy's language (its prose already translated,
            :func:`dtlib.exercises.catalogs.translate_notebook`): the notes and the
            References heading the tool writes, and the feedback's language, which a
            set-up cell sets.
    Raises:
        ValueError: the notebook cites and ``refs`` is None, or cites a missing key.
    """
    count = 0
    glue_used = False
    cells = []
    source_cells = list(nb.get("cells", []))
    keys: list[str] = []
    for at, cell in enumerate(source_cells):
        src = _source(cell)
        if cell.get("cell_type") == "markdown":
            if _SOLUTION_FENCE.search(src):
                src = _SOLUTION_FENCE.sub("", src).strip("\n")
                if not src.strip():
                    continue
            new, found = readable_markdown(
                src, lambda name: where_computed(source_cells, name, at))
            glue_used |= bool(found)
            if cited(new):
                if refs is None:
                    raise ValueError(f"cell {at} cites {cited(new)[0]!r}: give refs "
                                     "(the book's bibliography) to write it out")
                keys += [k for k in cited(new) if k not in keys]
                new = readable_citations(new, refs)
            cell["source"] = new
            metadata = cell.setdefault("metadata", {})
            if found:
                metadata["user_expressions"] = saved_results(found)
            else:
                metadata.pop("user_expressions", None)
        cells.append(cell)
    if keys:
        cells.append({"cell_type": "markdown", "metadata": {},
                      "source": references_cell(keys, refs)})
        if any("id" in c for c in cells[:-1]):
            cells[-1]["id"] = "learner-references"
    nb["cells"] = cells
    if glue_used or lang != "en":
        setup = {"cell_type": "code", "execution_count": None, "metadata": {},
                 "outputs": [], "source": setup_source(glue_used, lang)}
        if any("id" in c for c in cells):
            setup["id"] = "learner-glue-setup"
        first_code = next((i for i, c in enumerate(cells)
                           if c.get("cell_type") == "code"), len(cells))
        cells.insert(first_code, setup)
    for cell in nb.get("cells", []):
        if cell.get("cell_type") != "code":
            continue
        src = _source(cell)
        if BEGIN in src:
            count += src.count(BEGIN)
            cell["source"] = strip_source(src)
        cell["outputs"] = []
        cell["execution_count"] = None
    return nb, count


#: The record of what the tool wrote, in the output folder: file name -> sha256.
RECORD = ".written.json"


@dataclass(frozen=True)
class Written:
    """What :func:`strip_tree` did with one notebook."""

    solutions: int  # solutions removed
    kept: bool  # True: the learner's copy differs from what was written; left alone
    untranslated: int = 0  # messages of a translated copy left in English


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def book_bibliography(src: str | os.PathLike) -> list[Path]:
    """The bibliography files of the book whose notebooks are in ``src``: the
    ``bibtex_bibfiles`` of the ``_config.yml`` in ``src`` or the folder above it
    (none found: an empty list)."""
    import yaml  # the book's stack (Jupyter Book) has it

    for folder in (Path(src), Path(src).resolve().parent):
        config = folder / "_config.yml"
        if config.is_file():
            settings = yaml.safe_load(config.read_text()) or {}
            return [folder / f for f in settings.get("bibtex_bibfiles", [])]
    return []


def strip_tree(src: str | os.PathLike, dst: str | os.PathLike,
               force: bool = False,
               bibfiles: list[str | os.PathLike] | None = None,
               lang: str = "en") -> dict[str, Written]:
    """Strip every notebook in ``src`` into ``dst`` without losing a learner's work.

    Args:
        src: folder of the book's notebooks (with solutions).
        dst: folder of the learner copies.
        force: overwrite learner copies that were edited since they were written.
        bibfiles: BibTeX files for the citations (default: the book's, found by
            :func:`book_bibliography`).
        lang: ``en``, or ``zh_CN`` for copies whose markdown is the Chinese edition's
            catalogs (``locale/zh_CN/LC_MESSAGES/notebooks/<name>.po`` beside ``src``)
            and whose checkers answer in Chinese; the code is the same.
    Returns:
        file name -> :class:`Written` (solutions removed, whether the file was
        kept, and how many messages a translated copy left in English).
    Raises:
        ValueError: ``src`` is not a directory, ``lang`` is not a language the book
            has, or a notebook has no catalog in it.
    """
    src, dst = Path(src), Path(dst)
    if not src.is_dir():
        raise ValueError(f"src={str(src)!r} is not a directory of notebooks")
    if lang not in LANGUAGES:
        raise ValueError(f"lang={lang!r}: the learner copies exist in "
                         f"{', '.join(LANGUAGES)}")
    with speaking(lang):
        return _strip_tree(src, dst, force, bibfiles, lang)


def _strip_tree(src: Path, dst: Path, force: bool,
                bibfiles: list[str | os.PathLike] | None,
                lang: str) -> dict[str, Written]:
    from dtlib.exercises.catalogs import translate_notebook

    catalogs = src.resolve().parent / "locale" / lang / "LC_MESSAGES" / src.name
    dst.mkdir(parents=True, exist_ok=True)
    try:
        record = json.loads((dst / RECORD).read_text())
    except (OSError, ValueError):
        record = {}
    report = {}
    files = book_bibliography(src) if bibfiles is None else bibfiles
    refs = load_references(files) if files else None
    for path in sorted(src.glob("*.ipynb")):
        with open(path) as f:
            nb = json.load(f)
        missed: list[str] = []
        if lang != "en":
            po = catalogs / f"{path.stem}.po"
            if not po.is_file():
                raise ValueError(f"{path.name}: no {lang} catalog at {po} (make po "
                                 "writes it)")
            nb, missed = translate_notebook(nb, po)
            nb.setdefault("metadata", {})["dtlib"] = {"language": lang}
        try:
            nb, n = strip_notebook(nb, refs, lang)
        except ValueError as exc:
            raise ValueError(f"{path.name}: {exc}") from None
        data = (json.dumps(nb, indent=1, ensure_ascii=False) + "\n").encode()
        target = dst / path.name
        if target.exists() and not force:
            current = _sha256(target.read_bytes())
            # Ours and untouched (or already identical): safe to replace.
            if current not in (record.get(path.name), _sha256(data)):
                report[path.name] = Written(n, kept=True, untranslated=len(missed))
                continue
        target.write_bytes(data)
        record[path.name] = _sha256(data)
        report[path.name] = Written(n, kept=False, untranslated=len(missed))
    (dst / RECORD).write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    return report
