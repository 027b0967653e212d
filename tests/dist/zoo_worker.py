"""Real gloo processes: a representative slice of the transformers zoo (``benchmarks/zoo.py``) on every axis.

Each case builds a tiny transformers model in float64 (``benchmarks/zoo_plans.build``), writes the zoo's plan for
one axis (``zoo_plans.check_axis``: ``from_hf``'s tp/ep plan, SP first then plain, the blocks, a pipeline or
context_parallel section), checks it, and runs ``zoo_dist.run_item``: ``meshplan.parallelize`` + one ``meshplan.train_step`` vs one device,
the loss and every gradient each rank holds within 1e-9 relative (the model code's fp32 casts kept float64).
"""

import os
import sys

import torch.distributed as dist

from _launch import run_cases

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "benchmarks"))
from zoo_dist import KeepFloat64, run_item  # noqa: E402
from zoo_plans import WORLD, build, check_axis, is_moe  # noqa: E402

# (model type, axis): what each covers beyond the plain Llama block
ZOO = {
    ("llama", "tp"): "reference block, SP + loss parallel",
    ("llama", "pp"): "1f1b over transformers' ModelOutput",
    ("llama", "cp"): "allgather_kv attention, position_ids",
    ("cohere", "tp"): "parallel block, LayerNorm, logit scale, tied lm_head",
    ("cohere", "cp"): "parallel block under cp",
    ("gemma2", "tp"): "sliding/full layers, softcapping, pre/post norms",
    ("gpt2", "tp"): "Conv1D fused c_attn, learned positions, tied lm_head",
    ("gpt2", "cp"): "learned positions under cp",
    ("qwen2", "pp"): "q/k/v biases under pp",
    ("phi3", "cp"): "fused qkv under cp",
    ("mixtral", "ep"): "experts dispatched over ep 2",
    ("qwen3_moe", "ep"): "per-head q/k norms, experts over ep 2",
    ("doge", "tp"): "per-KV-head A sharded, dt_proj reduce-scattered onto this rank's heads (plain: SP refused)",
    ("esmc", "tp"): "LayerNorm q/k norms over the whole projection (projection_norm)",
    ("muse_glimmer_text", "tp"): "a vocab-parallel embedding holding a norm child",
    ("hrm_text", "cp"): "attention in two block lists (H_module, L_module)",
    ("llama", "3d"): "pp 2 x tp 2 x dp_shard 2",
    ("qwen3_moe", "3d"): "tp 2 x ep 2 x dp_shard 4",
    ("gemma4_text", "tp"): "ep plan with tp entries, per-layer inputs (plain)",
    ("gpt_oss", "tp"): "experts over etp 2: interleaved gate/up, 2-D biases",
    ("inkling_text", "tp"): "router scoring its shared expert, normed embedding",
}


def zoo_case(model_type, axis, topologies):
    """One zoo item on this rank; raises when check refuses the plan (these pass today)."""
    import meshplan
    model, _ = build(model_type)
    found = check_axis(model, axis, is_moe(model))  # the zoo's plan: SP + loss parallel, else plain
    assert found["status"] == "ok", found
    plan = found["plan"]
    meshplan.check(model, plan, world_size=WORLD[axis]).raise_if_errors()
    with KeepFloat64():
        return run_item({"type": model_type, "axis": axis, "plan": plan}, topologies)


def cases(world):
    return {f"{t}_{a}": (lambda ctx, t=t, a=a: zoo_case(t, a, ctx)) for (t, a) in ZOO if WORLD[a] == world}


if __name__ == "__main__":
    dist.init_process_group("gloo")
    run_cases(cases(int(os.environ["WORLD_SIZE"])), setup=dict)
