"""Real gloo processes (world 4): checkpoints saved under one plan and loaded under another.

Each resharding case trains the model 2 AdamW steps under plan A, gathers every parameter and optimizer entry in
full (the reference), saves with ``meshplan.save``, and takes step 3 under A (the uninterrupted run). A model
built from ANOTHER seed under plan B then loads the checkpoint: every parameter, AdamW moment, step count and
hyperparameter must equal A's bit for bit, and B's step 3 loss must equal A's (exactly for the same plan; to fp32
reduction noise, 1e-6 relative, across plans). Layouts: tensor parallelism 2 → 4 (vocab-parallel embedding,
FSDP2's ``_StridedShard`` over tp), pipeline 2 → none, FSDP 4 → 2 (HSDP), pp × tp → FSDP only and back, cp 2 × tp 2
(plans/llama_cp.yaml) → tp 4, tied
embeddings across pipeline stages and back, expert parallelism 2 → 4 (and tp 2 × ep 2 → ep 4), packed fused
projections (Phi-3's q|k|v, ``_StridedShard``) at tp 2 × FSDP → tp 4 and → one plain model. The other cases:
asynchronous saves (the loop mutates the model while the checkpoint is written), keep-last-K and latest-complete
discovery through ``CheckpointManager``, and refusals (another model's checkpoint, another batch size), which
must be raised on every rank alike.
"""

import contextlib
import copy
import os
import tempfile
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
from torch.distributed.tensor import DTensor

import llama
import meshplan
import moe
from _launch import run_cases
from meshplan.checkpoint.chunks import boxes_of
from dp_worker import TP_RULES

warnings.filterwarnings("ignore")
WORLD = int(os.environ["WORLD_SIZE"])
REPO = Path(__file__).resolve().parents[2]
GLOBAL_BATCH, SEQ, LR = 8, 16, 1e-3
PIPE = {"blocks": {"pattern": "layers.*"}, "pipeline": {"schedule": "1f1b", "microbatches": 2}}
EP_RULES = {"layers.*.moe.experts": "experts", "layers.*.moe.router": "router"}
MOE_TP_RULES = {k: v for k, v in TP_RULES.items() if "feed_forward" not in k}
#: tied parameters: the name torch lists optimizer state under for the unsplit model
TIED = {"output.weight": "tok_embeddings.weight"}


def tp_plan(rules=TP_RULES, sp=True):
    return {"tensor_parallel": {"sequence_parallel": sp, "loss_parallel": True, "rules": rules}}


PHI3 = meshplan.load_plan(REPO / "plans/phi3_packed.yaml").model_dump(mode="json", exclude_unset=True)
PLANS = {
    "tp2": {"layout": {"tp": 2}, **tp_plan()},  # × dp_shard 2: FSDP2's _StridedShard over tp's Shard
    "tp4": {"layout": {"tp": 4}, **tp_plan()},
    "pp2": {"layout": {"pp": 2}, **PIPE},  # × dp_shard 2
    "fsdp4": {"layout": {}},
    "hsdp2x2": {"layout": {"dp_replicate": 2, "dp_shard": 2}},
    "pp2tp2": {"layout": {"pp": 2, "tp": 2}, **PIPE, **tp_plan()},
    "cp2tp2": meshplan.load_plan(REPO / "plans/llama_cp.yaml").model_dump(mode="json", exclude_unset=True),
    "ep2": {"layout": {"ep": 2}, "expert_parallel": {"rules": EP_RULES}},  # dense dp 4, experts edp 2
    "ep4": {"layout": {"ep": 4}, "expert_parallel": {"rules": EP_RULES}},
    "tp2ep2": {"layout": {"tp": 2, "ep": 2, "etp": 1}, "expert_parallel": {"rules": EP_RULES},
               **tp_plan(MOE_TP_RULES)},
    # transformers' Phi-3 with q|k|v and gate|up packed (plans/phi3_packed.yaml), FSDP2 over its decoder layers
    "packed_tp2": {**PHI3, "blocks": {"pattern": "model.layers.*"}},  # × dp_shard 2
    "packed_tp4": {**PHI3, "layout": {"tp": 4}},
}


def _llama(seed, tie=False):
    torch.manual_seed(seed)
    return llama.build(llama.tiny_args(n_kv_heads=4, tie_embeddings=tie))


def _moe(seed):
    torch.manual_seed(seed)
    return moe.build(moe.tiny_args(aux_loss_coef=0.0, capacity_factor=None))


def _phi3(seed):
    from examples.architectures import phi3_mha
    torch.manual_seed(seed)
    return phi3_mha()


MODELS = {"llama": _llama, "tied": lambda seed: _llama(seed, tie=True), "moe": _moe, "phi3": _phi3}


def shared_dir():
    """A fresh folder, the same on every rank (inside the launch's result folder: one folder left per launch)."""
    name = [tempfile.mkdtemp(prefix="ckpt-", dir=os.environ.get("MESHPLAN_CASE_OUT")) if dist.get_rank() == 0
            else None]
    dist.broadcast_object_list(name, src=0)
    return Path(name[0])


def batch(step, topo):
    g = torch.Generator().manual_seed(3000 + step)
    x = torch.randint(0, 128, (GLOBAL_BATCH, SEQ), generator=g)
    y = torch.randint(0, 128, (GLOBAL_BATCH, SEQ), generator=g)
    rows, r = GLOBAL_BATCH // topo.data_world_size, topo.data_rank
    return x[r * rows:(r + 1) * rows], y[r * rows:(r + 1) * rows]


def hf_loss(out, y):
    """The summed cross-entropy of a transformers model's logits (vocab-sharded under loss_parallel)."""
    return meshplan.cross_entropy(out.logits, y, reduction="sum")


class Run:
    """One model under one plan, with its AdamW and its steps."""

    def __init__(self, model_name, plan_name, seed, meta=False):
        plan = meshplan.Plan.from_data(PLANS[plan_name])
        self.topo = meshplan.build_mesh(plan.layout)
        with torch.device("meta") if meta else contextlib.nullcontext():
            model = MODELS[model_name](seed)
        self.hf = type(model).__module__.startswith("transformers")
        self.model = meshplan.parallelize(model, plan, self.topo)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=LR, weight_decay=0.1)

    def step(self, s):
        x, y = batch(s, self.topo)
        loss_fn = hf_loss if self.hf else meshplan.cross_entropy
        return float(meshplan.train_step(self.model, (x, y), loss_fn, self.opt).loss)


def full_state(run):
    """Every parameter, buffer and optimizer entry of the whole model, in full, on every rank: each rank's shards
    placed by the rows it holds (DTensor's ``full_tensor()`` trusts the placements' label, which for FSDP2 over a
    packed projection names other rows than the rank holds)."""
    msd = get_model_state_dict(run.model)
    osd = get_optimizer_state_dict(run.model, run.opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
    mine = {}
    for k, v in [*(("model." + k, v) for k, v in msd.items()), *(("optim." + k, v) for k, v in osd.items())]:
        if isinstance(v, DTensor):
            mine[k] = (tuple(v.shape), v.dtype, [(o, n, t.clone()) for o, n, t in boxes_of(v)])
        else:
            mine[k] = v.detach().clone() if isinstance(v, torch.Tensor) else v
    everyone = [None] * WORLD
    dist.all_gather_object(everyone, mine)
    out = {}
    for part in everyone:
        for k, v in part.items():
            if isinstance(v, tuple) and len(v) == 3 and isinstance(v[1], torch.dtype):
                full = out.setdefault(k, torch.full(v[0], float("nan"), dtype=v[1]))
                for o, n, t in v[2]:
                    full[tuple(slice(a, a + b) for a, b in zip(o, n))] = t
            else:
                out[k] = v
    return out


def _differ(got, ref):
    bad = []
    for k, v in got.items():
        r = ref.get(k, ref.get(next((k.replace(a, b) for a, b in TIED.items() if a in k), k)))
        same = torch.equal(v, r) if isinstance(v, torch.Tensor) and isinstance(r, torch.Tensor) else v == r
        if not same:
            bad.append(k)
    return bad


def _peak_rss_reset():
    """Reset this process's peak RSS (Linux: ``5`` to ``/proc/self/clear_refs``); the RSS now, in bytes."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status("VmRSS")


def _status(field):
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def reshard(model_name, src, dst, meta=False):
    """Train 2 steps under ``src``, save, step 3; load under ``dst`` (another init; ``meta``: built on the meta
    device, parallelized, the optimizer built over the meta parameters), compare, step 3."""
    root = shared_dir()
    a = Run(model_name, src, seed=0)
    for s in range(2):
        a.step(s)
    ref = full_state(a)
    meshplan.save(root / "step-2", a.model, a.opt, step=2, extra={"plan": src})
    loss_a = a.step(2)
    b = Run(model_name, dst, seed=1, meta=meta)
    before = _peak_rss_reset()
    saved = meshplan.load(root / "step-2", b.model, b.opt)
    peak = _status("VmHWM") - before
    assert not any(t.is_meta for t in [*b.model.parameters(), *b.model.buffers()])
    got = full_state(b)
    loss_b = b.step(2)
    assert saved.step == 2 and saved.extra == {"plan": src}, (saved.step, saved.extra)
    return {"differ": _differ(got, ref), "compared": len(got), "loss": [loss_a, loss_b],
            "rel": abs(loss_b - loss_a) / abs(loss_a), "rng_restored": saved.rng_restored, "load_peak_rss": peak,
            "held_bytes": _held_bytes(b)}


def _held_bytes(run):
    """This rank's parameter and optimizer bytes (local shards)."""
    local = [(t.to_local() if isinstance(t, DTensor) else t) for t in run.model.parameters()]
    local += [(t.to_local() if isinstance(t, DTensor) else t) for st in run.opt.state.values() for t in st.values()
              if isinstance(t, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in local)


def packed_to_plain():
    """Phi-3's packed q|k|v and gate|up (tp 2 × FSDP 2) saved as parallelized, loaded into a plain unsharded model
    on every rank: each weight equals the plain model it was parallelized from (the packed parts in their rows)."""
    root = shared_dir()
    a = Run("phi3", "packed_tp2", seed=0)  # untrained: its weights are the plain model's of seed 0
    ref = {"model." + k: v for k, v in _phi3(seed=0).state_dict().items()}
    meshplan.save(root / "step-1", a.model, step=1)
    plain = _phi3(seed=1)
    meshplan.load(root / "step-1", plain)
    got = {"model." + k: v for k, v in plain.state_dict().items()}
    return {"differ": _differ(got, ref), "compared": len(got)}


def async_and_keep_last():
    """CheckpointManager(every=1, keep=2, async_save=True): the loop changes the model right after save()
    returns, yet the checkpoint holds the model as it was; three saves leave the last two; a torn folder of a
    later step is ignored by discovery."""
    root = shared_dir()
    a = Run("llama", "tp2", seed=0)
    a.step(0)
    ref = full_state(a)
    ckpt = meshplan.CheckpointManager(root, every=1, keep=2, async_save=True)
    handle = ckpt.save(1, a.model, a.opt, data=meshplan.DataState(GLOBAL_BATCH, 0, GLOBAL_BATCH))
    a.step(1)  # mutates parameters and moments while the background thread writes
    ckpt.wait()
    assert handle.done()
    b = Run("llama", "tp4", seed=1)
    saved = meshplan.load(root / "step-00000001", b.model, b.opt, data=meshplan.DataState(GLOBAL_BATCH, 0))
    differ = _differ(full_state(b), ref)
    for s in (2, 3):
        ckpt.save(s, a.model, a.opt)
    ckpt.wait()
    if dist.get_rank() == 0:  # a torn save of a later step: a .partial folder with some shards in it
        torn = root / "step-00000009.partial"
        torn.mkdir()
        (torn / "__0_0.distcp").write_bytes(b"torn")
    dist.barrier()
    latest = ckpt.latest()
    ckpt.close()
    names = sorted(p.name for p in root.iterdir())
    return {"differ": differ, "folders": names, "latest": latest.name,
            "data": saved.data.to_json()}


def _error(fn):
    try:
        fn()
    except meshplan.PlanError as e:
        return str(e)
    return None


def refusals():
    """Errors, the same on every rank, before any tensor moves."""
    root = shared_dir()
    a = Run("llama", "tp2", seed=0)
    a.step(0)
    meshplan.save(root / "step-1", a.model, a.opt, step=1, data=meshplan.DataState(GLOBAL_BATCH, 0, GLOBAL_BATCH))
    meshplan.save(root / "model-only", a.model, step=1)
    other = Run("moe", "ep2", seed=0)
    b = Run("llama", "tp4", seed=1)
    out = {
        "other_model": _error(lambda: meshplan.load(root / "step-1", other.model, other.opt)),
        "batch": _error(lambda: meshplan.load(root / "step-1", b.model, b.opt, data=meshplan.DataState(16, 0))),
        "seed": _error(lambda: meshplan.load(root / "step-1", b.model, b.opt, data=meshplan.DataState(8, 1))),
        "no_optimizer": _error(lambda: meshplan.load(root / "model-only", b.model, b.opt)),
        "partial": _error(lambda: meshplan.load(root / "step-1.partial", b.model)),
    }
    meta = Run("moe", "ep2", seed=0, meta=True)  # refused from the metadata, before its shards are allocated
    out["meta_other_model"] = _error(lambda: meshplan.load(root / "step-1", meta.model, meta.opt))
    out["meta_still_meta"] = all(t.is_meta for t in meta.model.parameters())
    allowed = meshplan.load(root / "step-1", b.model, b.opt, data=meshplan.DataState(16, 0), allow_batch_change=True)
    out["allowed"] = allowed.data.to_json()
    return out


def full_tensor_packed():
    """Which doc is right (issue 29): DTensor's ``full_tensor()`` of Phi-3's packed q|k|v and gate|up against the
    plain model's weight, under tp 4 alone and under tp 2 × FSDP2 2 (the names of the packed weights that differ)."""
    ref = dict(_phi3(seed=0).named_parameters())
    out = {}
    for plan in ("packed_tp4", "packed_tp2"):
        model = Run("phi3", plan, seed=0).model  # untrained: its weights are the plain model's of seed 0
        packed = [(n, p) for n, p in model.named_parameters() if n.endswith(("qkv_proj.weight", "gate_up_proj.weight"))]
        out[plan] = {"packed": len(packed),
                     "differ": [n for n, p in packed if not torch.equal(p.full_tensor(), ref[n].detach())]}
    return out


CASES = {
    "full_tensor_packed": full_tensor_packed,
    "tp2_same_plan": lambda: reshard("llama", "tp2", "tp2"),
    "tp2_to_tp4": lambda: reshard("llama", "tp2", "tp4"),
    "pp2_to_fsdp4": lambda: reshard("llama", "pp2", "fsdp4"),
    "fsdp4_to_hsdp2x2": lambda: reshard("llama", "fsdp4", "hsdp2x2"),
    "pp2tp2_to_fsdp4": lambda: reshard("llama", "pp2tp2", "fsdp4"),
    "fsdp4_to_pp2tp2": lambda: reshard("llama", "fsdp4", "pp2tp2"),
    "cp2tp2_to_tp4": lambda: reshard("llama", "cp2tp2", "tp4"),
    "tied_pp2_to_fsdp4": lambda: reshard("tied", "pp2", "fsdp4"),
    "tied_fsdp4_to_pp2": lambda: reshard("tied", "fsdp4", "pp2"),
    "ep2_to_ep4": lambda: reshard("moe", "ep2", "ep4"),
    "tp2ep2_to_ep4": lambda: reshard("moe", "tp2ep2", "ep4"),
    "packed_tp2_to_tp4": lambda: reshard("phi3", "packed_tp2", "packed_tp4"),
    "packed_to_plain": packed_to_plain,
    # into meta models: only this rank's shards allocated, then read (issue 27)
    "meta_tp2_to_pp2tp2": lambda: reshard("llama", "tp2", "pp2tp2", meta=True),
    "meta_fsdp4_to_tp4": lambda: reshard("llama", "fsdp4", "tp4", meta=True),
    "meta_tied_fsdp4_to_pp2": lambda: reshard("tied", "fsdp4", "pp2", meta=True),
    "meta_tp2_to_cp2tp2": lambda: reshard("llama", "tp2", "cp2tp2", meta=True),
    "meta_ep2_to_tp2ep2": lambda: reshard("moe", "ep2", "tp2ep2", meta=True),
    "meta_packed_tp2_to_tp4": lambda: reshard("phi3", "packed_tp2", "packed_tp4", meta=True),
    "async_and_keep_last": async_and_keep_last,
    "refusals": refusals,
}

def launch_cases():
    """This launch's cases and the context they run in (``tests/dist/suite_worker.py`` runs several workers' in one
    launch)."""
    from export_worker import CASES as EXPORT_CASES  # the same launch
    return {**CASES, **EXPORT_CASES}, contextlib.nullcontext


if __name__ == "__main__":
    dist.init_process_group("gloo")
    run_cases(launch_cases()[0])
