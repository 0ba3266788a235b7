"""Write learner notebooks: every solution replaced by ``raise NotImplementedError``.

The nbgrader convention: lines between ``### BEGIN SOLUTION`` and ``### END SOLUTION`` in a
code cell are the solution. They are replaced by one ``raise NotImplementedError`` at the
indentation of the BEGIN marker; outputs are dropped.
"""

from __future__ import annotations

import json
import os
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


def strip_tree(src: str | os.PathLike, dst: str | os.PathLike) -> dict[str, int]:
    """Strip every notebook in ``src`` into ``dst``; return solutions removed per file."""
    src, dst = Path(src), Path(dst)
    if not src.is_dir():
        raise ValueError(f"src={str(src)!r} is not a directory of notebooks")
    dst.mkdir(parents=True, exist_ok=True)
    report = {}
    for path in sorted(src.glob("*.ipynb")):
        with open(path) as f:
            nb, n = strip_notebook(json.load(f))
        with open(dst / path.name, "w") as f:
            json.dump(nb, f, indent=1, ensure_ascii=False)
            f.write("\n")
        report[path.name] = n
    return report
