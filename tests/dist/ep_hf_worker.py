"""Real gloo processes: transformers' mixture-of-experts models (Mixtral, Qwen3-MoE, Qwen2-MoE with its gated
shared expert), unmodified, trained with the plan ``meshplan.hf.from_hf(model_type, ep=…)`` writes (experts from
the config's ``base_model_ep_plan``, ``interface: topk``) through ``meshplan.parallelize`` + ``meshplan.train_step``
with the model's own loss, vs one device over 3 SGD steps (momentum), in float64 (``tests/_float64.py``): every
parameter within ‖Δ‖/‖ref‖ ≤ ``RTOL``, each step's loss and gradient norm within ``RTOL`` relative (1e-9, fixed). transformers' default experts implementation (``grouped_mm``) runs on the local experts.
"""

import json
import os
import tempfile

import torch
import torch.distributed as dist

import meshplan
from _float64 import float64_model, keep_float64
from _launch import run_cases
from cp_worker import _compare, _train_ref, global_batch
from meshplan.hf.convert import from_hf

WORLD = int(os.environ["WORLD_SIZE"])
GLOBAL_BATCH = 4


def sgd(params):
    """SGD with momentum (chosen when this ran in float32, where AdamW amplified reduction-order noise)."""
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def hf_moe_case(arch, layout, sequence_parallel=True, **overrides):
    """``arch`` (an examples/hf_models factory) under ``layout`` with the converted plan vs one device."""
    import hf_models
    factory = getattr(hf_models, arch)
    torch.manual_seed(0)
    ref = float64_model(factory(**overrides))
    vocab = ref.config.vocab_size
    ref_losses, ref_norms = _train_ref(ref, lambda s: (global_batch(s, vocab)[1],),
                                       lambda m, y: m(input_ids=y.clamp(min=0), labels=y).loss, sgd)
    source = arch
    if overrides:  # the converter reads the model's own config (e.g. its dense layers), as a config.json
        source = os.path.join(tempfile.mkdtemp(prefix="meshplan-ep-hf-"), "config.json")
        with open(source, "w") as f:
            json.dump({"model_type": arch, **overrides}, f)
    plan = from_hf(source, ep=layout.get("ep", 1), tp=layout.get("tp", 1), sequence_parallel=sequence_parallel)
    plan.pop("_origin")
    plan["layout"], plan["blocks"] = layout, {"pattern": "model.layers.*"}
    topo = meshplan.build_mesh(layout)
    torch.manual_seed(0)
    model = meshplan.parallelize(float64_model(factory(**overrides)), plan, topo)
    opt = sgd(model.parameters())
    rows, r = GLOBAL_BATCH // topo.data_world_size, topo.data_rank
    results = []
    for s in range(3):
        y = global_batch(s, vocab)[1][r * rows:(r + 1) * rows]
        results.append(meshplan.train_step(model, {"input_ids": y.clamp(min=0), "labels": y}, None, opt,
                                           max_grad_norm=0.5))
    return _compare(model, ref, results, ref_losses, ref_norms)


CASES = {
    2: {
        "mixtral_ep2": lambda: hf_moe_case("mixtral", {"ep": 2}),
        "qwen2_moe_ep2": lambda: hf_moe_case("qwen2_moe", {"ep": 2}),
    },
    4: {
        "mixtral_ep4": lambda: hf_moe_case("mixtral", {"ep": 4}),
        "mixtral_tp2_ep2": lambda: hf_moe_case("mixtral", {"tp": 2, "ep": 2, "etp": 1}),
        "mixtral_tp2_etp2": lambda: hf_moe_case("mixtral", {"tp": 2, "ep": 2, "etp": 2}),
        "qwen3_moe_ep2_edp2": lambda: hf_moe_case("qwen3_moe", {"ep": 2}),
        "qwen3_moe_tp2_ep2": lambda: hf_moe_case("qwen3_moe", {"tp": 2, "ep": 2, "etp": 1}),
        "qwen2_moe_tp2_ep2": lambda: hf_moe_case("qwen2_moe", {"tp": 2, "ep": 2, "etp": 1}),
        # dense MLP layers (mlp_only_layers) keep transformers' colwise/rowwise rules beside the MoE blocks
        "qwen3_moe_mixed_tp2_ep2": lambda: hf_moe_case("qwen3_moe", {"tp": 2, "ep": 2, "etp": 1},
                                                       mlp_only_layers=[0]),
        "qwen2_moe_tp2_ep2_no_sp": lambda: hf_moe_case("qwen2_moe", {"tp": 2, "ep": 2, "etp": 1},
                                                       sequence_parallel=False),
    },
}

if __name__ == "__main__":
    dist.init_process_group("gloo")
    with keep_float64():
        run_cases(CASES[WORLD])
