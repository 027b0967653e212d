"""Real gloo processes (world 4), run in the launch of ``ckpt_worker.py``: full safetensors exports read without
meshplan, and transformers checkpoints read into pipeline, context- and expert-parallel plans.

Export cases: a model trained one AdamW step under a plan is exported with ``meshplan.export_safetensors``; every
rank then reads the files with plain ``safetensors`` + ``load_state_dict(strict=True)`` into an unparallelized
model (and transformers' ``from_pretrained`` for a transformers model): each tensor must equal the trained
model's, gathered. Import cases: transformers' own ``save_pretrained`` writes a model; ``meshplan.load_safetensors``
reads it into a model built from another seed under the plan: every shard must equal the saved model's rows, and the
first step's loss the saved model's loss on the same global batch (1e-5 relative: another reduction order).
"""

import warnings

import torch
import torch.distributed as dist

import meshplan
from ckpt_worker import GLOBAL_BATCH, MODELS, PLANS, REPO, SEQ, Run, _differ, full_state, reshard, shared_dir
from meshplan.checkpoint.export import INDEX

warnings.filterwarnings("ignore")
HF_LLAMA = meshplan.load_plan(REPO / "plans/hf_llama.yaml").model_dump(mode="json", exclude_unset=True)
HF_PIPE = {"blocks": {"pattern": "model.layers.*"}, "pipeline": {"schedule": "1f1b", "microbatches": 2}}
HF_MIXTRAL = {**meshplan.load_plan(REPO / "plans/hf_mixtral_ep.yaml").model_dump(mode="json", exclude_unset=True),
              "blocks": {"pattern": "model.layers.*"}}
PLANS.update({
    "hf_pp2tp2": {**HF_LLAMA, **HF_PIPE, "layout": {"pp": 2, "tp": 2}},
    "hf_cp2tp2": meshplan.load_plan(REPO / "plans/hf_llama_cp.yaml").model_dump(mode="json", exclude_unset=True),
    "hf_tp2ep2": HF_MIXTRAL,  # tp 2 × ep 2, etp 1
    "hf_tp2ep2etp2": {**HF_MIXTRAL, "layout": {"tp": 2, "ep": 2, "etp": 2}},  # gate|up split over etp (strided)
    "hf_ep4": {"layout": {"ep": 4}, "expert_parallel": HF_MIXTRAL["expert_parallel"], "blocks": HF_MIXTRAL["blocks"]},
})


def _hf(name):
    def build(seed):
        from examples import hf_models
        torch.manual_seed(seed)
        return getattr(hf_models, name)()
    return build


MODELS.update({"hf_llama": _hf("llama"), "mixtral": _hf("mixtral")})


def _read(files):
    from safetensors.torch import load_file
    out = {}
    for f in files:
        out.update(load_file(str(f)))
    return out


def export(model_name, plan_name, max_shard_bytes=None):
    """Train one step under the plan, export, read back with plain safetensors (+ transformers)."""
    a = Run(model_name, plan_name, seed=0)
    a.step(0)
    ref = {k: v for k, v in full_state(a).items() if k.startswith("model.")}
    out = shared_dir() / "export"
    meshplan.export_safetensors(a.model, out, **({"max_shard_bytes": max_shard_bytes} if max_shard_bytes else {}))
    files = sorted(out.glob("*.safetensors"))
    plain = MODELS[model_name](seed=1)
    plain.load_state_dict(_read(files), strict=True)
    result = {"differ": _differ({"model." + k: v for k, v in plain.state_dict().items()}, ref),
              "files": [f.name for f in files], "index": (out / INDEX).is_file(), "compared": len(ref)}
    if a.hf:
        import transformers
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(out))
        result["hf_differ"] = _differ({"model." + k: v for k, v in hf.state_dict().items()}, ref)
        result["hf_class"] = type(hf).__name__
    return result


def hf_import(model_name, plan_name, step=True):
    """transformers' save_pretrained → meshplan.load_safetensors under the plan: shards and first loss."""
    out = shared_dir() / "hf"
    ref = MODELS[model_name](seed=0)
    if dist.get_rank() == 0:
        ref.save_pretrained(str(out))
    dist.barrier()
    b = Run(model_name, plan_name, seed=1)
    meshplan.load_safetensors(b.model, out)
    got = {k: v for k, v in full_state(b).items() if k.startswith("model.")}
    result = {"differ": _differ(got, {"model." + k: v for k, v in ref.state_dict().items()}), "compared": len(got)}
    if not step:
        return result
    g = torch.Generator().manual_seed(3000)
    x = torch.randint(0, 128, (GLOBAL_BATCH, SEQ), generator=g)
    y = torch.randint(0, 128, (GLOBAL_BATCH, SEQ), generator=g)
    with torch.no_grad():
        logits = ref(input_ids=x).logits
        loss_ref = float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()))
    loss = b.step(0)
    return {**result, "loss": [loss_ref, loss], "rel": abs(loss - loss_ref) / abs(loss_ref)}


CASES = {
    "export_pp2tp2": lambda: export("llama", "pp2tp2"),
    "export_tied_pp2": lambda: export("tied", "pp2"),
    "export_moe_ep2_sharded": lambda: export("moe", "ep2", max_shard_bytes=100_000),
    "export_phi3_packed_fsdp": lambda: export("phi3", "packed_tp2"),
    "export_mixtral_etp2": lambda: export("mixtral", "hf_tp2ep2etp2"),
    "hf_to_pp2tp2": lambda: hf_import("hf_llama", "hf_pp2tp2"),
    "hf_to_cp2tp2": lambda: hf_import("hf_llama", "hf_cp2tp2"),
    "hf_mixtral_to_tp2ep2": lambda: hf_import("mixtral", "hf_tp2ep2"),
    "hf_mixtral_to_etp2": lambda: hf_import("mixtral", "hf_tp2ep2etp2"),
    "mixtral_etp2_to_ep4": lambda: reshard("mixtral", "hf_tp2ep2etp2", "hf_ep4"),
}
