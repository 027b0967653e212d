"""Init time per rank: ``meshplan.materialize`` exact vs sharded, world 1 vs tp 4 (fake process group).

The example Llama (``examples/llama.py``) built on the meta device; world 1 is the plain model (no parallelize),
world 4 is tp 4 with ``plans/llama.yaml``'s rules, each simulated rank timed in this one process on a fake group
(no communication: materialize needs none). Reported: the CPU seconds (``time.process_time``, robust to other
processes on a shared machine) and wall seconds of ``materialize`` alone, per rank, best of ``--repeat``.

    OMP_NUM_THREADS=1 python benchmarks/init_modes.py [--dim 512 --layers 8 --vocab 32000]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for p in (ROOT, os.path.join(ROOT, "examples"), os.path.join(ROOT, "tests")):
    if p not in sys.path:
        sys.path.insert(0, p)

import torch  # noqa: E402

import llama  # noqa: E402
import meshplan  # noqa: E402
from conftest import fake_process_group  # noqa: E402


def _time(make, mode: str, world: int, rank: int) -> tuple[float, float]:
    with torch.device("meta"):
        model = make()
    if world > 1:
        model = meshplan.parallelize(model, "plans/llama.yaml", meshplan.build_mesh({"tp": world}))
    c, w = time.process_time(), time.perf_counter()
    meshplan.materialize(model, seed=0, mode=mode, device="cpu")
    return time.process_time() - c, time.perf_counter() - w


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--repeat", type=int, default=2)
    a = ap.parse_args()
    args = llama.ModelArgs(dim=a.dim, n_layers=a.layers, n_heads=8, vocab_size=a.vocab, ffn_dim=a.dim * 11 // 4)
    make = lambda: llama.build(args)  # noqa: E731
    with torch.device("meta"):
        n = sum(p.numel() for p in make().parameters())
    print(f"example Llama dim {a.dim}, {a.layers} layers, vocab {a.vocab}: {n / 1e6:.1f} M parameters "
          f"({n * 4 / 2 ** 20:.0f} MiB fp32)")
    print("| mode | world | rank | CPU s | wall s |\n|---|---|---|---|---|")
    for mode in ("exact", "sharded"):
        for world in (1, 4):
            for rank in ((0,) if world == 1 else (0, 3)):
                runs = []
                for _ in range(a.repeat):
                    if world == 1:
                        runs.append(_time(make, mode, 1, 0))
                    else:
                        with fake_process_group(world, rank):
                            runs.append(_time(make, mode, world, rank))
                cpu, wall = min(runs)
                print(f"| {mode} | {world} | {rank} | {cpu:.2f} | {wall:.2f} |", flush=True)


if __name__ == "__main__":
    main()
