"""Real gloo processes: a representative slice of the transformers zoo (``benchmarks/zoo.py``) on every axis.

Each case builds a tiny transformers model in float64 (``benchmarks/zoo_plans.build``), writes the zoo's plan for
one axis (``zoo_plans.check_axis``: ``from_hf``'s tp/ep plan, SP first then plain, the blocks, a pipeline or
context_parallel section), checks it, and runs ``zoo_dist.run_item``: ``meshplan.parallelize`` + one ``meshplan.train_step`` vs one device,
the loss and every gradient each rank holds within 1e-9 relative (the model code's fp32 casts kept float64).
"""

import contextlib
import copy
import functools
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from _launch import run_cases

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "benchmarks"))
from zoo_dist import TOL, KeepFloat64, keep_float64_in_recompute, run_item  # noqa: E402
from zoo_plans import WORLD, axis_plan, batch, build, check_axis, is_moe, loss_sum  # noqa: E402

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
    ("qwen3", "sel"): "selective recompute (policy megatron) under tp 2 + SP, per-head q/k norms",
    ("qwen3", "cpdoc"): "ring cp over packed documents laid out by work (position_ids restarting)",
    ("qwen2", "ppkw"): "position_ids and a padding attention_mask as keyword inputs of both stages",
    ("gpt2", "vocab"): "vocab_parallel ends: tied lm_head, learned positions (wpe) outside the blocks; chunked "
                       "reduce-scatter, no prefetch",
    ("cohere2", "vocab"): "vocab_parallel ends: tied lm_head with a logit scale, sliding/full layers",
    ("mixtral", "vocab"): "vocab_parallel ends around FSDP2 units holding MoE experts",
    ("qwen2", "ppvocab"): "pp 2 x dp_shard 2, vocab_parallel ends on both stages, accumulate_unsharded false",
}


def zoo_case(model_type, axis, topologies):
    """One zoo item on this rank; raises when check refuses the plan (these pass today)."""
    import meshplan
    model, _ = build(model_type)
    found = check_axis(model, axis, is_moe(model))  # the zoo's plan: SP + loss parallel, else plain
    assert found["status"] == "ok", found
    plan = found["plan"]
    meshplan.check(model, plan, world_size=WORLD[axis]).raise_if_errors()
    with KeepFloat64(), keep_float64_in_recompute():
        out = run_item({"type": model_type, "axis": axis, "plan": plan}, topologies)
    assert axis != "cpdoc" or out["by_documents"], out  # laid out by work, not the row layout
    return out


# (model type, layout) on 8 ranks beyond the zoo's own 3-D layout (etp 1): experts split over etp with FSDP2 over
# edp; the grads of a packed gate|up held (_StridedShard(0), Shard(0), _StridedShard(1)), which torch's
# full_tensor could not gather (issue 24)
ETP = {"mixtral": {"tp": 2, "ep": 2, "etp": 2, "dp_shard": 4}}
STEPS, LR, MOMENTUM, MAX_NORM = 3, 0.5, 0.9, 0.05


class SgdRecorder(torch.optim.SGD):
    """SGD with momentum that keeps each step's (clipped) gradients, ``{id(param): grad}`` per step."""

    def __init__(self, params):
        super().__init__(params, lr=LR, momentum=MOMENTUM)
        self.grads: list[dict] = []

    @torch.no_grad()
    def step(self, closure=None):
        self.grads.append({id(p): p.grad.detach().clone() for g in self.param_groups for p in g["params"]
                           if p.grad is not None})
        return super().step(closure)


def _one_device(model):
    """``[(loss, norm, {name: clipped grad})]`` per step, the final ``{name: param}`` and ``{name: momentum}`` of
    plain SGD with torch's clipping on the global batch."""
    opt, out = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM), []
    for s in range(STEPS):
        x, y = batch(model, s)
        loss = loss_sum(model(x), y) / (y != -100).sum()
        loss.backward()
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM))
        out.append((float(loss), norm, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return out, {n: p.detach().clone() for n, p in model.named_parameters()}, \
        {n: opt.state[p]["momentum_buffer"] for n, p in model.named_parameters()}


def _rel(got, want) -> float:
    from torch.distributed.tensor import DTensor
    got = got.full_tensor() if isinstance(got, DTensor) else got
    return float((got - want).norm()) / max(float(want.norm()), 1e-300)


def etp_train(model_type, layout):
    """3 SGD steps with clipping (``max_grad_norm`` below every step's norm) on ``layout`` vs one device: loss, norm,
    every clipped gradient (``full_tensor``) and the final parameters within ``TOL``; then ``meshplan.save`` and
    ``meshplan.load`` into a plain model (every rank) and into a freshly parallelized one with its optimizer: the
    trained parameters and momentum buffers."""
    import meshplan
    with KeepFloat64():
        model, _ = build(model_type)
        ref_steps, ref_params, ref_momentum = _one_device(copy.deepcopy(model))
        plan = {**axis_plan(model, "3d", True), "layout": layout}
        meshplan.check(model, plan, world_size=dist.get_world_size()).raise_if_errors()
        topo = meshplan.build_mesh(layout)
        pmodel = meshplan.parallelize(model, plan, topo)
        opt, errs, placements = SgdRecorder(pmodel.parameters()), [], {}
        for s, (ref_loss, ref_norm, ref_grads) in enumerate(ref_steps):
            x, y = batch(pmodel, s)
            rows, r = x.shape[0] // topo.data_world_size, topo.data_rank
            res = meshplan.train_step(pmodel, (x[r * rows:(r + 1) * rows], y[r * rows:(r + 1) * rows]), loss_sum,
                                      opt, max_grad_norm=MAX_NORM)
            errs += [abs(res.loss - ref_loss) / abs(ref_loss), abs(res.grad_norm - ref_norm) / ref_norm]
            assert ref_norm > MAX_NORM, (s, ref_norm)
            for n, p in pmodel.named_parameters():
                errs.append(_rel(opt.grads[s][id(p)], ref_grads[n.replace("_checkpoint_wrapped_module.", "")]))
                if "experts" in n and s == 0:
                    placements[n.rsplit(".", 1)[-1]] = str(p.placements)
        names = {n.replace("_checkpoint_wrapped_module.", ""): p for n, p in pmodel.named_parameters()}
        errs += [_rel(names[n], want) for n, want in ref_params.items()]
        root = [tempfile.mkdtemp(prefix="etp-", dir=os.environ.get("MESHPLAN_CASE_OUT"))
                if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(root, src=0)
        meshplan.save(Path(root[0]) / "step-3", pmodel, opt, step=3)
        plain, _ = build(model_type, seed=1)
        meshplan.load(Path(root[0]) / "step-3", plain)
        fresh = meshplan.parallelize(build(model_type, seed=1)[0], plan, topo)
        fresh_opt = torch.optim.SGD(fresh.parameters(), lr=LR, momentum=MOMENTUM)
        meshplan.load(Path(root[0]) / "step-3", fresh, fresh_opt)
        loaded = [_rel(p, ref_params[n]) for n, p in plain.named_parameters()]
        for n, p in fresh.named_parameters():
            n = n.replace("_checkpoint_wrapped_module.", "")
            loaded += [_rel(p, ref_params[n]), _rel(fresh_opt.state[p]["momentum_buffer"], ref_momentum[n])]
    return {"worst": max(errs), "compared": len(errs), "loaded_worst": max(loaded), "loaded": len(loaded),
            "placements": placements}


def cases(world):
    out = {f"{t}_{a}": (lambda ctx, t=t, a=a: zoo_case(t, a, ctx)) for (t, a) in ZOO if WORLD[a] == world}
    if world == 8:
        out.update({f"{t}_etp": (lambda ctx, t=t: etp_train(t, ETP[t])) for t in ETP})
    return out


#: the cases share groups (tests/_launch.py releases them after the last case, not after each)
KEEPS_GROUPS = True


def launch_cases():
    """This launch's cases and the context they run in (``tests/dist/suite_worker.py`` runs several workers' in one
    launch)."""
    ctx: dict = {}  # shared by the cases, as run_cases(setup=dict) gives
    return {k: functools.partial(fn, ctx) for k, fn in cases(int(os.environ["WORLD_SIZE"])).items()}, \
        contextlib.nullcontext


if __name__ == "__main__":
    dist.init_process_group("gloo")
    run_cases(launch_cases()[0])
