"""The flags of ``meshplan estimate`` and ``meshplan solve`` (:mod:`meshplan.cli.solve`): the model, the cluster,
the run and the search space."""

from __future__ import annotations

import argparse

from meshplan.cli.args import float_arg, int_arg

__all__ = ["DTYPES", "model_flags", "cluster_flags", "run_flags", "solve_flags"]

DTYPES = ("float32", "bfloat16", "float16")


def model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default=None, help="a named model (llama3-8b, llama3-70b, llama3-405b, gpt-1.7b … "
                                                  "gpt-462b: Megatron-LM's weak-scaling models)")
    p.add_argument("--model", default=None, help="MODULE:FACTORY building the model (as for `meshplan check`)")
    p.add_argument("--config", default=None, help="with --model: JSON passed to the factory; alone: the model's "
                                                  "sizes (JSON text or a .json/.yaml/.toml file, transformers' "
                                                  "config.json keys accepted)")
    p.add_argument("--path", action="append", help="extra import directory for --model (repeatable)")


def cluster_flags(p: argparse.ArgumentParser, profile: bool) -> None:
    p.add_argument("--cluster", default="h100-80g", help="a preset (h100-80g, h200-141g, a100-80g) or a cluster "
                                                         "file from `meshplan profile` (default h100-80g)")
    p.add_argument("--gpus-per-node", type=int_arg(1, 1 << 20), default=None, help="override the cluster's")
    p.add_argument("--memory-gib", type=float_arg(0, 1 << 20, " GiB"), default=None,
                   help="override the device memory (GiB, in (0, 2**20])")
    if profile:
        p.add_argument("--profile", action="store_true", help="measure this machine (a short torchrun job on the "
                                                             "current backend) and use it as the cluster")
        p.add_argument("--nproc", type=int_arg(1, 1024), default=None, help="--profile: processes (default: "
                                                                            "min(--gpus, 8))")
        p.add_argument("--profile-out", default="meshplan-cluster.json", help="--profile: where the cluster file goes")


def run_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seq", type=int_arg(1, 1 << 24), required=True, help="tokens per sequence")
    p.add_argument("--global-batch", type=int_arg(1, 1 << 24), required=True,
                   help="sequences per optimizer step over all data-parallel ranks")
    p.add_argument("--format", choices=("table", "json"), default="table")


def solve_flags(s: argparse.ArgumentParser) -> None:
    s.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="compute dtype (default bfloat16)")
    s.add_argument("--master-dtype", choices=DTYPES, default="float32",
                   help="parameters, gradients and optimizer state, and gradient reduction (default float32)")
    s.add_argument("--no-sequence-parallel", action="store_true", help="tensor parallelism without SP")
    s.add_argument("--save-gathered-inputs", action="store_true", help="tensor_parallel.save_gathered_inputs: true")
    for name, help_ in [("tp", "tensor parallel"), ("cp", "context parallel"), ("ep", "expert parallel"),
                        ("pp", "pipeline parallel"), ("vpp", "virtual stages per pp rank"),
                        ("dp-replicate", "data-parallel replicas")]:
        s.add_argument(f"--{name}", type=int_arg(1, 1 << 20, " (2**20)"), default=None, help=f"pin {help_}")
    s.add_argument("--orders", default=None, help="Megatron order strings to try, comma-separated")
    s.add_argument("--schedules", default=None, help="pipeline schedules to try, comma-separated")
    s.add_argument("--vpps", default=None, help="stages per rank to try with the loop schedules (default 2,4)")
    s.add_argument("--micro-batches", default=None, help="micro-batch sizes to try (default 1,2,4,8)")
    s.add_argument("--ac", default=None, help="activation checkpointing to try: none,selective,full")
    s.add_argument("--top", type=int_arg(1, 1 << 20), default=10, help="valid layouts printed (default 10)")
    s.add_argument("--show-rejected", type=int_arg(0, 1 << 20), default=2,
                   help="rejected candidates printed per rule (default 2)")
    s.add_argument("--write", default=None, help="write the best layout as a plan file")
    s.add_argument("--plan", default=None, help="--write: the plan whose rule sections the written plan keeps")
