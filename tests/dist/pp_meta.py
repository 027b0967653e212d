"""Pipelined models from the meta device on real gloo ranks (cases of ``pp_worker.py``'s launches).

``meta_checkpoint``: transformers' Llama built on meta, parallelized, loaded from a ``save_pretrained``
checkpoint (each rank reads only its stages' slices) trains with the losses and parameters of the same model
built on the CPU and parallelized alike (SGD, fp32, ``TOL`` = 1e-5 absolute on each loss, the one fixed
tolerance of the brief). ``meta_materialize``: examples' Llama materialized on meta with seed 0 equals
``torch.manual_seed(0); build(args)`` on every rank's stages (``torch.equal``: the same random stream).
"""

import functools
import shutil
import tempfile

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import meshplan
from dp_worker import sum_ce  # the summed loss of gathered logits (tp: a DTensor)
from examples import hf_models
from llama import build, tiny_args

TOL, STEPS, LR = 1e-5, 3, 0.1


def _plan(layout, rules, dp=None):
    plan = {"layout": layout, "blocks": {"pattern": "model.layers.*"},
            "pipeline": {"schedule": "1f1b", "microbatches": 2}, **({"data_parallel": dp} if dp else {})}
    if layout.get("tp", 1) > 1:
        plan["tensor_parallel"] = {"sequence_parallel": True, "rules": rules}
    return plan


def _shared_dir():
    """A temporary directory rank 0 makes and every rank (one machine) is told."""
    box = [tempfile.mkdtemp(prefix="meshplan_pp_meta_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _train(model, vocab):
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    g = torch.Generator().manual_seed(5)
    losses = []
    for _ in range(STEPS):
        x = torch.randint(0, vocab, (4, 16), generator=g)
        res = meshplan.train_step(model, (x, x), lambda out, y: sum_ce(getattr(out, "logits", out), y), opt)
        losses.append(res.loss)
    return losses


def _full(p):
    return (p.full_tensor() if isinstance(p, DTensor) else p).detach()


def meta_checkpoint(layout, rules, dp=None):
    """Meta → parallelize → load_safetensors → 3 SGD steps, vs the CPU-built model parallelized alike (``dp``: a
    data_parallel section)."""
    make = functools.partial(hf_models.llama, num_hidden_layers=4)
    path = _shared_dir()
    torch.manual_seed(0)
    full = make()
    if dist.get_rank() == 0:
        full.save_pretrained(path, max_shard_size="40KB")  # several files and an index: read slice by slice
    dist.barrier()
    topo = meshplan.build_mesh(layout)
    cpu = meshplan.parallelize(full, _plan(layout, rules, dp), topo)
    with torch.device("meta"):
        meta = make()
    meta = meshplan.load_safetensors(meshplan.parallelize(meta, _plan(layout, rules, dp), topo), path)
    held = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in meta.parameters())
    want, got = _train(cpu, 128), _train(meta, 128)
    cpu_params = dict(cpu.named_parameters())
    worst = max(float((_full(p) - _full(cpu_params[n])).abs().max()) for n, p in meta.named_parameters())
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(path)
    assert all(abs(a - b) <= TOL for a, b in zip(got, want)), (got, want)
    assert worst <= TOL, worst
    assert held < sum(p.numel() for p in make().parameters()), held  # its stages (and tp shards) only
    return {"worst": 0.0, "loss": got, "params": held, "max_param_diff": worst}  # held to TOL above


def meta_materialize(layout, rules):
    """Meta → parallelize → materialize(seed=0) equals the seeded CPU construction on this rank's stages."""
    args = tiny_args(n_layers=4)
    torch.manual_seed(0)
    cpu = build(args)
    with torch.device("meta"):
        meta = build(args)
    plan = {**_plan(layout, rules), "blocks": {"pattern": "layers.*"}}
    model = meshplan.materialize(meshplan.parallelize(meta, plan, meshplan.build_mesh(layout)), seed=0)
    want = cpu.state_dict()
    for name, t in model.state_dict().items():
        assert torch.equal(_full(t), want[name]), name
    return {"worst": 0.0, "loss": [], "params": len(model.state_dict())}
