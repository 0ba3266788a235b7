"""Citations in the learner copies, in a form jupyterlab-myst resolves.

The book cites with sphinxcontrib-bibtex's roles (``{cite:p}`key```), which only the
book build resolves: jupyterlab-myst has no bibliography and draws each as a warning
icon and the raw key ("Citation Not Found"). The learner copies therefore write each
citation as the book shows it, author and year, linked to an entry of a References
cell at the end of the notebook (a MyST target, so the link stays inside the
notebook), and that entry links to the paper (its DOI, arXiv page or URL).

Taught in: README, "Working with the notebooks".
"""

from __future__ import annotations

import codecs
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from dtlib.runtime.i18n import _

#: ``{cite}`a,b```, ``{cite:p}`a```, ``{cite:t}`a```: sphinxcontrib-bibtex's roles.
CITE = re.compile(r"\{cite(?::(p|t))?\}`([^`]+)`")


@dataclass(frozen=True)
class Reference:
    """One bibliography entry, as the learner copies show it."""

    key: str
    authors: str  # "Rajbhandari et al." (the in-text form)
    year: str
    text: str  # the whole entry, Markdown
    link: str  # where the paper is ("" when the entry gives nowhere)

    @property
    def target(self) -> str:
        """The MyST label of this entry in the References cell."""
        return f"ref-{self.key}"


def _plain(latex: str) -> str:
    """A BibTeX field as plain text: accents decoded, braces and \\url dropped."""
    import latexcodec  # noqa: F401  (registers the "ulatex" codec; pybtex needs it)

    text = codecs.decode(re.sub(r"\\url\s*\{([^}]*)\}", r"\1", latex), "ulatex")
    return re.sub(r"\s+", " ", text.replace("{", "").replace("}", "")).strip()


def _link(fields: dict[str, str]) -> str:
    if fields.get("doi"):
        return "https://doi.org/" + fields["doi"]
    for name in ("url", "howpublished"):
        m = re.search(r"https?://\S+", fields.get(name, ""))
        if m:
            return m.group(0).rstrip("}")
    m = re.search(r"arXiv:(\d{4}\.\d{4,5})", fields.get("journal", ""))
    return f"https://arxiv.org/abs/{m.group(1)}" if m else ""


def load(bibfiles: Iterable[str | Path]) -> dict[str, Reference]:
    """Every entry of ``bibfiles``, by key (needs pybtex, which the book's stack has).

    In-text names follow the book's author-year style: "A", "A and B", "A et al.";
    entries that would read the same (NVIDIA, 2023) get the letters a, b, ... in the
    order of the files.
    """
    from pybtex.database import parse_file

    entries = []
    for path in bibfiles:
        for key, entry in parse_file(str(path)).entries.items():
            fields = {k.lower(): str(v) for k, v in entry.fields.items()}
            people = entry.persons.get("author", [])
            last = [_plain(" ".join(p.prelast_names + p.last_names)) for p in people]
            full = [_plain(" ".join(p.first_names + p.middle_names + p.prelast_names
                                    + p.last_names)) for p in people]
            if len(last) > 2:
                short = f"{last[0]} et al."
            else:
                short = " and ".join(last) or _plain(fields.get("title", key))
            entries.append((key, short, fields, ", ".join(full)))
    seen: dict[tuple[str, str], int] = {}
    for _key, short, fields, _names in entries:
        seen[short, fields.get("year", "")] = seen.get((short, fields.get("year", "")),
                                                       0) + 1
    letters: dict[tuple[str, str], int] = {}
    refs = {}
    for key, short, fields, names in entries:
        year = fields.get("year", "n.d.")
        if seen[short, fields.get("year", "")] > 1:
            n = letters.get((short, year), 0)
            letters[short, year] = n + 1
            year += "abcdefghijklmnopqrstuvwxyz"[n]
        venue = fields.get("booktitle") or fields.get("journal") or ""
        link = _link(fields)
        text = f"{names} ({year}). {_plain(fields.get('title', key))}."
        if venue:
            text += f" *{_plain(venue)}*."
        if link:
            text += f" <{link}>"
        refs[key] = Reference(key, short, year, text, link)
    return refs


def cited(text: str) -> list[str]:
    """The keys ``text`` cites, in order, each once."""
    keys: list[str] = []
    for m in CITE.finditer(text):
        keys += [k.strip() for k in m[2].split(",") if k.strip() not in keys]
    return keys


def readable_citations(text: str, refs: dict[str, Reference]) -> str:
    """``text`` with each citation role written out: ``{cite:p}`` as "(A et al., 2020;
    B, 2021)", ``{cite:t}`` as "A et al. (2020)", each name linked to its entry.

    Raises:
        ValueError: a cited key that no bibliography file has.
    """
    def one(m: re.Match) -> str:
        keys = [k.strip() for k in m[2].split(",") if k.strip()]
        for k in keys:
            if k not in refs:
                raise ValueError(f"{{cite}}`{k}`: no entry {k!r} in the bibliography "
                                 f"(it has {len(refs)} entries)")
        if m[1] == "t":
            return "; ".join(f"[{refs[k].authors} ({refs[k].year})](#{refs[k].target})"
                             for k in keys)
        return "(" + "; ".join(f"[{refs[k].authors}, {refs[k].year}](#{refs[k].target})"
                               for k in keys) + ")"

    return CITE.sub(one, text)


def references_cell(keys: Iterable[str], refs: dict[str, Reference]) -> str:
    """The Markdown of a learner copy's last cell: each cited entry under its target."""
    entries = sorted((refs[k] for k in keys), key=lambda r: (r.authors, r.year))
    body = "\n\n".join(f"({r.target})=\n{r.text}" for r in entries)
    return "## " + _("References") + "\n\n" + body
