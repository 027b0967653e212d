"""A long fuzz run of plan files and the ``meshplan`` CLI; prints how each input ended.

The strategies are those of ``tests/test_fuzz_plans.py`` (which runs a few hundred derandomized inputs in the
test suite); here the seeds are random and the counts large::

    python benchmarks/fuzz.py --plans 5000 --cli 500 [--seed 0]

Every plan file (counted per kind: random data, mutated real plans, byte mutations, random bytes, deep nesting, huge
numbers, YAML oddities and alias bombs, Python-object tags that would create a file, duplicate keys, NaN/inf) and
every plan built in Python must end in a ``Plan`` or a ``PlanError``, within 10 s, creating no file; every command
line in exit 0 or 2 with at most one ``meshplan: error:`` line on stderr. Anything else is counted as ``other`` and printed; the exit status is 1 then.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]
os.chdir(ROOT)  # the CLI pool names plans/ and examples/ relative to the repo root

from hypothesis import HealthCheck, given, seed, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import test_fuzz_plans as fz  # noqa: E402
from meshplan import PlanError  # noqa: E402
from meshplan.plan_file.document import as_plan  # noqa: E402


def _run(name: str, n: int, strategy, outcome, rng_seed: int) -> collections.Counter:
    counts: collections.Counter = collections.Counter()

    @seed(rng_seed)
    @settings(max_examples=n, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(strategy)
    def run(case):
        try:
            counts[outcome(case)] += 1
        except BaseException as e:  # noqa: BLE001 - a fuzz run reports whatever escapes
            counts["other"] += 1
            print(f"{name}: OTHER {type(e).__name__}: {str(e)[:300]} for {str(case)[:300]!r}", file=sys.__stderr__)
            traceback.print_exc(limit=-3, file=sys.__stderr__)

    t = time.time()
    run()
    print(f"{name}: {sum(counts.values())} inputs in {time.time() - t:.1f} s: {dict(sorted(counts.items()))}")
    return counts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--plans", type=int, default=5000, help="plan files to try")
    ap.add_argument("--cli", type=int, default=500, help="command lines to try")
    ap.add_argument("--data", type=int, default=2000, help="plans built in Python (dicts of any objects) to try")
    ap.add_argument("--seed", type=int, default=int(time.time()))
    args = ap.parse_args()
    print(f"seed {args.seed}")
    with tempfile.TemporaryDirectory(prefix="meshplan-fuzz-") as tmp:
        root = Path(tmp)

        def plan_outcome(case) -> str:
            suffix, content = case
            path = root / f"plan{suffix}"
            path.write_bytes(content)
            return {"plan": "Plan", "error": "PlanError"}[fz.load_outcome(path)]

        def cli_outcome(argv) -> str:
            code, out, err = fz.cli_outcome(argv)
            return "exit 0" if code == 0 else ("exit 2, one line" if err else "exit 2, report on stdout")

        def data_outcome(data) -> str:
            try:
                return type(as_plan(data)).__name__
            except PlanError as e:
                assert "\n" not in str(e)
                return "PlanError"

        pool = fz.make_pool(root / "pool")
        bad = 0
        for kind in fz.FILE_KINDS:  # one count per kind of input
            bad += _run(f"plan files: {kind}", max(1, args.plans // len(fz.FILE_KINDS)), fz.plan_files((kind,)),
                        plan_outcome, args.seed)["other"]
        bad += _run("python data (as_plan)", args.data, st.dictionaries(fz.keys, fz.python_data, max_size=5)
                    | fz.mutated_plans(), data_outcome, args.seed)["other"]
        bad += _run("cli", args.cli, fz.argvs(pool), cli_outcome, args.seed)["other"]
        print(f"canary {fz.CANARY} created: {fz.CANARY.exists()}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
