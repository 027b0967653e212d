"""Real gloo processes (tp = world size): unmodified transformers models trained with the shipped plans.

One launch for every model: 3 AdamW steps vs one device in float64 (transformers' own loss,
``model(input_ids, labels=...)``; ``tests/_float64.py`` keeps transformers' float32 norms and loss in float64, so
reordered sums differ by ~1e-16 and AdamW has no fp32 noise to amplify), meta-device init vs one-device init, and
loading a full state dict from rank 0 and from a safetensors file; transformers' Llama over
SP off / on / batch x loss_parallel on / off (float64 too); DeepSeek MLA (minicpm3, a dense DeepSeek-V2-Lite
shape) in float64 with SGD and the plans ``from_hf`` converts; per-head parts of attention (tests/_heads.py: gpt-oss
sinks, DiffLlama lambdas, Olmo2's whole-projection norm, lara_mini, Doge's dynamic mask) 3 SGD steps in float64.
``hf_worker.py CASE...`` runs only those cases.
"""

import contextlib
import copy
import json
import os
import sys
import tempfile
import warnings

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import meshplan
from _float64 import float64_model, keep_float64
from _launch import run_cases
from examples.hf_models import FACTORIES

warnings.filterwarnings("ignore")
WORLD = int(os.environ["WORLD_SIZE"])


def _rel(a, b):
    a = a.full_tensor() if isinstance(a, DTensor) else a
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _step_batch(step, batch, seq):
    """Step ``step``'s tokens and labels (a few ignored), the same on every rank."""
    tokens = torch.randint(0, 128, (batch, seq), generator=torch.Generator().manual_seed(step))
    labels = tokens.clone()
    labels[step % batch, : 3 + step] = -100
    return tokens, labels


def _parity(name, steps=3, batch=2, seq=16, factory=None, plan=None, optimizer=torch.optim.AdamW):
    factory, plan = (factory, plan) if factory is not None else FACTORIES[name]
    torch.manual_seed(0)
    ref = float64_model(factory())
    model = copy.deepcopy(ref)
    meshplan.parallelize(model, plan)  # the active topology (meshplan.init) gives the mesh
    opt_ref = optimizer(ref.parameters(), lr=1e-3)
    opt = optimizer(model.parameters(), lr=1e-3)
    worst = {"loss": 0.0, "grad": 0.0}
    for step in range(steps):
        tokens, labels = _step_batch(step, batch, seq)
        loss_ref = ref(input_ids=tokens, labels=labels).loss
        loss_ref.backward()
        loss = model(input_ids=tokens, labels=labels).loss
        loss.backward()
        assert loss.dtype == loss_ref.dtype == torch.float64, (loss.dtype, loss_ref.dtype)
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
    worst["worst_param"] = max(per_param.items(), key=lambda kv: kv[1])  # key biases included
    return worst


def case_parity():
    return {name: _parity(name) for name in FACTORIES}


def _mla(model_type, **overrides):
    """A tiny float64 transformers MLA model of ``model_type`` and the plan from_hf converts for it."""
    from meshplan.hf.convert import from_hf
    from meshplan.hf.tiny_config import tiny_config
    from meshplan.hf.tiny_models import model_class
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "config.json")
        with open(path, "w") as f:
            json.dump({"model_type": model_type, **overrides}, f)
        plan = from_hf(path, tp=WORLD)
    plan.pop("_origin")
    plan.pop("expert_parallel", None)  # the small copy from_hf reads keeps an MoE layer; these models have none
    plan["layout"] = {"tp": WORLD}
    config = tiny_config(model_type, tp=WORLD, **overrides)
    config._attn_implementation = "eager"
    return (lambda: model_class(model_type)(config).double()), plan


def case_mla():
    """3 SGD steps in float64: minicpm3 (q_a_proj → q_b_proj), DeepSeek-V2-Lite's shape (q_proj beside the
    latent), dense layers."""
    lite = {"q_lora_rank": None, "first_k_dense_replace": 2, "num_hidden_layers": 2}
    models = {"minicpm3": _mla("minicpm3"), "deepseek_v2_lite": _mla("deepseek_v2", **lite)}
    return {name: _parity(name, factory=factory, plan=plan, optimizer=torch.optim.SGD)
            for name, (factory, plan) in models.items()}


def _matrix_run(sp, lp, steps=3, batch=4, seq=16):
    """transformers' Llama (GQA 8/4 heads), plans/hf_llama.yaml with SP ``sp`` and loss_parallel ``lp``:
    worst rel errors of loss, grads and params over ``steps`` AdamW steps vs one device, in float64.

    lr 1e-3 (it was 1e-4 in float32: one element of ``layers.0.mlp.down_proj.weight`` with a gradient of
    1.07e-8, about AdamW's eps, turned fp32 reduction-order noise into a 1.05e-5 relative parameter difference).
    """
    from examples.hf_models import llama
    torch.manual_seed(0)
    ref = float64_model(llama(num_attention_heads=8, num_key_value_heads=4))
    model = copy.deepcopy(ref)
    data = meshplan.load_plan("plans/hf_llama.yaml").model_dump(exclude_unset=True)
    data["tensor_parallel"].update(sequence_parallel=sp, loss_parallel=lp)
    meshplan.parallelize(model, data)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rank, n = dist.get_rank(), batch // WORLD
    worst = {"loss": 0.0, "grad": 0.0, "param": 0.0}
    where = {}

    def note(kind, value, name):
        if value > worst[kind]:
            worst[kind], where[kind] = value, f"{name} step {step}"

    for step in range(steps):
        tokens, labels = _step_batch(step, batch, seq)
        loss_ref = ref(input_ids=tokens, labels=labels).loss
        loss_ref.backward()
        if sp == "batch":  # each tp rank feeds its own part of the batch
            part, mine = tokens[rank * n:(rank + 1) * n], labels[rank * n:(rank + 1) * n]
            if lp:  # vocab-sharded logits hold the whole tp group's batch
                loss = model(input_ids=part, labels=labels).loss
            else:  # logits are this rank's part: normalise by the global valid-token count
                logits = model(input_ids=part).logits
                loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), mine[:, 1:].flatten(),
                                                         reduction="sum") / (labels[:, 1:] != -100).sum()
                part_loss = loss.detach().clone()
                dist.all_reduce(part_loss)
                note("loss", _rel(part_loss, loss_ref.detach()), "loss")
        else:
            loss = model(input_ids=tokens, labels=labels).loss
        if not (sp == "batch" and not lp):
            note("loss", _rel(loss.detach(), loss_ref.detach()), "loss")
        loss.backward()
        for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            if isinstance(p, DTensor):
                assert p.grad.placements == p.placements, (name, p.grad.placements)
            note("grad", _rel(p.grad, q.grad), name)
        for o in (opt_ref, opt):
            o.step()
            o.zero_grad()
        for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            note("param", _rel(p.detach(), q.detach()), name)
    return {**worst, "where": where}


def case_llama_matrix():
    """SP off / on / batch x loss_parallel on / off (the issue's parity matrix for transformers' Llama)."""
    return {f"sp={sp},lp={lp}": _matrix_run(sp, lp) for sp in (False, True, "batch") for lp in (True, False)}


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


def _heads_run(model_type, steps=3, lr=0.1):
    """3 SGD steps of a tiny float64 model with per-head parts (tests/_heads.py) beside one device."""
    import time

    from _heads import plan, tiny
    t0 = time.perf_counter()
    ref = tiny(model_type)
    model = copy.deepcopy(ref)
    meshplan.parallelize(model, plan(model_type, WORLD))
    opts = [torch.optim.SGD(m.parameters(), lr=lr) for m in (ref, model)]
    worst = {"loss": 0.0, "grad": 0.0, "param": 0.0, "placements": []}
    vocab = ref.config.vocab_size
    for step in range(steps):
        tokens = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(step))
        losses = [m(input_ids=tokens, labels=tokens).loss for m in (ref, model)]
        for loss in losses:
            loss.backward()
        worst["loss"] = max(worst["loss"], _rel(losses[1].detach(), losses[0].detach()))
        for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            if isinstance(p, DTensor) and p.grad.placements != p.placements:
                worst["placements"].append(n)
            worst["grad"] = max(worst["grad"], _rel(p.grad, q.grad))
        for opt in opts:
            opt.step()
            opt.zero_grad()
    for p, q in zip(model.parameters(), ref.parameters()):
        worst["param"] = max(worst["param"], _rel(p.detach(), q.detach()))
    worst["seconds"] = time.perf_counter() - t0
    return worst


def case_heads():
    from _heads import RULES
    return {t: _heads_run(t) for t in sorted(RULES)}


#: the cases share groups (tests/_launch.py releases them after the last case, not after each)
KEEPS_GROUPS = True


def launch_cases():
    """This launch's cases and the context they run in (``tests/dist/suite_worker.py`` runs several workers' in one
    launch)."""
    return {"parity": case_parity, "meta_init": case_meta_init, "load": case_load, "llama_matrix": case_llama_matrix,
            "mla": case_mla, "heads": case_heads}, _context


@contextlib.contextmanager
def _context():
    with meshplan.init({"tp": WORLD}), keep_float64():
        yield


if __name__ == "__main__":
    cases = launch_cases()[0]
    wanted = sys.argv[1:] or list(cases)
    with _context():
        run_cases({k: cases[k] for k in wanted})
