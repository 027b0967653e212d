"""The walk of one plan through meshplan's files, from ``meshplan.parallelize`` down to torch's calls.

Run: ``python benchmarks/walk.py [--plan plans/llama_3d.yaml] [--trace]``. The example Llama (4 layers, small
shapes) is built on the meta device and parallelized with the plan on a ``fake`` process group (this process is
rank 0 of the plan's world), once to import what it imports, then again under a profiler. The profiler follows control through the files under ``meshplan/`` (frames of other
packages are skipped: a call from torch back into meshplan counts as entering that meshplan file). Printed:

* files: the distinct meshplan files the call passes through;
* moves: the distinct moves ``A → B`` between meshplan files (a loop that calls the same helper for every module
  counts once);
* back moves: the distinct moves into a file that was entered before and left since (the walk going back and
  forth, the number issue 26 asks to shrink);
* state.py visits: entries into ``meshplan/state.py`` (records attached or read along the way).

``--trace`` prints the sequence of files (consecutive repeats collapsed). Counts are deterministic for a given
commit; run it on two checkouts side by side to compare (``PYTHONPATH=<checkout> python <checkout>/benchmarks/walk.py``).
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _p in (ROOT, os.path.join(ROOT, "examples")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

__all__ = ["walk", "main"]


def walk(fn, package_dir: str) -> list[str]:
    """Run ``fn()`` and return the sequence of files under ``package_dir`` control passed through, consecutive
    repeats collapsed."""
    seq: list[str] = []
    prefix = package_dir.rstrip(os.sep) + os.sep

    def prof(frame, event, arg):
        if event not in ("call", "return"):
            return
        f = frame.f_code.co_filename if event == "call" else (frame.f_back.f_code.co_filename
                                                                if frame.f_back is not None else "")
        if f.startswith(prefix):
            rel = f[len(prefix):]
            if not seq or seq[-1] != rel:
                seq.append(rel)

    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return seq


def summary(seq: list[str]) -> dict[str, int]:
    """``files``, distinct ``moves``, distinct ``back`` moves (into a file already left) and ``state`` entries."""
    seen: set[str] = set()
    moves: set[tuple[str, str]] = set()
    back: set[tuple[str, str]] = set()
    for a, b in zip(seq, seq[1:]):
        seen.add(a)
        moves.add((a, b))
        if b in seen:
            back.add((a, b))
    seen.update(seq[-1:])
    return {"files": len(seen), "moves": len(moves), "back": len(back), "state": sum(f == "state.py" for f in seq)}


def main(argv=None) -> dict[str, int]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--plan", default=os.path.join(ROOT, "plans", "llama_3d.yaml"))
    ap.add_argument("--world", type=int, default=8, help="ranks of the fake group (default 8)")
    ap.add_argument("--trace", action="store_true", help="print the sequence of files")
    args = ap.parse_args(argv)
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import meshplan
    from llama import ModelArgs, Transformer
    from meshplan.plan_file.document import as_plan
    p = as_plan(args.plan)
    world = args.world
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    topo = meshplan.build_mesh(p.layout)
    def build():
        with torch.device("meta"):
            return Transformer(ModelArgs(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=128, max_seq_len=32))
    meshplan.parallelize(build(), args.plan, topo)  # imports done: the walk counts calls, not module loads
    model = build()
    pkg = os.path.dirname(os.path.abspath(meshplan.__file__))
    seq = walk(lambda: meshplan.parallelize(model, args.plan, topo), pkg)
    s = summary(seq)
    print(f"walk of {os.path.relpath(args.plan, ROOT)} (world {world}) from meshplan.parallelize, "
          f"meshplan at {os.path.relpath(pkg, os.getcwd())}")
    print("| files | moves between files | back moves (into a file already left) | state.py entries |")
    print("|---|---|---|---|")
    print(f"| {s['files']} | {s['moves']} | {s['back']} | {s['state']} |")
    if args.trace:
        print(" → ".join(seq))
    dist.destroy_process_group()
    return s


if __name__ == "__main__":
    main()
