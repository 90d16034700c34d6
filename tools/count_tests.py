"""Counts the suite's test functions and assertions by file, for the tree or a git revision, and compares two.

    python tools/count_tests.py                    # this tree: one row per test file, and the totals
    python tools/count_tests.py --base REV         # REV beside this tree, with what each file gained or lost
    python tools/count_tests.py --base REV --json  # the same as one JSON object
    python tools/count_tests.py --base REV --areas # one row per area (a test file's folder) instead of per file

An assertion is an ``assert`` statement or a ``pytest.raises`` / ``pytest.warns`` block: what can fail in a test.
Merging tests keeps the assertions; the ``--base`` comparison shows a file (or, with ``--areas``, a folder of the
suite: ``tests/unit/checkpoint``, ``tests/integration``, ...) that lost some. A test merged into another file of
the same area keeps its area's count.
"""

from __future__ import annotations

import argparse
import ast
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def count(source: str) -> tuple[int, int]:
    """(test functions, assertions) in one file's source."""
    tree = ast.parse(source)
    tests = sum(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name.startswith("test_")
                for n in ast.walk(tree))
    asserts = sum(isinstance(n, ast.Assert) for n in ast.walk(tree))
    asserts += sum(isinstance(n, ast.withitem) and isinstance(n.context_expr, ast.Call)
                   and isinstance(n.context_expr.func, ast.Attribute) and n.context_expr.func.attr in ("raises", "warns")
                   for n in ast.walk(tree))
    return tests, asserts


def tree_counts() -> dict[str, tuple[int, int]]:
    return {p.relative_to(REPO).as_posix(): count(p.read_text(encoding="utf-8"))
            for p in sorted((REPO / "tests").rglob("*.py"))}


def revision_counts(rev: str) -> dict[str, tuple[int, int]]:
    names = subprocess.run(["git", "ls-tree", "-r", "--name-only", rev, "tests"], cwd=REPO, check=True,
                           capture_output=True, text=True).stdout.split()
    out = {}
    for name in sorted(n for n in names if n.endswith(".py")):
        source = subprocess.run(["git", "show", f"{rev}:{name}"], cwd=REPO, check=True, capture_output=True,
                                text=True).stdout
        out[name] = count(source)
    return out


def by_area(counts: dict[str, tuple[int, int]]) -> dict[str, tuple[int, int]]:
    """The counts summed by area: each file's folder (``tests/unit/checkpoint/storage/x.py`` is in
    ``tests/unit/checkpoint/storage``)."""
    out: dict[str, tuple[int, int]] = {}
    for name, (tests, asserts) in counts.items():
        area = name.rsplit("/", 1)[0]
        had = out.get(area, (0, 0))
        out[area] = (had[0] + tests, had[1] + asserts)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", help="a git revision to compare with")
    parser.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    parser.add_argument("--areas", action="store_true", help="one row per area (a test file's folder)")
    args = parser.parse_args(argv)
    now = tree_counts()
    base = revision_counts(args.base) if args.base else {}
    if args.areas:
        now, base = by_area(now), by_area(base)
    files = sorted(set(now) | set(base))
    rows = {f: {"tests": now.get(f, (0, 0))[0], "asserts": now.get(f, (0, 0))[1],
                "base_tests": base.get(f, (0, 0))[0], "base_asserts": base.get(f, (0, 0))[1]} for f in files}
    total = {k: sum(r[k] for r in rows.values()) for k in ("tests", "asserts", "base_tests", "base_asserts")}
    if args.json:
        print(json.dumps({"files": rows, "total": total}, indent=1))
        return 0
    for f, r in rows.items():
        if r["tests"] or r["asserts"] or r["base_tests"] or r["base_asserts"]:
            delta = f"  ({r['tests'] - r['base_tests']:+d} tests, {r['asserts'] - r['base_asserts']:+d} asserts)" \
                if args.base else ""
            print(f"{r['tests']:5d} {r['asserts']:6d}  {f}{delta}")
    print(f"{total['tests']:5d} {total['asserts']:6d}  total" + (
        f" (base {args.base}: {total['base_tests']} tests, {total['base_asserts']} asserts)" if args.base else ""))
    lost = [f for f, r in rows.items() if r["asserts"] < r["base_asserts"]]
    if args.base and lost:
        print(f"{'areas' if args.areas else 'files'} with fewer assertions than the base: " + ", ".join(lost),
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
