"""Plan-file load times, normal and hostile files; prints a table (best of 5, milliseconds).

    python benchmarks/plan_load.py            # this checkout's meshplan
    PYTHONPATH=/other/checkout python benchmarks/plan_load.py   # another checkout, for before/after

Hostile files: nested 2,000 deep (flow lists, flow maps, block dashes), a billion laughs, and files at the size
limit (:data:`meshplan.plan_file.reading.MAX_PLAN_BYTES`, or 4 MB / 1 MiB where that limit is larger): a flat list,
a flow list, many keys, one long string, one comment. Each is accepted or refused; the table says which.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

if "PYTHONPATH" not in os.environ:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from meshplan.plan_file.reading import read_plan_data  # noqa: E402


def hostile_files(root: Path, limit: int) -> dict[str, str]:
    """name -> text of each file timed."""
    m = limit - 100
    laughs = "".join(f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9) if i else 'lol'}]\n" for i in range(10))
    return {
        "normal (plans/llama.yaml)": (Path(__file__).resolve().parent.parent / "plans" / "llama.yaml").read_text(),
        "flow list 2,000 deep (4 KB)": "a: " + "[" * 2000 + "]" * 2000 + "\n",
        "flow map 2,000 deep": "{a: " * 2000 + "1" + "}" * 2000 + "\n",
        "block dashes 2,000 deep": "a:\n  " + "- " * 2000 + "x\n",
        "billion laughs": laughs,
        "4 MB comment": "#" + "x" * (4 << 20) + "\n",
        "flat list at the limit": "a:\n" + "- 1\n" * (m // 4),
        "flow list at the limit": "a: [" + "1," * (m // 2) + "]\n",
        "keys at the limit": "".join(f"k{i}: 1\n" for i in range(m // 12)),
        "2,499 keys (4,998 values)": "".join(f"k{i}: 1\n" for i in range(2499)),
        "long string at the limit": 'a: "' + "x" * m + '"\n',
        "comment at the limit": "#" + "x" * m + "\n",
    }


def main() -> None:
    try:
        from meshplan.plan_file.reading import MAX_PLAN_BYTES as limit
    except ImportError:
        limit = 1 << 20
    with tempfile.TemporaryDirectory() as d:
        print(f"| file | bytes | ms (best of 5) | outcome |\n|---|---|---|---|")
        for name, text in hostile_files(Path(d), min(limit, 1 << 20)).items():
            path = Path(d) / "plan.yaml"
            path.write_text(text)
            best, outcome = float("inf"), "accepted"
            for _ in range(5):
                t = time.perf_counter()
                try:
                    read_plan_data(path)
                except ValueError as e:
                    outcome = "refused: " + str(e).split(": ", 1)[1][:60]
                best = min(best, time.perf_counter() - t)
            print(f"| {name} | {len(text.encode()):,} | {best * 1e3:.1f} | {outcome} |")


if __name__ == "__main__":
    main()
