"""``python -m kvbaton.backend.models --docs [docs/models.md]``: print the families table, or write it into the
given file between its markers (tests/test_model_families.py checks the committed table is current)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import docs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvbaton.backend.models", description=__doc__)
    parser.add_argument("--docs", nargs="?", const="-", metavar="FILE",
                        help="print the table (no FILE) or write it into FILE between its markers")
    args = parser.parse_args(argv)
    if args.docs is None:
        parser.print_help()
        return 2
    if args.docs == "-":
        print(docs.table())
        return 0
    changed = docs.write(Path(args.docs))
    print(f"{args.docs}: {'updated' if changed else 'already current'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
