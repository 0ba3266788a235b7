"""Write learner notebooks: every solution replaced by ``raise NotImplementedError``.

The nbgrader convention: lines between ``### BEGIN SOLUTION`` and ``### END SOLUTION`` in a
code cell are the solution. They are replaced by one ``raise NotImplementedError`` at the
indentation of the BEGIN marker; outputs are dropped.

Nothing a learner wrote is ever overwritten: the tool records a hash of every file it
writes (``.written.json`` in the output folder) and, on the next run, keeps any learner
copy whose content no longer matches that record (the learner edited it) or that it
never wrote; ``force=True`` (``--force``) overwrites them anyway.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

BEGIN = "### BEGIN SOLUTION"
END = "### END SOLUTION"


def strip_source(source: str) -> str:
    """Return ``source`` with each marked solution replaced by ``raise NotImplementedError``.

    Raises:
        ValueError: a BEGIN without END, an END without BEGIN, or nested markers.
    """
    out: list[str] = []
    inside = False
    for number, line in enumerate(source.splitlines(keepends=True), start=1):
        mark = line.strip()
        if mark == BEGIN:
            if inside:
                raise ValueError(f"line {number}: nested '{BEGIN}'")
            inside = True
            indent = line[: len(line) - len(line.lstrip())]
            out.append(f"{indent}# YOUR CODE HERE\n{indent}raise NotImplementedError\n")
        elif mark == END:
            if not inside:
                raise ValueError(f"line {number}: '{END}' without '{BEGIN}'")
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise ValueError(f"'{BEGIN}' without '{END}'")
    return "".join(out)


def strip_notebook(nb: dict) -> tuple[dict, int]:
    """Strip every code cell of ``nb`` (a notebook as JSON); return it and the count."""
    count = 0
    for cell in nb.get("cells", []):
        if cell.get("cell_type") != "code":
            continue
        src = cell["source"] if isinstance(cell["source"], str) else "".join(cell["source"])
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


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def strip_tree(src: str | os.PathLike, dst: str | os.PathLike,
               force: bool = False) -> dict[str, Written]:
    """Strip every notebook in ``src`` into ``dst`` without losing a learner's work.

    Args:
        src: folder of the book's notebooks (with solutions).
        dst: folder of the learner copies.
        force: overwrite learner copies that were edited since they were written.
    Returns:
        file name -> :class:`Written` (solutions removed, and whether the file was kept).
    Raises:
        ValueError: ``src`` is not a directory.
    """
    src, dst = Path(src), Path(dst)
    if not src.is_dir():
        raise ValueError(f"src={str(src)!r} is not a directory of notebooks")
    dst.mkdir(parents=True, exist_ok=True)
    try:
        record = json.loads((dst / RECORD).read_text())
    except (OSError, ValueError):
        record = {}
    report = {}
    for path in sorted(src.glob("*.ipynb")):
        with open(path) as f:
            nb, n = strip_notebook(json.load(f))
        data = (json.dumps(nb, indent=1, ensure_ascii=False) + "\n").encode()
        target = dst / path.name
        if target.exists() and not force:
            current = _sha256(target.read_bytes())
            # Ours and untouched (or already identical): safe to replace.
            if current not in (record.get(path.name), _sha256(data)):
                report[path.name] = Written(n, kept=True)
                continue
        target.write_bytes(data)
        record[path.name] = _sha256(data)
        report[path.name] = Written(n, kept=False)
    (dst / RECORD).write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    return report
