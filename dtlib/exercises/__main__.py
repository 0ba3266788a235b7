"""``python -m dtlib.exercises strip notebooks -o exercises``: write learner
notebooks; ``python -m dtlib.exercises grade PATH...``: grade them headless;
``python -m dtlib.exercises mutants [--chapter N]``: mutation-test the checkers."""

from __future__ import annotations

import argparse
import sys

from dtlib.exercises.grade import main as grade
from dtlib.exercises.mutants import main as mutants
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
    p.add_argument("--lang", default="en", metavar="LANG",
                   help="en (default) or zh_CN: the prose from the Chinese catalogs "
                   "(locale/zh_CN) and the checkers' feedback in Chinese")
    g = sub.add_parser("grade", help="execute notebooks headless and print one row "
                       "per exercise: correct / wrong / not attempted / error")
    g.add_argument("paths", nargs="+", metavar="PATH",
                   help="notebooks, or folders to search for them (one per student)")
    g.add_argument("--json", action="store_true", help="print the rows as JSON")
    g.add_argument("--cell-timeout", type=float, default=600.0, metavar="S",
                   help="seconds one cell may run (default 600)")
    m = sub.add_parser("mutants", help="run mutants of every exercise's solution "
                       "through its checker; print mutants, killed, equivalent and "
                       "survivors per exercise")
    m.add_argument("--chapter", type=int, metavar="N", help="only chapter N")
    m.add_argument("--exercise", metavar="LABEL",
                   help="only this exercise (its label, such as ch2-ex-allgather)")
    m.add_argument("--limit", type=int, metavar="K",
                   help="a fixed sample of K mutants per exercise (default: all)")
    m.add_argument("--timeout", type=float, default=60.0, metavar="S",
                   help="seconds one mutant may run before it counts as a hang "
                   "(default 60)")
    m.add_argument("--notebooks", default="notebooks", metavar="DIR",
                   help="folder of the book's notebooks (default notebooks)")
    m.add_argument("--json", action="store_true", help="print the table as JSON")
    args = parser.parse_args(argv)
    if args.command == "mutants":
        if args.limit is not None and args.limit < 1:
            parser.error(f"--limit={args.limit}: give a positive number of mutants")
        if args.timeout <= 0:
            parser.error(f"--timeout={args.timeout:g}: give a positive number of "
                         "seconds")
        try:
            sys.exit(mutants(args.chapter, args.notebooks, args.exercise, args.limit,
                             args.json, args.timeout))
        except ValueError as exc:
            parser.error(str(exc))
    if args.command == "grade":
        if args.cell_timeout <= 0:
            parser.error(f"--cell-timeout={args.cell_timeout:g}: give a positive "
                         "number of seconds")
        try:
            sys.exit(grade(args.paths, args.json, args.cell_timeout))
        except ValueError as exc:
            parser.error(str(exc))
    try:
        report = strip_tree(args.src, args.output, force=args.force, lang=args.lang)
    except ValueError as exc:
        parser.error(str(exc))
    kept = [name for name, w in report.items() if w.kept]
    for name, w in report.items():
        if not w.kept:
            print(f"{name}: {w.solutions} solution(s) removed")
    print(f"wrote {len(report) - len(kept)} notebook(s) to {args.output}")
    english = {name: w.untranslated for name, w in report.items() if w.untranslated}
    if english:
        print(f"{sum(english.values())} message(s) left in English, the catalogs being "
              "incomplete or out of step (make po; make test names them): "
              + ", ".join(f"{k} ({v})" for k, v in english.items()))
    if kept:
        print(f"kept {len(kept)} notebook(s) you edited "
              "(your work is not overwritten): "
              + ", ".join(kept))
        print("to replace them with fresh copies, move them away or rerun with --force "
              "(make exercises FORCE=1)")


if __name__ == "__main__":
    main()
