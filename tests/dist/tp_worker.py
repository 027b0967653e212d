"""Real gloo processes: TP parity over 3 AdamW steps vs one device in float64 (dropout 0, and dropout 0.1 with
dropout_rng single_device, also under activation checkpointing), and per-shard dropout streams.

Parity runs build the model in float64 (``tests/_float64.py``: the example Llama's float32 RoPE and norm kept in
float64) and return the worst relative parameter error after 3 steps; ``tests/test_dist_tp.py`` holds it to the
one fixed tolerance ``_float64.RTOL``."""

import copy
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import llama
import meshplan
from _float64 import float64_model, keep_float64
from _launch import run_cases
from meshplan.tensor_parallel.dropout.per_shard import TpRng

WORLD = int(os.environ["WORLD_SIZE"])
PLAN = meshplan.load_plan("plans/llama.yaml").model_dump(exclude_unset=True)
PLAN.pop("layout")


def _rel(a, b):
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _parity(tp, sp, lp, steps=3, batch=4, seq=16, dropout=0.0, ckpt=False):
    mesh = init_device_mesh("cpu", (WORLD // tp, tp), mesh_dim_names=("dp", "tp"))["tp"]
    args = llama.tiny_args(n_kv_heads=4, dropout=dropout)
    torch.manual_seed(0)
    ref = float64_model(llama.build(args))
    model = copy.deepcopy(ref)
    plan = copy.deepcopy(PLAN)
    plan["tensor_parallel"].update(sequence_parallel=sp, loss_parallel=lp)
    if dropout:
        plan["tensor_parallel"]["dropout_rng"] = "single_device"
    meshplan.parallelize(model, plan, mesh)
    if ckpt:  # recomputation in backward must draw the same masks (checkpoint restores the RNG state)
        for i, layer in enumerate(model.layers):
            model.layers[i] = checkpoint_wrapper(layer, preserve_rng_state=True)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    r, n = mesh.get_local_rank(), batch // tp
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        tokens = torch.randint(0, args.vocab_size, (batch, seq), generator=g)
        labels = torch.randint(0, args.vocab_size, (batch, seq), generator=g)
        labels[step % batch, : 3 + step] = -100
        torch.manual_seed(100 + step)  # the dropout masks: the same seed on every rank, as on one device
        F.cross_entropy(ref(tokens).flatten(0, 1), labels.flatten()).backward()
        opt_ref.step()
        opt_ref.zero_grad()
        x = tokens[r * n:(r + 1) * n] if sp == "batch" else tokens
        torch.manual_seed(100 + step)
        logits = model(x)
        if lp:
            loss = meshplan.cross_entropy(logits, labels)
        elif sp == "batch":
            y = labels[r * n:(r + 1) * n]
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum") / (labels != -100).sum()
        else:
            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        loss.backward()
        for name, p in model.named_parameters():
            if isinstance(p, DTensor):
                assert p.grad.placements == p.placements, (name, p.grad.placements)
        opt.step()
        opt.zero_grad()
    refp = dict(ref.named_parameters())
    errs = {}
    for name, p in model.named_parameters():
        full = p.full_tensor() if isinstance(p, DTensor) else p
        errs[name] = _rel(full.detach(), refp[name.replace("._checkpoint_wrapped_module", "")].detach())
    return max(errs.values())


def case_parity():
    out = {}
    for tp in sorted({2, WORLD}):
        for sp in (True, False, "batch"):
            for lp in (True, False):
                out[f"tp{tp}-sp{sp}-lp{lp}"] = _parity(tp, sp, lp)
    return out


def case_dropout_parity():
    """dropout 0.1 (SDPA, resid, FFN) with dropout_rng single_device: the same 3 AdamW steps as one device."""
    out = {}
    for tp in sorted({2, WORLD}):
        for sp in (True, False, "batch"):
            for lp in (True, False):
                out[f"tp{tp}-sp{sp}-lp{lp}"] = _parity(tp, sp, lp, dropout=0.1)
    for sp in (True, False):
        out[f"tp{WORLD}-sp{sp}-ckpt"] = _parity(WORLD, sp, True, dropout=0.1, ckpt=True)
    return out


def case_dropout_streams():
    mesh = init_device_mesh("cpu", (WORLD // 2, 2), mesh_dim_names=("dp", "tp"))["tp"]
    rng = TpRng(mesh.get_local_rank())

    class Draw(nn.Module):
        def forward(self, x):
            return torch.rand(4)

    class Region(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner, self.replicated = Draw(), Draw()

        def forward(self, x):
            return self.inner(x), self.replicated(x)

    region = Region()
    rng.fork(region)
    rng.shared(region.replicated)
    torch.manual_seed(123)
    per_rank, shared = region(None)
    after = torch.rand(1)
    torch.manual_seed(123)
    again = region(None)  # recomputation (activation checkpointing restores the seed): same masks
    assert torch.equal(again[0], per_rank) and torch.equal(again[1], shared)
    gathered = [torch.empty(4) for _ in range(2)]
    dist.all_gather(gathered, per_rank, group=mesh.get_group())
    assert not torch.equal(gathered[0], gathered[1]), "TP-region draws must differ per tp rank"
    dist.all_gather(gathered, shared, group=mesh.get_group())
    assert torch.equal(gathered[0], gathered[1]), "replicated-region draws must agree"
    last = [torch.empty(1) for _ in range(2)]
    dist.all_gather(last, after, group=mesh.get_group())
    assert torch.equal(last[0], last[1]), "the shared stream continues identically after the region"
    return "ok"


def case_dropout_training():
    """dropout > 0: the replicated residual stream stays identical across tp ranks and the loss falls."""
    mesh = init_device_mesh("cpu", (WORLD // 2, 2), mesh_dim_names=("dp", "tp"))["tp"]
    out = {}
    for sp in (False, True):
        torch.manual_seed(0)
        model = llama.build(llama.tiny_args(n_kv_heads=4, dropout=0.2))
        plan = copy.deepcopy(PLAN)
        plan["tensor_parallel"].update(sequence_parallel=sp, loss_parallel=True)
        meshplan.parallelize(model, plan, mesh)
        seen = []
        model.layers[0].register_forward_hook(lambda m, i, o: seen.append(o))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        tokens = torch.arange(64).reshape(4, 16) % 128
        losses = []
        for _ in range(8):
            loss = meshplan.cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(float(loss))
        h = seen[-1].full_tensor() if isinstance(seen[-1], DTensor) else seen[-1]
        both = [torch.empty_like(h) for _ in range(2)]
        dist.all_gather(both, h.contiguous(), group=mesh.get_group())
        assert torch.equal(both[0], both[1]), "tp ranks disagree on the residual stream"
        assert losses[-1] < losses[0], losses
        out[f"sp{sp}"] = [losses[0], losses[-1]]
    return out


def launch_cases():
    """This launch's cases and the context they run in (``tests/dist/suite_worker.py`` runs several workers' in one
    launch)."""
    return {"parity": case_parity, "dropout_parity": case_dropout_parity,
            "dropout_streams": case_dropout_streams, "dropout_training": case_dropout_training}, keep_float64


if __name__ == "__main__":
    dist.init_process_group("gloo")
    with keep_float64():
        run_cases(launch_cases()[0])
