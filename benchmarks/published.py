"""The cost model against published large runs: throughput as published vs ``meshplan estimate``, and the rank
of the published layout among every candidate ``meshplan solve`` enumerates for the same model, GPUs and batch.

    python benchmarks/published.py           # ~2-4 minutes on one core

Sources (every number below is copied from them):

* Llama 3 405B: "The Llama 3 Herd of Models", arXiv 2407.21783, Table 4 (GPUs, TP, CP, PP, DP, sequence, batch
  per DP rank, 16M tokens per batch, TFLOPs/GPU, BF16 MFU); H100 80 GB, 400 Gb/s RoCE.
* torchtitan: github.com/pytorch/torchtitan ``benchmarks/llama3_h100_202412_torchtitan.md`` (Dec 2024), Tables 1-6:
  TPS/GPU of Llama 3.1 8B/70B/405B on H100 96 GB HBM2e (2.4 TB/s) at 500 W, whose peak the page puts "between SXM
  and NVL" (H100 NVL: 835 dense BF16 TFLOP/s, used here); sequence 8192 unless stated.
* Megatron-LM: github.com/NVIDIA/Megatron-LM ``images/model_table.png`` (README "Weak Scaling Results", Megatron-Core
  r0.8.0, July 2024): GPT models 1.7B-462B on 48-6144 H100s, vocabulary 131,072, sequence 4,096, per-GPU TFLOP/s
  and MFU; with TP/DP/PP communication overlap.

The estimate of a published layout is the fastest candidate with its published degrees (and schedule, AC and
micro-batch where published); unpublished knobs (vpp, micro-batch, checkpointing, the data-parallel split) take
the solver's best. Its rank counts the valid candidates of the whole search that the model puts faster.
"""

from __future__ import annotations

import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from meshplan.solver.candidate import Training  # noqa: E402
from meshplan.solver.presets import cluster_preset, model_preset  # noqa: E402
from meshplan.solver.search import Space, search  # noqa: E402

#: Llama 3 paper Table 4: (GPUs, TP, CP, PP, DP, seq, batch per DP rank, TFLOPs/GPU, MFU)
LLAMA3 = [(8192, 8, 1, 16, 64, 8192, 32, 430, 0.43), (16384, 8, 1, 16, 128, 8192, 16, 400, 0.41),
          (16384, 8, 16, 16, 8, 131072, 16, 380, 0.38)]
#: torchtitan: (table, model, GPUs, tp, cp, pp, dp, seq, global batch, ac, schedule, compile, float8, TPS/GPU)
TORCHTITAN = [
    ("1 FSDP", "llama3-8b", 8, 1, 1, 1, 8, 8192, 16, "selective", None, False, False, 5762),
    ("1 FSDP+compile", "llama3-8b", 8, 1, 1, 1, 8, 8192, 16, "selective", None, True, False, 6667),
    ("1 FSDP+compile+fp8", "llama3-8b", 8, 1, 1, 1, 8, 8192, 16, "selective", None, True, True, 8532),
    ("3 FSDP", "llama3-8b", 128, 1, 1, 1, 128, 8192, 256, "selective", None, False, False, 5605),
    ("3 FSDP+compile", "llama3-8b", 128, 1, 1, 1, 128, 8192, 256, "selective", None, True, False, 6514),
    ("2 FSDP8 CP1", "llama3-8b", 8, 1, 1, 1, 8, 32768, 8, "full", None, True, True, 3890),
    ("2 FSDP4 CP2", "llama3-8b", 8, 1, 2, 1, 4, 65536, 4, "full", None, True, True, 2540),
    ("2 FSDP2 CP4", "llama3-8b", 8, 1, 4, 1, 2, 131072, 2, "full", None, True, True, 1071),
    ("4 FSDP32 TP8", "llama3-70b", 256, 8, 1, 1, 32, 8192, 512, "full", None, True, True, 829),
    ("5 3D 1F1B", "llama3-405b", 512, 8, 1, 8, 8, 8192, 256, "full", "1f1b", True, True, 100),
    ("5 3D interleaved", "llama3-405b", 512, 8, 1, 8, 8, 8192, 256, "full", "interleaved_1f1b", True, True, 128),
    ("6 FSDP8 CP1", "llama3-405b", 512, 8, 1, 8, 8, 32768, 64, "full", "1f1b", True, True, 76),
    ("6 FSDP4 CP2", "llama3-405b", 512, 8, 2, 8, 4, 65536, 32, "full", "1f1b", True, True, 47),
    ("6 FSDP2 CP4", "llama3-405b", 512, 8, 4, 8, 2, 131072, 16, "full", "1f1b", True, True, 31),
]
#: Megatron-LM weak scaling: (model, TP, PP, DP, GPUs, global batch, TFLOP/s per GPU, MFU)
MEGATRON = [("gpt-1.7b", 1, 1, 48, 48, 192, 408.8, 0.41), ("gpt-7.1b", 2, 1, 48, 96, 192, 465.9, 0.47),
            ("gpt-16b", 4, 1, 48, 192, 192, 489.1, 0.49), ("gpt-32b", 8, 1, 48, 384, 192, 459.6, 0.46),
            ("gpt-70b", 8, 2, 48, 768, 384, 419.7, 0.42), ("gpt-119b", 8, 4, 48, 1536, 768, 420.5, 0.43),
            ("gpt-177b", 8, 6, 48, 2304, 1152, 432.8, 0.44), ("gpt-314b", 8, 8, 48, 3072, 1536, 474.4, 0.48),
            ("gpt-462b", 8, 16, 48, 6144, 3072, 459.9, 0.47)]


def _published(res, tp, cp, pp, dp, ac=None, schedule=None):
    """``(estimate, rank)`` of the fastest valid candidate with these degrees (None: every one was rejected)."""
    for rank, e in enumerate(res.valid, 1):
        c = e.candidate
        if (c.tp, c.cp, c.pp, c.dp) == (tp, cp, pp, dp) and (ac is None or c.ac == ac) and \
                (schedule is None or c.schedule == schedule):
            return e, rank
    return None, None


def _why(res, tp, cp, pp, dp) -> str:
    prefix = f"tp{tp} " + (f"cp{cp} " if cp > 1 else "") + (f"pp{pp}" if pp > 1 else "")
    reasons = sorted({r.reason for r in res.rejected if r.label.startswith(prefix.strip())})
    return "rejected: " + ", ".join(reasons) if reasons else "not enumerated"


def llama3() -> None:
    cl = cluster_preset("h100-80g")
    # the paper (§3.3.2) all-gathers K and V, which GQA keeps far smaller than Q: gathered before the repeat
    s = dataclasses.replace(model_preset("llama3-405b"), gqa_repeat=False)
    print("\n### Llama 3 405B (arXiv 2407.21783, Table 4), h100-80g\n")
    print("| GPUs | TP | CP | PP | DP | seq | published TFLOPs/GPU (MFU) | estimate TFLOPs/GPU (MFU) | est/pub | "
          "published layout's rank | valid candidates | solver's best |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for gpus, tp, cp, pp, dp, seq, per_dp, tflops, mfu in LLAMA3:
        res = search(s, Training(seq=seq, global_batch=per_dp * dp), cl, gpus, Space(micro_batches=(1, 2)))
        e, rank = _published(res, tp, cp, pp, dp)
        est = f"{e.tflops_device:.0f} ({100 * e.mfu:.0f}%)" if e else _why(res, tp, cp, pp, dp)
        ratio = f"{e.tflops_device / tflops:.2f}" if e else "-"
        print(f"| {gpus:,} | {tp} | {cp} | {pp} | {dp} | {seq:,} | {tflops} ({100 * mfu:.0f}%) | {est} | {ratio} | "
              f"{rank or '-'} | {len(res.valid):,} | {res.valid[0].candidate.label() if res.valid else '-'} |")


def torchtitan() -> None:
    base = cluster_preset("h100-80g")
    # their H100s: 96 GB HBM2e at 2.4 TB/s, 500 W; peak "between SXM and NVL" (footnote 2): NVL's 835 dense BF16
    # is the lower end, taken here (FP8 twice that)
    cl = dataclasses.replace(base, name="h100-96g-hbm2e-500w", memory=96e9, hbm_bandwidth=2.4e12,
                             flops={"bfloat16": 835e12, "float32": 417.5e12, "float8": 1670e12})
    print("\n### torchtitan Llama 3.1 (benchmarks/llama3_h100_202412_torchtitan.md), H100 96 GB HBM2e 2.4 TB/s\n")
    print("| table | model | GPUs | layout | seq | published TPS/GPU | estimate TPS/GPU | est/pub | rank | valid |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for table, name, gpus, tp, cp, pp, dp, seq, batch, ac, sched, compiled, fp8, tps in TORCHTITAN:
        s = dataclasses.replace(model_preset(name), kernels="fused" if compiled else "eager")
        tr = Training(seq=seq, global_batch=batch, matmul_dtype="float8" if fp8 else None)
        # torchtitan's "selective" is its default op-level SAC (matmul outputs kept)
        space = Space(micro_batches=(1, 2, 4, 8) if pp > 1 else (1, 2), ac_ops=ac == "selective")
        res = search(s, tr, cl, gpus, space)
        e, rank = _published(res, tp, cp, pp, dp, ac, sched)
        est = f"{e.tokens_per_s_device:,.0f}" if e else _why(res, tp, cp, pp, dp)
        ratio = f"{e.tokens_per_s_device / tps:.2f}" if e else "-"
        layout = f"tp{tp} cp{cp} pp{pp} dp{dp}" + (f" {sched}" if sched else "") + f" ac={ac}"
        print(f"| {table} | {name} | {gpus} | {layout} | {seq:,} | {tps:,} | {est} | {ratio} | {rank or '-'} | "
              f"{len(res.valid):,} |")


def megatron() -> None:
    cl = cluster_preset("h100-80g")
    print("\n### Megatron-LM weak scaling (README model_table.png, Megatron-Core r0.8.0), h100-80g, seq 4096\n")
    print("| model | GPUs | TP | PP | DP | batch | published TFLOP/s/GPU (MFU) | estimate (MFU) | est/pub | rank | "
          "valid | solver's best |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, tp, pp, dp, gpus, batch, tflops, mfu in MEGATRON:
        res = search(model_preset(name), Training(seq=4096, global_batch=batch), cl, gpus, Space(micro_batches=(1, 2)))
        e, rank = _published(res, tp, 1, pp, dp)
        est = f"{e.tflops_device:.0f} ({100 * e.mfu:.0f}%)" if e else _why(res, tp, 1, pp, dp)
        ratio = f"{e.tflops_device / tflops:.2f}" if e else "-"
        print(f"| {name} | {gpus:,} | {tp} | {pp} | {dp} | {batch:,} | {tflops} ({100 * mfu:.0f}%) | {est} | {ratio} | "
              f"{rank or '-'} | {len(res.valid):,} | {res.valid[0].candidate.label() if res.valid else '-'} |")


if __name__ == "__main__":
    print(f"load average: {os.getloadavg()[0]:.2f}")
    llama3()
    torchtitan()
    megatron()
