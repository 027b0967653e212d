"""Time the layout search (``meshplan solve``) up to 16,384 GPUs: candidates enumerated, valid, seconds.

    python benchmarks/solve.py            # Llama 3 405B on 512 … 16,384 H100s, Llama 3 70B and 8B beside it

The search is torch-free and single-threaded; the machine's load is printed with the table (the brief's
2-core host is shared: compare seconds only at a low load).
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from meshplan.solver.candidate import Training  # noqa: E402
from meshplan.solver.presets import cluster_preset, model_preset  # noqa: E402
from meshplan.solver.search import search  # noqa: E402

#: (model, GPUs, sequence length, global batch in sequences): the Llama 3 paper's 16M-token batches at 8K
RUNS = [("llama3-8b", 8, 8192, 16), ("llama3-70b", 256, 8192, 512), ("llama3-405b", 512, 8192, 256),
        ("llama3-405b", 2048, 8192, 1024), ("llama3-405b", 8192, 8192, 2048), ("llama3-405b", 16384, 8192, 2048),
        ("llama3-405b", 16384, 131072, 128)]


def main() -> None:
    cluster = cluster_preset("h100-80g")
    print(f"load average before: {os.getloadavg()[0]:.2f} (2 shared cores)")
    print("| model | GPUs | seq | global batch | candidates enumerated | valid | rejected | seconds | best layout | "
          "est. MFU |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, gpus, seq, batch in RUNS:
        t = time.perf_counter()
        res = search(model_preset(name), Training(seq=seq, global_batch=batch), cluster, gpus)
        wall = time.perf_counter() - t
        best = res.valid[0] if res.valid else None
        print(f"| {name} | {gpus:,} | {seq:,} | {batch:,} | {res.enumerated:,} | {len(res.valid):,} | "
              f"{len(res.rejected):,} | {wall:.2f} | {best.candidate.label() if best else '-'} | "
              f"{f'{100 * best.mfu:.1f}%' if best else '-'} |")
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
