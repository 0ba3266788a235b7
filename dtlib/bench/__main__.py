"""``python -m dtlib.bench NAME``: run one benchmark, print its table, write JSON."""

from __future__ import annotations

import argparse
import importlib
import sys

from dtlib.bench import BENCHMARKS, format_table, write_json


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dtlib.bench",
                                     description="dtlib benchmarks (ratios, same run)")
    sub = parser.add_subparsers(dest="name", required=True)
    modules = {}
    for name in BENCHMARKS:
        try:
            module = importlib.import_module(f"dtlib.bench.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"dtlib.bench.{name}":
                raise
            continue  # a chapter whose benchmark is not written yet
        modules[name] = module
        p = sub.add_parser(name, help=(module.__doc__ or "").strip().splitlines()[0])
        module.add_arguments(p)
        p.add_argument("--json", metavar="PATH", help="also write the records as JSON")
    args = parser.parse_args(argv)
    module = modules[args.name]
    records = module.run(args)
    if not getattr(module, "PRINTS_LINES", False):  # the GPU suite prints its own
        print(format_table(records))
    if args.json:
        write_json(records, args.json)
        print(f"wrote {len(records)} records to {args.json}")
    return getattr(module, "exit_status", lambda _: 0)(records)


if __name__ == "__main__":
    sys.exit(main())
