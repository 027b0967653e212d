"""``meshplan.estimate`` and ``meshplan.solve``: the Python side of the two commands. Torch-free unless given a
module.

Example::

    >>> est = meshplan.estimate("plans/llama_3d.yaml", "llama3-70b", world_size=64, seq=8192, global_batch=64)
    >>> est.memory.total / 2**30, est.step_time, est.mfu
    >>> res = meshplan.solve("llama3-405b", gpus=16384, seq=8192, global_batch=2048)
    >>> res.valid[0].candidate.layout_dict()
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from meshplan.solver.candidate import Training
from meshplan.solver.cluster import Cluster, load_cluster_file
from meshplan.solver.presets import cluster_preset, model_preset
from meshplan.solver.search import SearchResult, Space, search
from meshplan.solver.shape import ModelShape, shape_from_config
from meshplan.solver.step import Estimate, evaluate

__all__ = ["estimate", "solve", "as_shape", "as_cluster"]


def as_shape(model: Any) -> ModelShape:
    """A :class:`ModelShape` from a shape, a preset name, a config mapping, or a built ``nn.Module``."""
    if isinstance(model, ModelShape):
        return model
    if isinstance(model, str):
        return model_preset(model)
    if isinstance(model, Mapping):
        return shape_from_config(model, "model config")
    from meshplan.checks.model_shape import shape_of_model
    return shape_of_model(model, type(model).__name__)[0]


def as_cluster(cluster: Cluster | str | Path) -> Cluster:
    """A :class:`Cluster` from itself, a preset name or a ``meshplan profile`` file."""
    if isinstance(cluster, Cluster):
        return cluster
    p = Path(cluster)
    return load_cluster_file(p) if p.suffix == ".json" or p.is_file() else cluster_preset(str(cluster))


def estimate(plan: Any, model: Any, world_size: int, seq: int, global_batch: int, *, microbatches: int = 1,
             dtype: str = "float32", cluster: Cluster | str | Path = "h100-80g") -> Estimate:
    """Memory per rank, collectives per step and step time of ``plan`` for ``model`` (see ``meshplan estimate``).

    Raises:
        PlanError: the plan does not resolve or its layout breaks a rule (:mod:`meshplan.solver.rules`).
    """
    from meshplan.errors import PlanError
    from meshplan.plan_file.document import as_plan
    from meshplan.solver.plans import candidate_from_plan
    from meshplan.solver.rules import model_problem, run_problem
    p = as_plan(plan)
    cand, train = candidate_from_plan(p, world_size, seq, global_batch, microbatches=microbatches, dtype=dtype)
    shape, cl = as_shape(model), as_cluster(cluster)
    why = model_problem(shape, cand) or run_problem(shape, cand, train, cl.device)
    if why:
        raise PlanError(f"{p.source or '<plan>'}: {why[1]}")
    return evaluate(shape, cand, train, cl)


def solve(model: Any, gpus: int, seq: int, global_batch: int, *, cluster: Cluster | str | Path = "h100-80g",
          training: Mapping[str, Any] | None = None, space: Space | None = None) -> SearchResult:
    """Every layout of ``model`` on ``gpus`` devices (see ``meshplan solve``): valid ones fastest first, rejected
    ones with their rule. ``training``: :class:`Training` fields besides seq and global batch."""
    train = Training(seq=seq, global_batch=global_batch, **dict(training or {}))
    return search(as_shape(model), train, as_cluster(cluster), gpus, space)
