"""``meshplan check --numerics``: run a plan on a small model, tp ranks simulated in one process, and compare
the loss and every gradient with the unparallelized model.

The model is copied; the copy is parallelized with the plan over a ``tp`` mesh of ``tp`` simulated ranks
(``LocalTensorMode`` over a ``fake`` process group: every op runs once per rank, every collective is
computed exactly), and one forward and backward runs on the same batch as the reference. Each gradient is
compared on every rank (a replicated gradient that differs between ranks drifts apart under an optimizer),
relative to ``max(‖reference‖, floor)`` with ``floor = 1e-3 · median ‖reference gradient‖``, so a gradient
whose true value is ~0 (a key bias: softmax is shift-invariant) is judged by the model's scale, not by
reduction-order noise. Dropout is switched off in both (``eval()``): the check is about sharding.
"""

from __future__ import annotations

import copy
import math
import statistics
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch
import torch.nn as nn
import torch.nn.functional as F

from meshplan.errors import PlanError
from meshplan.model_copies import default_batch, is_hf as _is_hf, vocab_size as _vocab  # noqa: F401 (re-exported)

__all__ = ["NumericsReport", "check_numerics", "default_batch"]


@dataclass
class NumericsReport:
    """What :func:`check_numerics` found.

    Attributes:
        ok: the run finished and the loss and every gradient are within ``tol``.
        tp: simulated ranks.
        loss: ``(reference, parallel)`` losses (the parallel one: the worst rank).
        loss_error: relative error of the loss.
        errors: ``{parameter: relative error}`` for every gradient compared (the worst rank).
        failed: parameters over ``tol`` (or without a gradient the reference has), worst first.
        crash: the exception text when the parallel run failed, else None.
    """

    tp: int
    tol: float
    loss: tuple[float, float] | None = None
    loss_error: float | None = None
    errors: dict[str, float] = field(default_factory=dict)
    failed: list[str] = field(default_factory=list)
    notes: dict[str, str] = field(default_factory=dict)
    crash: str | None = None

    @property
    def ok(self) -> bool:
        return self.crash is None and not self.failed and self.loss_error is not None and self.loss_error <= self.tol

    def summary(self) -> str:
        """One line: ``ok`` with the worst error, or what differs."""
        if self.crash is not None:
            return f"crash at tp={self.tp}: {self.crash}"
        worst = max(self.errors.values(), default=0.0)
        if self.ok:
            return (f"ok at tp={self.tp}: loss rel err {self.loss_error:.1e}, worst grad rel err {worst:.1e} over "
                    f"{len(self.errors)} parameters (tol {self.tol:.0e})")
        parts = []
        if self.loss_error is None or self.loss_error > self.tol:
            parts.append(f"loss {self.loss[1]:.6g} vs {self.loss[0]:.6g} (rel err {self.loss_error:.1e})")
        if self.failed:
            shown = ", ".join(f"{n} ({self.notes.get(n) or f'{self.errors[n]:.1e}'})" for n in self.failed[:5])
            more = f" and {len(self.failed) - 5} more" if len(self.failed) > 5 else ""
            parts.append(f"{len(self.failed)} gradient(s) differ: {shown}{more}")
        return f"WRONG at tp={self.tp}: " + "; ".join(parts)

    def to_dict(self) -> dict:
        return {"ok": self.ok, "tp": self.tp, "tol": self.tol, "loss": self.loss, "loss_error": self.loss_error,
                "failed": self.failed, "notes": self.notes, "errors": self.errors, "crash": self.crash}


def _loss(model: nn.Module, batch: Mapping[str, Any], vocab: int | None) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    from meshplan.training.loss import cross_entropy
    if _is_hf(model):
        out = model(**batch) if _takes_labels(model) else model(**{k: v for k, v in batch.items() if k != "labels"})
        if getattr(out, "loss", None) is not None:
            return out.loss
        logits = getattr(out, "logits", None)
        out = logits if logits is not None else getattr(out, "last_hidden_state", out)
    else:
        out = model(*[v for k, v in batch.items() if k != "labels"])
    out = out[0] if isinstance(out, (tuple, list)) else getattr(out, "logits", out)
    labels = batch.get("labels")
    if labels is not None and vocab and out.shape[-1] == vocab:
        if isinstance(out, DTensor):
            return cross_entropy(out, labels)
        return F.cross_entropy(_at_least_float32(out.flatten(0, -2)), labels.flatten())
    if isinstance(out, DTensor):
        out = out.full_tensor()
    return _at_least_float32(out).square().mean()


def _at_least_float32(t: torch.Tensor) -> torch.Tensor:
    """``t`` in float32 if it is in a half precision, else as it is (a float64 model's loss stays float64)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _takes_labels(model: nn.Module) -> bool:
    import inspect
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return True
    return "labels" in params


def _per_rank(t: torch.Tensor) -> dict[int, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    from meshplan._torch import LocalTensor, rank_tensors
    if isinstance(t, DTensor):
        t = t.full_tensor()
    if isinstance(t, LocalTensor):
        return {r: v.detach() for r, v in rank_tensors(t).items()}
    return {0: t.detach()}


def _rel(a: torch.Tensor, b: torch.Tensor, floor: float) -> float:
    if a.shape != b.shape:
        return math.inf
    a, b = a.double(), b.double()
    if not torch.equal(a.isnan(), b.isnan()):
        return math.inf
    ok = ~b.isnan()
    return float((a[ok] - b[ok]).norm()) / max(float(b[ok].norm()), floor, 1e-30)


def check_numerics(model: nn.Module, plan: Any, *, tp: int = 2, batch: Mapping[str, Any] | None = None,
                   tol: float = 1e-5, seed: int = 0,
                   loss_fn: Callable[[nn.Module, Mapping[str, Any]], torch.Tensor] | None = None) -> NumericsReport:
    """Run ``plan`` on a copy of ``model`` over ``tp`` simulated ranks and compare with ``model``.

    Args:
        model: a small, real (not meta) instance; it is not changed (its gradients are).
        plan: a path, a dict or a :class:`~meshplan.Plan`; its layout is replaced by ``tp``.
        tp: simulated tensor-parallel ranks.
        batch: keyword inputs (``labels`` is the target); default :func:`default_batch`.
        tol: largest relative error accepted, loss and each gradient.
        seed: seed of the default batch.
        loss_fn: ``loss_fn(model, batch) -> 0-d loss``; default: the model's own loss (transformers, with
            ``labels``), else cross-entropy of the logits, else the mean square of the output.

    Returns:
        A :class:`NumericsReport`; a crash of the parallel run is reported, not raised.

    Example::

        >>> report = check_numerics(Qwen3ForCausalLM(tiny_config), "plans/qwen3.yaml", tp=2)
        >>> print(report.summary())
    """
    from meshplan.plan_file.document import as_plan
    from meshplan.mesh.topology import build_mesh
    from meshplan.apply import parallelize
    from meshplan._torch import simulated_ranks
    p = as_plan(plan)
    # tp alone, dp 1: FSDP2 over one rank changes no number, and its storage resizing cannot run on simulated ranks
    p = p.model_copy(update={"layout": None, "data_parallel": None})
    vocab = _vocab(model)
    batch = dict(batch) if batch is not None else default_batch(model, tp, seed)
    loss_fn = loss_fn or (lambda m, b: _loss(m, b, vocab))
    report = NumericsReport(tp=tp, tol=tol)
    was_training = model.training
    work = copy.deepcopy(model)
    model.eval()
    work.eval()
    try:
        model.zero_grad(set_to_none=True)
        ref_loss = loss_fn(model, batch)
        ref_loss.backward()
    finally:
        model.train(was_training)
    ref = {n: q.grad.detach().clone() for n, q in model.named_parameters() if q.grad is not None}
    norms = [float(g.double().norm()) for g in ref.values()]
    floor = 1e-3 * statistics.median(norms) if norms else 0.0
    try:
        with simulated_ranks(tp):
            parallelize(work, p, build_mesh({"tp": tp}))
            loss = loss_fn(work, batch)
            loss.backward()
            want = ref_loss.detach().reshape(())
            worst = max(_per_rank(loss).values(), key=lambda v: _rel(v.reshape(()), want, 0.0))
            report.loss_error = _rel(worst.reshape(()), want, 0.0)
            report.loss = (float(want), float(worst))
            for name, q in work.named_parameters():
                want = ref.get(name)
                if want is None:
                    continue
                g = q.grad
                if g is None:
                    report.errors[name], report.notes[name] = math.inf, "no gradient"
                    continue
                placements = getattr(g, "placements", ())
                if any(type(pl).__name__ == "Partial" for pl in placements):
                    report.notes[name] = f"gradient left {placements} after backward"
                report.errors[name] = max(_rel(v, want, floor) for v in _per_rank(g).values())
    except Exception as e:  # reported: the point of the check is to say what breaks
        report.crash = f"{type(e).__name__}: {' '.join(str(e).split())[:500]}"
        return report
    finally:
        model.zero_grad(set_to_none=True)
    report.failed = sorted((n for n, e in report.errors.items() if not e <= tol or n in report.notes),
                           key=lambda n: -report.errors[n])
    return report
