"""``python -m dtlib.exercises strip notebooks -o exercises``: write learner
notebooks; ``python -m dtlib.exercises grade PATH...``: grade them headless."""

from __future__ import annotations

import argparse
import sys

from dtlib.exercises.grade import main as grade
from dtlib.exercises.strip import strip_tree


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dtlib.exercises")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("strip",
                       help="replace every solution by raise NotImplementedError")
    p.add_argument("src", help="folder of the book's notebooks")
    p.add_argument("-o", "--output", required=True, help="folder for learner notebooks")
    p.add_argument("--force", action="store_true",
                   help="overwrite learner copies edited since they were written")
    g = sub.add_parser("grade", help="execute notebooks headless and print one row "
                       "per exercise: correct / wrong / not attempted / error")
    g.add_argument("paths", nargs="+", metavar="PATH",
                   help="notebooks, or folders to search for them (one per student)")
    g.add_argument("--json", action="store_true", help="print the rows as JSON")
    g.add_argument("--cell-timeout", type=float, default=600.0, metavar="S",
                   help="seconds one cell may run (default 600)")
    args = parser.parse_args(argv)
    if args.command == "grade":
        if args.cell_timeout <= 0:
            parser.error(f"--cell-timeout={args.cell_timeout:g}: give a positive "
                         "number of seconds")
        try:
            sys.exit(grade(args.paths, args.json, args.cell_timeout))
        except ValueError as exc:
            parser.error(str(exc))
    report = strip_tree(args.src, args.output, force=args.force)
    kept = [name for name, w in report.items() if w.kept]
    for name, w in report.items():
        if not w.kept:
            print(f"{name}: {w.solutions} solution(s) removed")
    print(f"wrote {len(report) - len(kept)} notebook(s) to {args.output}")
    if kept:
        print(f"kept {len(kept)} notebook(s) you edited "
              "(your work is not overwritten): "
              + ", ".join(kept))
        print("to replace them with fresh copies, move them away or rerun with --force "
              "(make exercises FORCE=1)")


if __name__ == "__main__":
    main()
