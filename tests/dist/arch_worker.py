"""Real gloo processes (tp = world size): architectures that break naive TP, with the plans in ``plans/``.

Each model of ``examples/architectures.py`` trains 3 AdamW steps beside one device: loss and every gradient
at each step, every parameter after them. transformers models are also trained through
``meshplan.train_step(model, {"input_ids", "labels"}, None, opt)`` (the model's own loss, tokens counted as it
counts them), compared after 3 steps with the same one-device run.

The noise floor: two more one-device copies sum in other orders (two microbatches; the batch's rows swapped);
the larger of their distances from the reference is what fp32 reordering alone does to each model. Gemma2's is
~4e-5 after 3 AdamW steps: AdamW turns near-zero gradients into near-whole +-lr updates, so an embedding entry
whose true gradient cancels to ~1e-7 (its row's norm 0.36) moves 1.5e-4 apart on a 5e-7 difference. The two
orders land on different such entries (Gemma2: 2.1e-5 and 3.8e-5), hence both. The first step has no such
floor; later steps are judged against max(1e-5, 3 x the floor).
"""

import copy
import os
import warnings

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

import meshplan
from _launch import run_cases
from examples.architectures import FACTORIES

warnings.filterwarnings("ignore")
WORLD = int(os.environ["WORLD_SIZE"])
KEY_BIAS = ("k_proj.bias",)  # true gradient ~0 (softmax is shift-invariant): judged by gradient, see test


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _rel(a, b):
    return float((_full(a) - b).norm() / b.norm().clamp_min(1e-30))


def _batch(step, seq=16):
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, 128, (2, seq), generator=g)
    labels = tokens.clone()
    labels[step % 2, : 3 + step] = -100
    return tokens, labels


def _loss(model, tokens, labels, hf):
    if hf:
        return model(input_ids=tokens, labels=labels).loss
    logits = model(tokens)
    if isinstance(logits, DTensor):
        return meshplan.cross_entropy(logits[:, :-1], labels[:, 1:])
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())


def _reordered_loss(model, tokens, labels, hf):
    """The same loss as :func:`_loss`, summed over two one-row microbatches (another reduction order)."""
    n = (labels[:, 1:] != -100).sum()
    total = 0.0
    for i in range(2):
        t, y = tokens[i:i + 1], labels[i:i + 1]
        if hf:
            total = total + model(input_ids=t, labels=y, num_items_in_batch=n).loss
        else:
            logits = model(t)
            total = total + F.cross_entropy(logits[:, :-1].flatten(0, 1), y[:, 1:].flatten(), reduction="sum") / n
    return total


def _parity(name, steps=3):
    factory, plan = FACTORIES[name]
    torch.manual_seed(0)
    ref = factory()
    hf = hasattr(ref, "config")
    model, alt, swapped = copy.deepcopy(ref), copy.deepcopy(ref), copy.deepcopy(ref)
    stepped = copy.deepcopy(ref) if hf else None
    meshplan.parallelize(model, plan)
    if stepped is not None:
        meshplan.parallelize(stepped, plan)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (ref, model, alt, swapped, stepped) if m is not None]
    worst = {"loss": 0.0, "grad": 0.0, "grad_name": None, "train_step_loss": 0.0, "first_step_grad": 0.0,
             "floor_grad": 0.0, "floor_param": 0.0}
    for step in range(steps):
        tokens, labels = _batch(step)
        loss_ref = _loss(ref, tokens, labels, hf)
        loss_ref.backward()
        loss = _loss(model, tokens, labels, hf)
        loss.backward()
        worst["loss"] = max(worst["loss"], _rel(loss.detach(), loss_ref.detach()))
        _reordered_loss(alt, tokens, labels, hf).backward()
        _loss(swapped, tokens[[1, 0]], labels[[1, 0]], hf).backward()
        for (n, p), (_, q), (_, r), (_, w) in zip(model.named_parameters(), ref.named_parameters(),
                                                  alt.named_parameters(), swapped.named_parameters()):
            e = _rel(p.grad, q.grad)
            if e > worst["grad"]:
                worst["grad"], worst["grad_name"] = e, n
            if step == 0:
                worst["first_step_grad"] = max(worst["first_step_grad"], e)
            worst["floor_grad"] = max(worst["floor_grad"], _rel(r.grad, q.grad), _rel(w.grad, q.grad))
        if stepped is not None:
            res = meshplan.train_step(stepped, {"input_ids": tokens, "labels": labels}, None, opts[4])
            worst["train_step_loss"] = max(worst["train_step_loss"], abs(res.loss - float(loss_ref)) / float(loss_ref))
            worst["train_step_tokens"] = res.num_tokens == int((labels[:, 1:] != -100).sum())
        for opt in opts[:4]:
            opt.step()
            opt.zero_grad()
    per_param = {n: _rel(p.detach(), q.detach()) for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters())}
    worst["param"] = max(((n, e) for n, e in per_param.items() if not n.endswith(KEY_BIAS)), key=lambda kv: kv[1])
    worst["floor_param"] = max(_rel(r.detach(), q.detach()) for copy_ in (alt, swapped) for (n, r), (_, q) in
                               zip(copy_.named_parameters(), ref.named_parameters()) if not n.endswith(KEY_BIAS))
    if stepped is not None:
        worst["train_step_param"] = max(_rel(p.detach(), q.detach()) for (n, p), (_, q) in
                                        zip(stepped.named_parameters(), ref.named_parameters())
                                        if not n.endswith(KEY_BIAS))
    return worst


def case_parity():
    return {name: _parity(name) for name in FACTORIES}


if __name__ == "__main__":
    with meshplan.init({"tp": WORLD}):
        run_cases({"parity": case_parity})
