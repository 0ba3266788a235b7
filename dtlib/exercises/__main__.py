"""``python -m dtlib.exercises strip notebooks -o exercises``: write learner notebooks."""

from __future__ import annotations

import argparse

from dtlib.exercises.strip import strip_tree


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dtlib.exercises")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("strip", help="replace every solution by raise NotImplementedError")
    p.add_argument("src", help="folder of the book's notebooks")
    p.add_argument("-o", "--output", required=True, help="folder for learner notebooks")
    args = parser.parse_args(argv)
    report = strip_tree(args.src, args.output)
    for name, n in report.items():
        print(f"{name}: {n} solution(s) removed")
    print(f"wrote {len(report)} notebook(s) to {args.output}")


if __name__ == "__main__":
    main()
