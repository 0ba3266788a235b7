"""Prose numbers in the learner copies, computed by the learner's own run.

The book's prose quotes measured numbers with MyST-NB's glue roles
(``{glue:text}`name:.2f```), which only the book build fills in. In JupyterLab they
would show as raw placeholders, so the learner copies (:mod:`dtlib.exercises.strip`)
turn each into jupyterlab-myst's inline ``{eval}`` role,
``{eval}`__import__("dtlib").glued("name", ".2f", "run the cell above")```. Its value
comes from the learner's kernel: :func:`record_glue` (the first code cell of every
learner copy) makes every later ``glue(name, value)`` also remember ``value`` here, and
:func:`glued` formats it. A number is therefore shown only once the cell that computes
it has run in this session: never a stale number from somebody else's machine. Until
then it reads as a short note naming that cell ("[run the cell above]"); the copy
stores the same note as the role's saved result, so that is what a copy shows when
opened, before any cell has run. The expression imports what it calls, so it never
fails with a NameError, even in a kernel that has not run the set-up cell.

Taught in: README, "Working with the notebooks".
"""

from __future__ import annotations

from typing import Any

#: name -> value of every glue() call since :func:`record_glue`.
GLUED: dict[str, Any] = {}


class Shown:
    """Text that a notebook displays as itself (no quotes), as plain text only.

    No Markdown form: jupyterlab-myst renders an ``{eval}`` result's Markdown as a
    paragraph inside the sentence (a gap after the number, a taller line), its plain
    text inline, like a word.
    """

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


class ShownMarkdown(Shown):
    """Glued Markdown (a ``{glue:md}`` block: a table, a sentence with emphasis)."""

    def _repr_markdown_(self) -> str:
        return self.text


def record_glue() -> None:
    """Make ``myst_nb.glue`` also store each value in :data:`GLUED` (idempotent).

    Must run before the notebook's ``from myst_nb import glue``.
    """
    import myst_nb

    original = myst_nb.glue
    if getattr(original, "__dtlib_records__", False):
        return

    def glue(name: str, variable: Any, display: bool = True) -> None:
        GLUED[name] = variable
        return original(name, variable, display)

    glue.__dtlib_records__ = True  # type: ignore[attr-defined]
    myst_nb.glue = glue


def placeholder(where: str) -> Shown:
    """What a number reads as before the cell that computes it has run."""
    return Shown(f"[{where}]")


def glued(name: str, fmt: str = "", where: str = "run the cells above") -> Shown:
    """The value glued as ``name``, formatted with ``fmt`` (a format spec, e.g. ".2f").

    Args:
        where: which cell computes it, for the note shown until that cell has run.
    Returns:
        The text to show; :func:`placeholder` when the computing cell has not run yet.
    """
    from dtlib.runtime.i18n import glue_key, language

    name = next((k for k in (glue_key(name, language()), name) if k in GLUED), name)
    if name not in GLUED:
        return placeholder(where)
    value = GLUED[name]
    if hasattr(value, "_repr_markdown_") and not fmt:
        return ShownMarkdown(value._repr_markdown_())
    if hasattr(value, "data") and isinstance(getattr(value, "data"), str) and not fmt:
        return ShownMarkdown(value.data)  # an IPython Markdown object
    return Shown(format(value, fmt) if fmt else str(value))


def write_settings(folder: str, lang: str) -> str:
    """Write JupyterLab user settings that open it in ``lang`` (its language pack).

    ``make lab LANG=zh_CN`` points ``JUPYTERLAB_SETTINGS_DIR`` at ``folder``: the
    Chinese copies open in a Chinese JupyterLab and the English lab keeps its own
    settings.

    Returns:
        The settings file written.
    """
    import json
    import os

    path = os.path.join(folder, "@jupyterlab", "translation-extension",
                        "plugin.jupyterlab-settings")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"locale": lang}, f)
    return path


if __name__ == "__main__":
    import sys

    if len(sys.argv) != 4 or sys.argv[1] != "settings":
        sys.exit("usage: python -m dtlib.exercises.lab settings FOLDER LANG")
    print(write_settings(sys.argv[2], sys.argv[3]))
