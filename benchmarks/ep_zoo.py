"""transformers' mixture-of-experts models at ep 2, real gloo: the plan ``meshplan convert --ep 2`` writes, trained
against one device.

For each model type (default: MoE types outside ``tests/dist/ep_hf_worker.py``), one ``torchrun --standalone
--nproc-per-node 2`` launch of this file (gloo, CPU, one thread per rank): the tiny model of
:func:`meshplan.hf.tiny_models.tiny_model` in float64 (experts on transformers' eager implementation: ``grouped_mm``
has no float64 kernel), the plan :func:`meshplan.hf.convert.from_hf` writes from its config with ``ep=2`` (tp 1,
sequence parallel on; off when ``meshplan check`` refuses that), ``meshplan.check`` at world 2, then 3 SGD steps
(momentum 0.9, lr 0.05, clip 0.5) through ``meshplan.parallelize`` + ``meshplan.train_step`` with the model's own
loss (a base model: a fixed projection of its last hidden state) on 4 rows × 16 tokens (2 rows per rank) vs one
device. One fixed tolerance, the parity suite's: every parameter ‖Δ‖/‖ref‖ ≤ 1e-5 (absolute for a parameter that
is zero), each step's loss and gradient norm 1e-5 relative. (transformers' causal-LM loss upcasts the logits to
float32, so the float32 reduction-order noise of the loss, ~1e-7, reaches every gradient: measured 1e-9 to 1e-7.)

Result per model: ``equal``, ``refused`` (convert or check said no: the reason), ``not buildable tiny``, ``WRONG``
(check ok, numbers differ) or ``crash`` (check ok, the run raised or hung: 300 s).

    python benchmarks/ep_zoo.py                        # the default list; a markdown table on stdout
    python benchmarks/ep_zoo.py --only olmoe,phimoe --json /tmp/ep-zoo.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT = ("olmoe", "phimoe", "hunyuan_v1_moe", "granitemoe", "deepseek_v3", "glm4_moe", "dots1", "ernie4_5_moe",
           "minimax", "flex_olmo", "lfm2_moe", "qwen3_next", "exaone_moe", "jamba")
ROWS, SEQ, STEPS, TOL = 4, 16, 3, 1e-5


def _batch(step: int, vocab: int):
    import torch
    g = torch.Generator().manual_seed(3000 + step)
    y = torch.randint(0, vocab, (ROWS, SEQ), generator=g)
    keep = torch.rand(ROWS, SEQ, generator=g) < 0.8
    return torch.where(keep, y, -100)


def _model(model_type: str):
    import torch

    from meshplan.hf.tiny_models import tiny_model
    model, why = tiny_model(model_type, seed=0)
    if model is None:
        return None, why
    model = model.to(torch.float64).train()
    if getattr(model.config, "_experts_implementation", None) and hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("eager")
    return model, None


def _loss_fns(model):
    """``(one-device mean loss of (model, labels), train_step's loss_fn or None, batch of labels)``."""
    import torch
    from torch.distributed.tensor import DTensor
    if model.get_output_embeddings() is not None:
        return (lambda m, y: m(input_ids=y.clamp(min=0), labels=y).loss, None,
                lambda y: {"input_ids": y.clamp(min=0), "labels": y})

    def hidden(out, y):
        h = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        h = h.full_tensor() if isinstance(h, DTensor) else h
        pattern = torch.arange(h.shape[1] * h.shape[2], dtype=h.dtype).reshape(h.shape[1:]).mul(0.7).sin()
        return ((h * pattern).square().sum(-1) * (y != -100)).sum()
    return (lambda m, y: hidden(m(input_ids=y.clamp(min=0)), y) / (y != -100).sum(), hidden,
            lambda y: ({"input_ids": y.clamp(min=0)}, y))


def _plan(model, model_type: str):
    """``(plan, None)`` that ``meshplan check`` passes at world 2 (sequence parallel on, else off), or
    ``(None, reason)``."""
    import meshplan
    from meshplan.errors import PlanError
    from meshplan.hf.convert import from_hf
    folder = tempfile.mkdtemp(prefix="meshplan-ep-zoo-")
    data = {**model.config.to_dict(), "model_type": model.config.model_type, "architectures": [type(model).__name__]}
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(data, f, default=str)
    reasons = []
    for sp in (True, False):
        try:
            plan = from_hf(folder, ep=2, sequence_parallel=sp, loss_parallel=model.get_output_embeddings() is not None)
        except PlanError as e:
            return None, f"convert: {' '.join(str(e).split())[:300]}"
        plan.pop("_origin")
        report = meshplan.check(model, plan, world_size=2)
        if report.ok:
            return plan, None
        reasons.append(" ".join(str(report.errors[0]).split())[:300])
    return None, f"check: {reasons[-1]}"


def _train(model_type: str) -> dict:
    """One model on this rank: the row of the table."""
    import torch

    import meshplan
    ref, why = _model(model_type)
    if ref is None:
        return {"class": "not buildable tiny", "reason": why}
    plan, why = _plan(ref, model_type)
    if plan is None:
        return {"class": "refused", "reason": why}
    ref_loss, loss_fn, batch_of = _loss_fns(ref)
    sgd = lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9)  # noqa: E731
    opt, losses, norms = sgd(ref.parameters()), [], []
    for s in range(STEPS):
        loss = ref_loss(ref, _batch(s, ref.config.vocab_size))
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)))
        losses.append(float(loss))
        opt.step()
        opt.zero_grad()
    try:
        model = meshplan.parallelize(_model(model_type)[0], plan, meshplan.build_mesh(plan["layout"]))
        topo = meshplan.parallel_state(model).topology
        opt, rows, r = sgd(model.parameters()), ROWS // topo.data_world_size, topo.data_rank
        got = [meshplan.train_step(model, batch_of(_batch(s, ref.config.vocab_size)[r * rows:(r + 1) * rows]),
                                   loss_fn, opt, max_grad_norm=0.5) for s in range(STEPS)]
    except Exception as e:  # noqa: BLE001 - the row says what broke
        return {"class": "crash", "reason": f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"}
    return _compare(model, ref, got, losses, norms, plan)


def _compare(model, ref, got, losses, norms, plan) -> dict:
    from torch.distributed.tensor import DTensor
    want, worst, name = dict(ref.named_parameters()), 0.0, ""
    for n, p in model.named_parameters():
        full = (p.full_tensor() if isinstance(p, DTensor) else p).detach()
        w = want[n.replace("_checkpoint_wrapped_module.", "")].detach()
        diff, size = float((full - w).norm()), float(w.norm())
        rel = diff / size if size else diff
        worst, name = max((worst, name), (rel, n))
    steps = max(max(abs(g.loss - l) / abs(l), abs(g.grad_norm - n) / n) for g, l, n in zip(got, losses, norms))
    sp = plan["tensor_parallel"]["sequence_parallel"]
    detail = f"worst parameter {worst:.1e} ({name}), loss/norm {steps:.1e}; sequence_parallel {str(sp).lower()}"
    return {"class": "equal" if worst <= TOL and steps <= TOL else "WRONG", "reason": detail}


def _worker(model_type: str, out: str) -> None:
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    row = _train(model_type)
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(row, f)
    dist.destroy_process_group()


def _launch(model_type: str) -> dict:
    out = os.path.join(tempfile.mkdtemp(prefix="meshplan-ep-zoo-"), "row.json")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", __file__,
           "--worker", model_type, "--out", out]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        return {"class": "crash", "reason": "hung: no result in 300 s"}
    if not os.path.exists(out):
        tail = " ".join(proc.stderr.split()[-60:])
        return {"class": "crash", "reason": f"torchrun rc {proc.returncode}: {tail[-300:]}"}
    with open(out) as f:
        return json.load(f)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="comma-separated model types")
    ap.add_argument("--json", default=None)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        import warnings
        warnings.filterwarnings("ignore")
        from transformers.utils import logging
        logging.set_verbosity_error()
        return _worker(args.worker, args.out)
    rows = {}
    for model_type in (args.only.split(",") if args.only else DEFAULT):
        rows[model_type] = _launch(model_type)
        print(f"{model_type:20s} {rows[model_type]['class']:10s} {rows[model_type]['reason']}", file=sys.stderr,
              flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    print("| model type | meshplan at ep 2 | detail |\n| --- | --- | --- |")
    for model_type, row in rows.items():
        print(f"| {model_type} | {row['class']} | {row['reason'].replace('|', '/')} |")


if __name__ == "__main__":
    main()
