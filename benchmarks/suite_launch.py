"""Where a shared test launch spends its time: run ``tests/dist/suite_worker.py`` at one world size with the
``SHARED`` workers of ``tests/_launch.py`` (or the entries given) and print rank 0's cases, slowest first, with
their seconds and the rank's thread count after each (gloo groups that pile up show there), then each worker's
total.

Example::

    python benchmarks/suite_launch.py 2                       # world 2's shared launch, as the suite runs it
    python benchmarks/suite_launch.py 4 dp_worker ckpt_worker # two workers in one world-4 launch

Measured here (world 2, 2 cores, 13:00 UTC, load average 130-500 from other jobs): 460 s, 406 s of it in
cases; arch_worker:parity 61 s, hf_worker 109 s over 6 cases, tp_worker 54 s; 3,034 threads per rank at the end.
"""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from _launch import SHARED, launch  # noqa: E402


def main(argv: list[str]) -> int:
    """Run the launch and print the table; returns torchrun's exit status."""
    n = int(argv[0])
    entries = argv[1:] or [f"{w}:{worlds[n]}".rstrip(":") for w, (_, worlds) in SHARED.items() if n in worlds]
    results = launch("tests/dist/suite_worker.py", n, *entries, timeout=2400)
    meta = results.pop("_meta")
    rows = sorted(((v.get(0, {}).get("seconds", -1.0), case, v.get(0, {}).get("threads"), "error" in v.get(0, {}))
                   for case, v in results.items()), reverse=True)
    print(f"world {n}: torchrun rc {meta['returncode']}, {meta['seconds']:.1f} s, {len(rows)} cases")
    print(f"{'seconds':>8} {'threads':>7}  case")
    per_worker: dict[str, float] = defaultdict(float)
    for seconds, case, threads, failed in rows:
        print(f"{seconds:8.2f} {threads!s:>7}  {case}{'  ERROR' if failed else ''}")
        per_worker[case.partition(':')[0]] += max(seconds, 0.0)
    print("\nper worker:")
    for worker, seconds in sorted(per_worker.items(), key=lambda kv: -kv[1]):
        print(f"{seconds:8.1f}  {worker}")
    if meta["returncode"]:
        print(meta["stderr"][-3000:])
    return meta["returncode"]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
