"""Benchmarks: ``python -m dtlib.bench NAME [options] [--json PATH]``.

Each benchmark is a module ``dtlib.bench.NAME`` with ``add_arguments(parser)`` and
``run(args) -> list[dict]``. Results are ratios against torch or theory measured in the
same run, never absolute targets: machines differ, ratios travel.
"""

from __future__ import annotations

import json
from typing import Any, Iterable

BENCHMARKS = ("launch", "collectives", "ddp", "zero", "matmul", "gpu", "time",
              "checkpoint", "link")


def format_table(records: Iterable[dict[str, Any]]) -> str:
    """Render records (dicts with the same keys) as an aligned text table."""
    records = list(records)
    if not records:
        return "(no records)"
    keys = list(records[0])
    for rec in records[1:]:
        keys += [k for k in rec if k not in keys]

    def cell(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.4g}"
        return str(value)

    rows = [[cell(rec.get(k, "")) for k in keys] for rec in records]
    widths = [max(len(k), *(len(r[i]) for r in rows)) for i, k in enumerate(keys)]
    lines = ["  ".join(k.rjust(w) for k, w in zip(keys, widths)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)


def write_json(records: list[dict[str, Any]], path: str) -> None:
    """Write ``records`` as a JSON list to ``path``."""
    with open(path, "w") as f:
        json.dump(records, f, indent=2)
