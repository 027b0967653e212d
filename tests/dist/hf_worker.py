"""Real gloo processes (tp=2): unmodified transformers models trained with the shipped plans.

One launch for every model: 3 AdamW steps vs one device (transformers' own loss,
``model(input_ids, labels=...)``), meta-device init vs one-device init, and
loading a full state dict from rank 0 and from a safetensors file.
"""

import copy
import os
import tempfile
import warnings

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import meshplan
from _launch import run_cases
from examples.hf_models import FACTORIES

warnings.filterwarnings("ignore")
WORLD = int(os.environ["WORLD_SIZE"])
#: biases feeding the attention keys: their gradient is (nearly) zero, see tests/test_dist_hf.py
KEY_BIAS = ("k_proj.bias", "c_attn.bias")


def _rel(a, b):
    a = a.full_tensor() if isinstance(a, DTensor) else a
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _parity(name, steps=3, batch=2, seq=16):
    factory, plan = FACTORIES[name]
    torch.manual_seed(0)
    ref = factory()
    model = copy.deepcopy(ref)
    meshplan.parallelize(model, plan)  # the active topology (meshplan.init) gives the mesh
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    worst = {"loss": 0.0, "grad": 0.0}
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        tokens = torch.randint(0, 128, (batch, seq), generator=g)
        labels = tokens.clone()
        labels[step % batch, : 3 + step] = -100
        loss_ref = ref(input_ids=tokens, labels=labels).loss
        loss_ref.backward()
        loss = model(input_ids=tokens, labels=labels).loss
        loss.backward()
        worst["loss"] = max(worst["loss"], _rel(loss.detach(), loss_ref.detach()))
        for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            if isinstance(p, DTensor):
                assert p.grad.placements == p.placements, (n, p.grad.placements)
            worst["grad"] = max(worst["grad"], _rel(p.grad, q.grad))
        opt_ref.step()
        opt_ref.zero_grad()
        opt.step()
        opt.zero_grad()
    diff = sum(float(((p.full_tensor() if isinstance(p, DTensor) else p).detach() - q.detach()).pow(2).sum())
               for p, q in zip(model.parameters(), ref.parameters()))
    worst["params"] = (diff / sum(float(q.detach().pow(2).sum()) for q in ref.parameters())) ** 0.5
    per_param = {n: _rel(p.detach(), q.detach()) for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters())}
    key_bias = {n: e for n, e in per_param.items() if n.endswith(KEY_BIAS)}
    worst["worst_param"] = max(((n, e) for n, e in per_param.items() if n not in key_bias), key=lambda kv: kv[1])
    worst["key_bias"] = max(key_bias.values(), default=0.0)
    return worst


def case_parity():
    return {name: _parity(name) for name in FACTORIES}


def _shards_match(model, ref):
    worst = 0.0
    for (k, t), (_, r) in zip(model.state_dict().items(), ref.state_dict().items()):
        worst = max(worst, _rel(t, r))
    return worst


def case_meta_init():
    out = {}
    for name, (factory, plan) in FACTORIES.items():
        with torch.device("meta"):
            ref = factory()
        ref.to_empty(device="cpu")
        ref.tie_weights()
        torch.manual_seed(0)
        ref.initialize_weights()  # transformers' own meta-device init, one device
        with torch.device("meta"):
            model = factory()
        meshplan.parallelize(model, plan)
        meshplan.materialize(model, seed=0)
        out[name] = _shards_match(model, ref)
    return out


def case_load():
    out = {}
    d = tempfile.mkdtemp(prefix="meshplan-ckpt-") if dist.get_rank() == 0 else None
    box = [d]
    dist.broadcast_object_list(box, src=0)
    for name, (factory, plan) in FACTORIES.items():
        torch.manual_seed(1)
        full = factory()
        if dist.get_rank() == 0:
            full.save_pretrained(os.path.join(box[0], name), safe_serialization=True)
        dist.barrier()
        with torch.device("meta"):
            a = factory()
        meshplan.parallelize(a, plan)
        meshplan.load_full_state_dict(a, full.state_dict() if dist.get_rank() == 0 else None)
        with torch.device("meta"):
            b = factory()
        meshplan.parallelize(b, plan)
        meshplan.load_safetensors(b, os.path.join(box[0], name))
        tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
        want = full(input_ids=tokens, labels=tokens).loss
        out[name] = {"broadcast": _shards_match(a, full), "safetensors": _shards_match(b, full),
                     "loss": _rel(b(input_ids=tokens, labels=tokens).loss.detach(), want.detach())}
    return out


if __name__ == "__main__":
    with meshplan.init({"tp": WORLD}):
        run_cases({"parity": case_parity, "meta_init": case_meta_init, "load": case_load})
