"""The tp axis simulated in one process (``LocalTensorMode``), and transformers' own tp_plan on the same tiny model.

:func:`classify` is the zoo's former tp-only row (``tests/test_zoo.py``): ``meshplan.hf.convert.from_hf`` (sequence
and loss parallel, the plain plan when that is refused), ``meshplan.check`` at world size 2, then ``check_numerics``
(tp=2 simulated ranks, one forward + backward vs one device, every gradient within 1e-5 relative).
:func:`hf_side` applies transformers' ``tp_plan`` (``apply_tensor_parallelism``, as ``from_pretrained(tp_plan=…)``
does) to a copy of the model in the same simulation (``benchmarks/zoo.py --hf`` adds it as a column).
"""

from __future__ import annotations

import copy
import json
import math
import os
import statistics
import tempfile
import time
import warnings

TP = 2


def _quiet() -> None:
    warnings.filterwarnings("ignore")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from transformers.utils import logging
    logging.set_verbosity_error()


def _short(e: BaseException | str, n: int = 400) -> str:
    text = e if isinstance(e, str) else f"{type(e).__name__}: {e}"
    return " ".join(text.split())[:n]


def _plan(model, model_type: str, sp: bool, lp: bool) -> dict:
    """meshplan's conversion of the tiny model's tp_plan (its config.json, so the built class is converted)."""
    from meshplan.hf.convert import from_hf
    with tempfile.TemporaryDirectory() as d:
        data = model.config.to_dict()
        data.update(model_type=model.config.model_type, architectures=[type(model).__name__])
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(data, f, default=str)
        plan = from_hf(d, sequence_parallel=sp, loss_parallel=lp)
    plan.pop("_origin", None)
    return {"layout": {"tp": TP}, **plan}


def _check(model, model_type: str, sp: bool, lp: bool) -> tuple[dict | None, list[str]]:
    """(plan, errors): convert + check; errors empty when the plan passed."""
    import meshplan
    from meshplan.errors import PlanError
    try:
        plan = _plan(model, model_type, sp, lp)
    except PlanError as e:
        return None, [f"convert: {_short(str(e), 600)}"]
    report = meshplan.check(model, plan, world_size=TP)
    return plan, [_short(str(e), 600) for e in report.errors]


def loss_fn(model):
    """The loss both sides use: None (check_numerics' default: the model's own causal-LM loss) for a model with
    an output embedding, else the mean square of the last hidden state times a fixed pattern (base models)."""
    try:
        head = model.get_output_embeddings()
    except Exception:  # noqa: BLE001 - some base models raise NotImplementedError
        head = None
    if head is not None:
        return None

    def hidden(m, batch):  # a fixed projection: a norm's output has a constant mean square (zero gradients)
        import torch
        out = m(input_ids=batch["input_ids"])
        h = getattr(out, "last_hidden_state", None)
        h = (h if h is not None else out[0]).float()
        h = h.full_tensor() if hasattr(h, "full_tensor") else h
        return (h * torch.arange(h.numel(), dtype=h.dtype).reshape(h.shape).mul(0.7).sin()).square().mean()
    return hidden


def smoke(model) -> str | None:
    """Why the tiny model does not run one forward + backward on token ids on one device, else None."""
    from meshplan.checks.numerics import _loss, _vocab, default_batch
    try:
        batch = default_batch(model, TP)
        fn = loss_fn(model) or (lambda m, b: _loss(m, b, _vocab(m)))
        fn(model, batch).backward()
    except Exception as e:  # noqa: BLE001
        return f"the tiny {type(model).__name__} does not run on token ids (one device): {_short(e, 300)}"
    finally:
        model.zero_grad(set_to_none=True)
    return None


def meshplan_side(model, model_type: str) -> dict:
    """meshplan's class for a built tiny model: equal / refused / WRONG / crash, with reason and detail."""
    from meshplan import Plan
    from meshplan.checks.numerics import check_numerics
    out = {"mode": "sp+lp"}
    try:
        plan, errors = _check(model, model_type, True, True)
        if errors:
            plain, plain_errors = _check(model, model_type, False, False)
            if plain_errors:
                return {**out, "class": "refused", "reason": "; ".join(plain_errors[:2]),
                        "errors": plain_errors, "sp_errors": errors}
            plan, out = plain, {"mode": "plain", "sp_refused": errors[0]}
    except Exception as e:  # noqa: BLE001 - a crash of convert/check is a finding
        return {**out, "class": "crash", "reason": f"convert/check raised {_short(e)}"}
    rep = check_numerics(model, Plan.from_data(plan), tp=TP, loss_fn=loss_fn(model))
    out.update(worst=max(rep.errors.values(), default=None), loss_error=rep.loss_error)
    if rep.crash is not None:
        return {**out, "class": "crash", "reason": rep.crash}
    if not rep.ok:
        return {**out, "class": "WRONG", "reason": rep.summary(), "failed": rep.failed[:10]}
    return {**out, "class": "equal", "reason": rep.summary()}


def hf_numerics(model, tp: int = TP, tol: float = 1e-5):
    """transformers' own tp_plan on a copy of ``model`` (``apply_tensor_parallelism``) over ``tp`` simulated
    ranks, compared with ``model`` as :func:`meshplan.checks.numerics.check_numerics` compares (same batch, loss,
    floor and tolerance). Returns a :class:`~meshplan.checks.numerics.NumericsReport`, or None without a plan."""
    from torch.distributed.device_mesh import init_device_mesh
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    from meshplan._torch import simulated_ranks
    from meshplan.checks.numerics import NumericsReport, _loss, _per_rank, _rel, _vocab, default_batch
    if not getattr(model, "tp_plan", None):
        return None
    batch, vocab = default_batch(model, tp), _vocab(model)
    fn = loss_fn(model) or (lambda m, b: _loss(m, b, vocab))
    report = NumericsReport(tp=tp, tol=tol)
    work = copy.deepcopy(model).eval()
    model.eval().zero_grad(set_to_none=True)
    ref_loss = fn(model, batch)
    ref_loss.backward()
    ref = {n: q.grad.detach().clone() for n, q in model.named_parameters() if q.grad is not None}
    model.zero_grad(set_to_none=True)
    norms = [float(g.double().norm()) for g in ref.values()]
    floor = 1e-3 * statistics.median(norms) if norms else 0.0
    try:
        with simulated_ranks(tp):
            mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
            apply_tensor_parallelism(work, mesh, _hf_plan(work))
            if getattr(work.config, "tie_word_embeddings", False):
                work.tie_weights()  # as from_pretrained does after sharding: the head shares the sharded embedding
            loss = fn(work, batch)
            loss.backward()
            want = ref_loss.detach().reshape(())
            losses = {r: v.reshape(()) for r, v in _per_rank(loss).items()}
            report.loss_error = max(_rel(v, want, 0.0) for v in losses.values())
            report.loss = (float(want), float(max(losses.values(), key=lambda v: _rel(v, want, 0.0))))
            for name, q in work.named_parameters():
                if name not in ref:
                    continue
                if q.grad is None:
                    report.errors[name], report.notes[name] = math.inf, "no gradient"
                    continue
                report.errors[name] = max(_rel(v, ref[name], floor) for v in _per_rank(q.grad).values())
    except Exception as e:  # noqa: BLE001 - reported
        report.crash = _short(e, 500)
        return report
    report.failed = sorted((n for n, e in report.errors.items() if not e <= tol or n in report.notes),
                           key=lambda n: -report.errors[n])
    return report


def _hf_plan(model) -> dict[str, str]:
    """The model's expanded tp_plan, less the entries of tied duplicates (``lm_head.weight`` tied to the input
    embedding): ``apply_tensor_parallelism`` looks parameters up without duplicates and would raise KeyError;
    from_pretrained shards before tying, then ties, so the shared parameter is sharded once (by the embedding's
    rule) and :func:`hf_numerics` re-ties after applying."""
    plan = model._expand_parallel_plan(dict(model.tp_plan))
    unique = {n for n, _ in model.named_parameters()}
    modules = {n for n, _ in model.named_modules()}
    return {k: v for k, v in plan.items() if k in unique or k in modules}


def hf_side(model) -> dict:
    """transformers' own tp_plan on the same tiny model: equal / wrong / crash / no plan."""
    try:
        rep = hf_numerics(model)
    except Exception as e:  # noqa: BLE001
        return {"class": "crash", "reason": _short(e)}
    if rep is None:
        return {"class": "no plan", "reason": f"{type(model).__name__}.tp_plan is empty"}
    if rep.crash is not None:
        return {"class": "crash", "reason": rep.crash}
    return {"class": "equal" if rep.ok else "wrong", "reason": rep.summary(), "failed": rep.failed[:10]}


def classify(model_type: str, hf: bool = True) -> dict:
    """One zoo row: ``{type, model, class, reason, …, hf: {class, reason}}`` (see the module docstring)."""
    _quiet()
    from meshplan.hf.tiny_models import tiny_model
    t0 = time.perf_counter()
    model, why = tiny_model(model_type, tp=TP)
    row = {"type": model_type, "model": type(model).__name__ if model is not None else None}
    if model is None:
        return {**row, "class": "not buildable tiny", "reason": why, "hf": {"class": "-"}, "seconds": 0.0}
    why = smoke(model)
    if why is not None:
        return {**row, "class": "not buildable tiny", "reason": why, "hf": {"class": "-"}, "seconds": 0.0}
    row.update(meshplan_side(model, model_type))
    row["hf"] = hf_side(model) if hf else {"class": "-"}
    row["seconds"] = round(time.perf_counter() - t0, 1)
    return row
