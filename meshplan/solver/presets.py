"""Named clusters and models for ``meshplan solve`` / ``estimate``: published numbers, each with its source.

Clusters (``--cluster``; every value per device):

* ``h100-80g``: H100 SXM5 80 GB. Peak dense BF16 989.4 TFLOP/s, FP8 1,978.9 and TF32 494.7 (NVIDIA's H100
  datasheet quotes 1,979 / 3,958 / 989 "with sparsity", twice the dense rate), 80 GB HBM3 at 3.35 TB/s, NVLink 4 900 GB/s both ways
  (450 GB/s one way) — https://www.nvidia.com/en-us/data-center/h100/ . One 400 Gb/s InfiniBand NIC per GPU
  (ConnectX-7 in DGX H100: 50 GB/s one way) — https://docs.nvidia.com/dgx/dgxh100-user-guide/introduction-to-dgxh100.html
* ``h200-141g``: H200 SXM 141 GB HBM3e at 4.8 TB/s, the same compute, NVLink and NIC as the H100 —
  https://www.nvidia.com/en-us/data-center/h200/
* ``a100-80g``: A100 SXM4 80 GB. Dense BF16 312 TFLOP/s, TF32 156, HBM2e 2,039 GB/s, NVLink 3 600 GB/s both ways;
  one 200 Gb/s HDR NIC per GPU (DGX A100) —
  https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf

What a link delivers is lower than its signalling rate: the presets take 80% of it (NCCL's all-reduce bus
bandwidth reaches 360-370 GB/s of NVLink 4's 450 and ~45 GB/s of a 50 GB/s NIC in nccl-tests), a step latency of
5 µs inside a node and 10 µs across nodes, 70% of peak for BF16 matmuls (cuBLAS on H100 runs 600-750 TFLOP/s on
large GEMMs, less on the narrower ones tensor parallelism leaves), 35% for attention (FlashAttention-2 on H100:
~335 TFLOP/s forward, less backward — Shah et al., FlashAttention-3, arXiv 2407.08608, Fig. 1), 10 µs per operator
launch (eager PyTorch), 90% of the memory usable, and 25 GB/s per device to and from the host (PCIe Gen4/5 x16
in practice, and a host's memory bandwidth shared by 8 devices) for CPU offload. None of these were fitted to the calibration runs in ``docs/solver.md``.

Models (``--preset``): the Llama 3 family (the Llama 3 paper, arXiv 2407.21783, Table 3; vocabulary 128,256 as
in the released configs) and the GPT models of Megatron-LM's weak-scaling table (github.com/NVIDIA/Megatron-LM,
``images/model_table.png``, July 2024: vocabulary 131,072, FFN 4·hidden, sequence 4,096, untied embeddings).
"""

from __future__ import annotations

from dataclasses import replace

from meshplan.errors import PlanError
from meshplan.solver.cluster import Cluster, Link
from meshplan.solver.shape import ModelShape

__all__ = ["cluster_preset", "model_preset", "CLUSTER_PRESETS", "MODEL_PRESETS"]

GB = 1e9
CLUSTER_PRESETS = ("h100-80g", "h200-141g", "a100-80g")


def cluster_preset(name: str) -> Cluster:
    """The named :class:`Cluster` (a fresh object each call).

    Raises:
        PlanError: an unknown name, with the known ones.
    """
    hopper_links = (Link(0.8 * 450 * GB, 5e-6), Link(0.8 * 50 * GB, 10e-6))
    return replace(_preset(name), calibration_error=PUBLISHED_ERROR, calibration_source=PUBLISHED_SOURCE)


#: the presets' mean relative error against published runs (``benchmarks/published.py``, docs/solver.md)
PUBLISHED_ERROR = 0.09
PUBLISHED_SOURCE = ("the published runs benchmarks/published.py reproduces (Megatron-LM weak scaling: mean error 9%; "
                    "Llama 3 405B: 0.89-1.03 of the paper)")


def _preset(name: str) -> Cluster:
    hopper_links = (Link(0.8 * 450 * GB, 5e-6), Link(0.8 * 50 * GB, 10e-6))
    if name == "h100-80g":
        return Cluster("h100-80g", 8, 80 * GB, {"bfloat16": 989.4e12, "float32": 494.7e12, "float8": 1978.9e12}, 3.35e12, *hopper_links,
                       op_overhead=10e-6, source="NVIDIA H100 SXM5 datasheet; DGX H100 ConnectX-7 400 Gb/s per GPU")
    if name == "h200-141g":
        return Cluster("h200-141g", 8, 141 * GB, {"bfloat16": 989.4e12, "float32": 494.7e12, "float8": 1978.9e12}, 4.8e12, *hopper_links,
                       op_overhead=10e-6, source="NVIDIA H200 SXM datasheet; 400 Gb/s per GPU")
    if name == "a100-80g":
        return Cluster("a100-80g", 8, 80 * GB, {"bfloat16": 312e12, "float32": 156e12}, 2.039e12,
                       Link(0.8 * 300 * GB, 5e-6), Link(0.8 * 25 * GB, 10e-6), op_overhead=10e-6,
                       source="NVIDIA A100 SXM4 80GB datasheet; DGX A100 HDR 200 Gb/s per GPU")
    raise PlanError(f"--cluster {name!r}: not a preset ({', '.join(CLUSTER_PRESETS)}) nor a file")


def _llama3(name: str, layers: int, hidden: int, heads: int, ffn: int) -> ModelShape:
    return ModelShape(layers=layers, hidden=hidden, heads=heads, kv_heads=8, ffn=ffn, vocab=128256, name=name)


def _gpt(name: str, heads: int, hidden: int, layers: int) -> ModelShape:
    return ModelShape(layers=layers, hidden=hidden, heads=heads, kv_heads=heads, ffn=4 * hidden, vocab=131072,
                      mlp="gelu", norm="layernorm", bias=True, gqa_repeat=False, kernels="fused", name=name)


def _models() -> dict[str, ModelShape]:
    return {
        "llama3-8b": _llama3("llama3-8b", 32, 4096, 32, 14336),
        "llama3-70b": _llama3("llama3-70b", 80, 8192, 64, 28672),
        "llama3-405b": _llama3("llama3-405b", 126, 16384, 128, 53248),
        "gpt-1.7b": _gpt("gpt-1.7b", 16, 2048, 24),
        "gpt-7.1b": _gpt("gpt-7.1b", 32, 4096, 30),
        "gpt-16b": _gpt("gpt-16b", 48, 6144, 32),
        "gpt-32b": _gpt("gpt-32b", 56, 7168, 48),
        "gpt-70b": _gpt("gpt-70b", 64, 8192, 84),
        "gpt-119b": _gpt("gpt-119b", 80, 10240, 92),
        "gpt-177b": _gpt("gpt-177b", 96, 12288, 96),
        "gpt-314b": _gpt("gpt-314b", 128, 16384, 96),
        "gpt-462b": _gpt("gpt-462b", 144, 18432, 112),
    }


MODEL_PRESETS = tuple(_models())


def model_preset(name: str) -> ModelShape:
    """The named :class:`ModelShape`.

    Raises:
        PlanError: an unknown name, with the known ones.
    """
    models = _models()
    if name not in models:
        raise PlanError(f"--preset {name!r}: unknown; presets: {', '.join(models)}")
    return models[name]
