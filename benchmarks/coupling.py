"""How self-contained each parallelism axis is: the files outside its folder that reach it, and that name it.

Run: ``python benchmarks/coupling.py [--files] [ROOT]`` (ROOT: a checkout, default this one). Two counts per axis:

* **code coupling**: files outside the axis' folder whose code reaches it, an import of the folder at any depth
  (``from meshplan.<folder> …``, function-level included) or a read of its record (``state.<field>``,
  ``.<field> is (not) None``). The ordered lists (``axes.py``, ``solver/units.py``) and the record's owner
  (``state.py``) are expected; ``tests/test_axes.py`` pins each axis' set (it may only shrink).
* **named**: files outside the folder whose text names the axis (``context_parallel|context parallel|\\bcp\\b`` and
  the like): the plan layer, the mesh and the solver name every degree, so this count stays high by design.

Deterministic for a given checkout: run it on two checkouts to compare (issue 26: before/after).
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

__all__ = ["AXES", "coupled", "named", "main"]

#: folder, record field, naming regex
AXES = (("pipeline", "pipeline", r"pipeline|\bpp\b"),
        ("tensor_parallel", "tensor_parallel", r"tensor_parallel|tensor parallel|\btp\b"),
        ("context_parallel", "context_parallel", r"context_parallel|context parallel|\bcp\b"),
        ("expert_parallel", "expert_parallel", r"expert_parallel|expert parallel|\bep\b"),
        ("data_parallel", "data_parallel", r"data_parallel|DataParallel|data parallel"))


def _outside(pkg: Path, folder: str):
    for f in sorted(pkg.rglob("*.py")):
        rel = str(f.relative_to(pkg))
        if not rel.startswith(folder + "/"):
            yield rel, f.read_text()


def coupled(pkg: Path, folder: str, field: str) -> list[str]:
    """Files outside ``folder`` that import it or read its record ``field``."""
    imp = re.compile(rf"(from|import)\s+meshplan\.{folder}\b")
    rec = re.compile(rf"\bstate\.{field}\b|\.{field} is not None|\.{field} is None")
    return [rel for rel, text in _outside(pkg, folder) if imp.search(text) or rec.search(text)]


def named(pkg: Path, folder: str, pattern: str) -> list[str]:
    """Files outside ``folder`` whose text matches ``pattern``."""
    rx = re.compile(pattern)
    return [rel for rel, text in _outside(pkg, folder) if rx.search(text)]


def main(argv=None) -> dict[str, tuple[int, int]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("root", nargs="?", default=str(Path(__file__).resolve().parents[1]))
    ap.add_argument("--files", action="store_true", help="list the coupled files")
    args = ap.parse_args(argv)
    pkg = Path(args.root) / "meshplan"
    out = {}
    print("| axis folder | code coupling (files) | named in (files) |")
    print("|---|---|---|")
    for folder, field, pattern in AXES:
        c, n = coupled(pkg, folder, field), named(pkg, folder, pattern)
        out[folder] = (len(c), len(n))
        print(f"| {folder}/ | {len(c)} | {len(n)} |")
        if args.files:
            print(f"|   | {', '.join(c)} | |")
    return out


if __name__ == "__main__":
    main()
