"""Real gloo processes: the example MoE decoder (examples/moe.py) trained through ``meshplan.parallelize`` +
``meshplan.train_step`` with expert parallelism vs one device, over 3 AdamW steps with clipping, in float64.

Every case checks, on every rank, each parameter after training (‖Δ‖/‖ref‖ ≤ ``RTOL``), each step's loss and
pre-clip gradient norm (``RTOL`` relative; 1e-9, fixed: ``tests/_float64.py``) against a float64 one device on the same global batch (targets masked unevenly, so token counts
differ per rank). No token is dropped (``capacity_factor=None``) and the auxiliary loss is not trained (it is a
per-rank statistic, see examples/moe.py). Layouts: ep over the data ranks, ep over the tp ranks (MoE parallel
folding, etp 1, with and without sequence parallelism), expert FSDP over edp, HSDP, pipeline stages, activation
checkpointing, a shared expert and a dense first layer, cp 2 × ep 2 (the ep group spans the cp ranks), and
experts split over etp = tp 2 (with and without sequence parallelism, with FSDP2 over edp 2 at world 8).
"""

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

import meshplan
from _float64 import float64_model, keep_float64
from _launch import run_cases
from cp_worker import _compare, _train_ref, global_batch
from dp_worker import sum_ce
from moe import build, tiny_args

WORLD = int(os.environ["WORLD_SIZE"])
GLOBAL_BATCH, STEPS, MAX_NORM = 4, 3, 0.5
EP_RULES = {"layers.*.moe.experts": "experts", "layers.*.moe.router": "router"}
TP_RULES = {
    "tok_embeddings": "embedding", "layers.*.attention_norm": "norm", "layers.*.attention.wq": "colwise",
    "layers.*.attention.wk": "colwise", "layers.*.attention.wv": "colwise", "layers.*.attention.wo": "rowwise",
    "layers.*.ffn_norm": "norm", "norm": "norm", "output": "lm_head",
}
DENSE_RULES = {"layers.*.feed_forward.w1": "colwise", "layers.*.feed_forward.w3": "colwise",
               "layers.*.feed_forward.w2": "rowwise"}


def model_case(layout, tp=None, args=None, blocks=None, pipeline=None, data_parallel=None, plan_file=None,
               context=None):
    """The example MoE decoder under ``layout`` (with tensor-parallel rules when ``tp`` says sequence_parallel)."""
    args = args or tiny_args(aux_loss_coef=0.0, capacity_factor=None)
    torch.manual_seed(0)
    ref = float64_model(build(args))
    ref_losses, ref_norms = _train_ref(
        ref, lambda s: global_batch(s, args.vocab_size),
        lambda m, x, y: F.cross_entropy(m(x).flatten(0, 1), y.flatten(), ignore_index=-100))
    plan = plan_file or {"layout": layout, "expert_parallel": {"rules": EP_RULES}}
    if tp is not None:
        rules = {**TP_RULES, **(DENSE_RULES if args.n_dense_layers else {})}
        plan["tensor_parallel"] = {"sequence_parallel": tp, "loss_parallel": True, "rules": rules}
    for key, value in (("blocks", blocks), ("pipeline", pipeline), ("data_parallel", data_parallel),
                       ("context_parallel", context)):
        if value:
            plan[key] = value
    topo = meshplan.build_mesh(layout)
    torch.manual_seed(0)
    model = meshplan.parallelize(float64_model(build(args)), plan, topo)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    lp = plan_file is not None or tp is not None
    loss_fn = (lambda out, y: meshplan.cross_entropy(out, y, reduction="sum")) if lp else sum_ce
    rows, r = GLOBAL_BATCH // topo.data_world_size, topo.data_rank
    results = []
    for s in range(STEPS):
        x, y = global_batch(s, args.vocab_size)
        batch = (x[r * rows:(r + 1) * rows], y[r * rows:(r + 1) * rows])
        results.append(meshplan.train_step(model, batch, loss_fn, opt, max_grad_norm=MAX_NORM))
    return _compare(model, ref, results, ref_losses, ref_norms)


def tokens_reach_experts_once():
    """tp 2 × ep 2 without sequence parallelism: every tp rank has the whole sequence, but each token reaches its
    experts once (each rank routes its half), so the experts see exactly the global batch's token copies."""
    args = tiny_args(aux_loss_coef=0.0)
    layout = {"tp": 2, "ep": 2, "etp": 1}
    plan = {"layout": layout, "expert_parallel": {"rules": EP_RULES},
            "tensor_parallel": {"sequence_parallel": False, "loss_parallel": False, "rules": TP_RULES}}
    topo = meshplan.build_mesh(layout)
    torch.manual_seed(0)
    model = meshplan.parallelize(build(args), plan, topo)
    x, _ = global_batch(0, args.vocab_size)
    model(x)
    routed = model.layers[0].moe.tokens_per_expert.sum()
    dist.all_reduce(routed)
    assert int(routed) == x.numel() * args.top_k * topo.data_world_size, (int(routed), x.numel())
    return {"copies": int(routed)}


def meta_init(layout, tp=None, args=None):
    """A meta-device build, parallelized and materialized with a seed, equals the one-device model built with it
    (the expert shards included: each rank draws the one-device stream and keeps its experts)."""
    args = args or _args(shared_expert=True)
    plan = {"layout": layout, "expert_parallel": {"rules": EP_RULES}}
    if tp is not None:
        plan["tensor_parallel"] = {"sequence_parallel": tp, "loss_parallel": True, "rules": TP_RULES}
    topo = meshplan.build_mesh(layout)
    with torch.device("meta"):
        model = build(args)
    meshplan.materialize(meshplan.parallelize(model, plan, topo), seed=0)
    torch.manual_seed(0)
    ref = dict(build(args).named_parameters())
    for name, p in model.named_parameters():
        full = p.full_tensor() if isinstance(p, torch.distributed.tensor.DTensor) else p
        assert torch.equal(full.detach(), ref[name.replace("_checkpoint_wrapped_module.", "")].detach()), name
    return {"parameters": len(ref)}


def sharded_init(layout):
    """materialize(mode="sharded") of the MoE decoder (experts over ep, attention over tp), then 3 SGD steps."""
    from init_sharded import sharded_then_train
    args = _args(shared_expert=True)
    plan = {"layout": layout, "expert_parallel": {"rules": EP_RULES},
            "tensor_parallel": {"sequence_parallel": True, "loss_parallel": True, "rules": TP_RULES}}
    return sharded_then_train(lambda: build(args), plan, layout, args.vocab_size)


def _args(**kw):
    return tiny_args(aux_loss_coef=0.0, capacity_factor=None, **kw)


CASES_2 = {
    "ep2": lambda: model_case({"ep": 2}),
    "ep2_shared_dense": lambda: model_case({"ep": 2}, args=_args(shared_expert=True, n_dense_layers=1)),
    "ep2_checkpointed": lambda: model_case({"ep": 2}, blocks={"pattern": "layers.*",
                                                              "activation_checkpointing": {"mode": "full"}}),
    "ep2_ddp": lambda: model_case({"ep": 2, "dp_replicate": 2}),
    "ep1_tp2": lambda: model_case({"tp": 2, "etp": 1}, tp=True),
    "ep2_tp2_sp": lambda: model_case({"tp": 2, "ep": 2, "etp": 1}, tp=True),
    "ep2_meta_init": lambda: meta_init({"ep": 2}),
    "etp2": lambda: model_case({"tp": 2, "etp": 2}, tp=True, args=_args(shared_expert=True)),
    "etp2_no_sp": lambda: model_case({"tp": 2, "etp": 2}, tp=False),
    "cp2_ep2": lambda: model_case({"cp": 2, "ep": 2}, context={"attention": "layers.*.attention",
                                                               "positions": {"buffer": "freqs_cis"}}),
}
CASES_4 = {
    "ep4": lambda: model_case({"ep": 4}, args=_args(n_experts=8)),
    "ep2_tp2_sp": lambda: model_case({"tp": 2, "ep": 2, "etp": 1}, tp=True, args=_args(shared_expert=True)),
    "ep2_tp2_plan_file": lambda: model_case({"tp": 2, "ep": 2, "etp": 1}, plan_file="plans/moe.yaml"),
    "ep2_tp2_no_sp": lambda: model_case({"tp": 2, "ep": 2, "etp": 1}, tp=False),
    "tokens_once": tokens_reach_experts_once,
    "ep2_edp2": lambda: model_case({"ep": 2}),
    # 1 local expert over edp 2: FSDP2 shards an inner dim (each edp rank half of the expert), not the experts dim
    "ep2_edp2_one_expert": lambda: model_case({"ep": 2}, args=_args(n_experts=2)),
    "ep2_edp2_one_expert_meta_init": lambda: meta_init({"ep": 2}, args=_args(n_experts=2)),
    "ep2_hsdp": lambda: model_case({"ep": 2, "dp_replicate": 2}, data_parallel={"mode": "hsdp"}),
    "ep4_tp2": lambda: model_case({"tp": 2, "ep": 4, "etp": 1}, tp=True, args=_args(n_experts=8)),
    "ep2_tp2_meta_init": lambda: meta_init({"tp": 2, "ep": 2, "etp": 1}, tp=True),
    "ep2_etp2_meta_init": lambda: meta_init({"tp": 2, "ep": 2, "etp": 2}, tp=True),
    "ep2_tp2_sharded_init": lambda: sharded_init({"tp": 2, "ep": 2, "etp": 1}),
    "ep2_etp2": lambda: model_case({"tp": 2, "ep": 2, "etp": 2}, tp=True, args=_args(shared_expert=True)),
    "ep2_etp2_no_sp": lambda: model_case({"tp": 2, "ep": 2, "etp": 2}, tp=False),
    "pp2_ep2": lambda: model_case({"pp": 2, "ep": 2}, args=_args(n_layers=2),
                                  pipeline={"schedule": "1f1b", "microbatches": 2}),
}

CASES_8 = {
    "ep2_etp2_edp2": lambda: model_case({"tp": 2, "ep": 2, "etp": 2}, tp=True, args=_args(n_experts=4)),
    "ep4_tp2_edp2": lambda: model_case({"tp": 2, "ep": 4, "etp": 1}, tp=True, args=_args(n_experts=8)),
}

def launch_cases():
    """This launch's cases and the context they run in (``tests/dist/suite_worker.py`` runs several workers' in one
    launch)."""
    return {2: CASES_2, 4: CASES_4, 8: CASES_8}[WORLD], keep_float64


if __name__ == "__main__":
    dist.init_process_group("gloo")
    with keep_float64():
        run_cases(launch_cases()[0])
