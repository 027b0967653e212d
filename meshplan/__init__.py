"""meshplan: plans that turn an ordinary ``nn.Module`` into an N-D parallel model."""

from meshplan.errors import PlanError, RankFailure
from meshplan.version import __version__

__all__ = ["PlanError", "RankFailure", "Layout", "ResolvedLayout", "Plan", "load_plan", "build_mesh", "init",
           "Topology", "current_topology", "parallelize", "cross_entropy", "loss_parallel",
           "train_step", "clip_grad_norm_", "materialize", "load_state_dict", "load_full_state_dict",
           "load_safetensors", "plan", "check", "parallel_state", "shard_sequence", "memory", "save", "load",
           "CheckpointManager", "DataState", "export_safetensors", "latest_checkpoint", "estimate", "solve"]


def __getattr__(name: str):
    # torch-dependent parts load lazily so `meshplan ranks` / `schema` stay fast and torch-free; the plan classes
    # too (pydantic: 0.13 s), so that `import meshplan` is instant and a Ctrl-C in the CLI's imports is one line
    if name in ("Layout", "ResolvedLayout"):
        import meshplan.plan_file.layout as layout
        return getattr(layout, name)
    if name in ("Plan", "load_plan"):
        import meshplan.plan_file.document as document
        return getattr(document, name)
    if name in ("build_mesh", "Topology", "current_topology"):
        import meshplan.mesh.topology as topology
        return getattr(topology, name)
    if name == "parallelize":
        from meshplan.apply import parallelize
        return parallelize
    if name in ("cross_entropy", "loss_parallel"):
        import meshplan.training.loss as loss
        return getattr(loss, name)
    if name in ("train_step", "StepResult"):
        import meshplan.training.step as train
        return getattr(train, name)
    if name == "clip_grad_norm_":
        from meshplan.training.clip import clip_grad_norm_
        return clip_grad_norm_
    if name == "parallel_state":
        from meshplan.state import parallel_state
        return parallel_state
    if name == "shard_sequence":
        from meshplan.axes import shard_sequence
        return shard_sequence
    if name == "materialize":
        from meshplan.weights.materialize import materialize
        return materialize
    if name in ("load_state_dict", "load_full_state_dict", "load_safetensors"):
        import meshplan.weights.load as loading
        return getattr(loading, name)
    if name in ("save", "load", "CheckpointManager", "DataState", "export_safetensors", "latest_checkpoint"):
        return _checkpoint(name)
    if name == "plan":
        from meshplan.decorator import plan
        return plan
    if name in ("memory", "ActivationMemory"):
        import meshplan.checks.memory as mem
        return getattr(mem, name)
    if name == "check":
        from meshplan.checks.offline import check
        return check
    if name in ("estimate", "solve"):  # torch-free: the layout solver and cost model
        import meshplan.solver.api as solver
        return getattr(solver, name)
    if name == "init":
        from meshplan.mesh.runtime import init
        return init
    raise AttributeError(f"module 'meshplan' has no attribute {name!r}")


def _checkpoint(name: str):
    if name == "save":
        from meshplan.checkpoint.save import save
        return save
    if name == "load":
        from meshplan.checkpoint.load import load
        return load
    if name == "CheckpointManager":
        from meshplan.checkpoint.manager import CheckpointManager
        return CheckpointManager
    if name == "DataState":
        from meshplan.checkpoint.manifest import DataState
        return DataState
    if name == "latest_checkpoint":
        from meshplan.checkpoint.directory import latest_complete
        return latest_complete
    from meshplan.checkpoint.export import export_safetensors
    return export_safetensors
