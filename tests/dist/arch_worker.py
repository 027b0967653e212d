"""Real gloo processes (tp = world size): architectures that break naive TP, with the plans in ``plans/``.

Each model of ``examples/architectures.py`` is built in float64 (``tests/_float64.py``: transformers' float32
norms and loss kept in float64) and trains 3 AdamW steps beside one device in float64: loss and every gradient
at each step, every parameter after them (key biases included). transformers models are also trained through
``meshplan.train_step(model, {"input_ids", "labels"}, None, opt)`` (the model's own loss, tokens counted as it
counts them), compared after 3 steps with the same one-device run. Each value is the worst relative error and
where it was; ``tests/test_dist_architectures.py`` holds them to the one fixed tolerance ``_float64.RTOL``.

Why float64: AdamW divides each gradient element by its own running size, so an element whose true gradient
cancels to ~0 (an embedding entry, a key bias) steps by ~lr whatever its rounding noise is. In float32 that
turned reduction-order noise into 1.4e-3 (Gemma2's ``embed_tokens``) on one machine's kernels; in float64 the
worst is 8e-13 (Gemma2's ``input_layernorm.weight`` gradient at step 3).
"""

import contextlib
import copy
import os
import warnings

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

import meshplan
from _float64 import float64_model, keep_float64
from _launch import run_cases
from examples.architectures import FACTORIES

warnings.filterwarnings("ignore")
WORLD = int(os.environ["WORLD_SIZE"])


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


def _note(worst, kind, value, name):
    if value > worst[kind][1]:
        worst[kind] = [name, value]


def _parity(name, steps=3):
    factory, plan = FACTORIES[name]
    torch.manual_seed(0)
    ref = float64_model(factory())
    hf = hasattr(ref, "config")
    model = copy.deepcopy(ref)
    stepped = copy.deepcopy(ref) if hf else None
    meshplan.parallelize(model, plan)
    if stepped is not None:
        meshplan.parallelize(stepped, plan)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (ref, model, stepped) if m is not None]
    worst = {k: ["", 0.0] for k in ("loss", "grad", "param", "train_step_loss", "train_step_param")}
    for step in range(steps):
        tokens, labels = _batch(step)
        loss_ref = _loss(ref, tokens, labels, hf)
        loss_ref.backward()
        loss = _loss(model, tokens, labels, hf)
        loss.backward()
        assert loss.dtype == loss_ref.dtype == torch.float64, (loss.dtype, loss_ref.dtype)
        _note(worst, "loss", _rel(loss.detach(), loss_ref.detach()), f"step {step}")
        for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            _note(worst, "grad", _rel(p.grad, q.grad), f"{n} step {step}")
        if stepped is not None:
            res = meshplan.train_step(stepped, {"input_ids": tokens, "labels": labels}, None, opts[2])
            _note(worst, "train_step_loss", abs(res.loss - float(loss_ref)) / float(loss_ref), f"step {step}")
            worst["train_step_tokens"] = res.num_tokens == int((labels[:, 1:] != -100).sum())
        for opt in opts[:2]:
            opt.step()
            opt.zero_grad()
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        _note(worst, "param", _rel(p.detach(), q.detach()), n)
    if stepped is not None:
        for (n, p), (_, q) in zip(stepped.named_parameters(), ref.named_parameters()):
            _note(worst, "train_step_param", _rel(p.detach(), q.detach()), n)
    return worst


def case_parity():
    return {name: _parity(name) for name in FACTORIES}


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def case_release():
    """10 ``meshplan.init`` blocks in turn on this launch's process group (which init does not own), inside the
    context's live topology: each block's end destroys the groups it made, so this process's thread count
    stays flat, and the outer topology's groups keep working (issue 31: 596 threads per rank before)."""
    import torch.distributed as dist
    outer = meshplan.current_topology()
    counts = []
    for _ in range(10):
        with meshplan.init({"cp": WORLD}) as topo:
            for group in topo.process_groups():
                dist.all_reduce(torch.ones(1), group=group)  # every group connected: its gloo threads running
        counts.append(_threads())
    total, expected = torch.ones(1), 1
    for group in outer.process_groups():  # each reduce multiplies the (equal) values by the group's size
        dist.all_reduce(total, group=group)
        expected *= dist.get_world_size(group)
    return {"threads": counts, "outer": [float(total), expected]}


#: the cases share groups (tests/_launch.py releases them after the last case, not after each)
KEEPS_GROUPS = True


def launch_cases():
    """This launch's cases and the context they run in (``tests/dist/suite_worker.py`` runs several workers' in one
    launch)."""
    return {"parity": case_parity, "release": case_release}, _context


@contextlib.contextmanager
def _context():
    with meshplan.init({"tp": WORLD}), keep_float64():
        yield


if __name__ == "__main__":
    with _context():
        run_cases(launch_cases()[0])
