"""Private torch APIs meshplan relies on, imported here and nowhere else (tested with torch 2.13.0).

Each name says why meshplan needs it. ``tests/test_torch_private.py`` imports every one, so a torch
upgrade that moves one fails in one obvious place. Grouped by concern: simulated ranks, DTensor
internals, DTensor's sharding rules, meshes, autograd, ops, modules, data/pipeline/context parallelism, faults.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import pickle
from functools import partial
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

__all__ = [
    "FakeStore", "LocalTensor", "LocalTensorMode", "local_tensor_mode", "no_local_tensor_mode", "simulated_ranks",
    "rank_tensors", "module_view", "retarget_graph_device", "remove_split_marker",  # simulated ranks, stage views
    "StridedShard", "local_tensor", "compute_local_shape_and_global_offset", "funcol", "dtensor_op_handlers",  # DTensor
    "OpOverload", "OpSchema", "OpStrategy", "StrategyType", "expand_to_full_mesh_op_strategy",  # sharding rules
    "is_tensor_evenly_shardable_on_dim", "sharding_propagator", "flatten_mesh", "tree_map", "tree_leaves",  # rules
    "queue_backward_callback", "saved_tensors_hooks_active", "hook_registered", "tensor_version",  # autograd
    "foreach_mul_", "safe_softmax", "LOG_SOFTMAX", "CPU_FLASH_ATTENTION", "CPU_FLASH_ATTENTION_BACKWARD",  # ops
    "DropoutNd", "module_parameters", "module_buffers", "style_prepare_fns", "TorchDispatchMode",  # modules, modes
    "checkpoint_wrapper", "CheckpointWrapper", "CHECKPOINT_PREFIX", "replicate", "unshard_in_place",  # data parallel
    "step_microbatches", "ring_attention_dispatch", "CHECKPOINT_PRIVATE_GLOBALS",  # pipeline, cp, checkpoints
    "set_group_timeout", "group_options", "default_store", "flight_recorder_dump", "forget_groups",  # faults
]

# ---------------------------------------------------------------- simulated ranks

# a process group that communicates nothing: meshes and shapes at any world size in one process
from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: E402

# N ranks simulated in one process (each op runs per rank; collectives computed exactly): numerics checks
from torch.distributed._local_tensor import (  # noqa: E402
    LocalTensor, LocalTensorMode, local_tensor_mode, maybe_disable_local_tensor_mode as no_local_tensor_mode)


def rank_tensors(t: LocalTensor) -> dict[int, torch.Tensor]:
    """Each simulated rank's value of ``t``: the numerics check compares them with the one-device run."""
    return dict(t._local_tensors)


@contextlib.contextmanager
def simulated_ranks(world_size: int) -> Iterator[LocalTensorMode]:
    """``world_size`` ranks in this process: a ``fake`` default group and ``LocalTensorMode``. A fake group of
    another size is replaced (and restored on exit); a real default group is an error (collectives would leave).

    Raises:
        RuntimeError: a real process group is initialized.
    """
    import torch.distributed as dist
    from torch.distributed.tensor import _random
    prior = dist.get_world_size() if dist.is_initialized() else None
    if prior is not None and dist.get_backend() != "fake":
        raise RuntimeError(f"a real process group (backend {dist.get_backend()!r}) is initialized; a simulated run "
                           f"needs none")
    if prior is not None and prior != world_size:
        dist.destroy_process_group()
    if prior != world_size:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        with LocalTensorMode(world_size) as mode:
            yield mode
    finally:
        _random._rng_tracker = None  # may hold LocalTensors
        if prior != world_size:
            dist.destroy_process_group()
            if prior is not None:
                dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=prior)


# ---------------------------------------------------------------- DTensor internals

# packed (fused) weights: each fused projection sharded separately, yet the DTensor's global view is the weight
from torch.distributed.tensor.placement_types import _StridedShard as StridedShard  # noqa: E402

# this rank's slice of a global tensor for given placements: single-device dropout cuts its rank's noise
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset  # noqa: E402

# collectives that return tensors (traceable, and computed per rank under LocalTensorMode): loss and grad sync
import torch.distributed._functional_collectives as funcol  # noqa: E402


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's stored shard (no autograd edge, unlike ``to_local()``; grad sync, clipping), a plain tensor as is."""
    return t._local_tensor if isinstance(t, DTensor) else t


def dtensor_op_handlers() -> dict:
    """DTensor's process-wide custom op handlers: torch's ``loss_parallel`` patches them (so: is it active?)."""
    return DTensor._op_dispatcher._custom_op_handlers


# ---------------------------------------------------------------- DTensor sharding rules (CPU flash attention)

# the types and helpers of a sharding strategy: torch has none for CPU flash attention, meshplan registers one
from torch._ops import OpOverload  # noqa: E402
from torch.distributed.tensor._op_schema import OpSchema, OpStrategy, StrategyType  # noqa: E402
from torch.distributed.tensor._ops.utils import (  # noqa: E402
    expand_to_full_mesh_op_strategy, is_tensor_evenly_shardable_on_dim)


def sharding_propagator() -> Any:
    """DTensor's process-wide sharding propagator, where meshplan registers the CPU attention strategies."""
    return DTensor._op_dispatcher.sharding_propagator


# ---------------------------------------------------------------- meshes

def flatten_mesh(mesh: Any, name: str | None = None) -> Any:
    """``mesh`` (a DeviceMesh) flattened to one dim named ``name``: the one process group over several axes
    that meshplan's composite meshes (``dp``, ``dp_cp``, …) and the loss's single all-reduce use."""
    return mesh._flatten(name)


def forget_groups(meshes: list, names: list[str]) -> None:
    """Drop ``names`` from mesh roots' registries and empty DTensor's caches (their meshes equal later ones)."""
    for mesh in meshes:
        [mesh._get_root_mesh()._pg_registry.pop(name, None) for name in names]
    from torch.distributed.tensor import _redistribute, debug
    debug._clear_sharding_prop_cache()
    _redistribute.clear_redistribute_planner_cache()


# ---------------------------------------------------------------- autograd and dispatch

def saved_tensors_hooks_active() -> bool:
    """Is a saved-tensor hook pair active (activation checkpointing's, a user's)? Nested hooks replace the outer
    ones, so the SP re-gather (:mod:`meshplan.tensor_parallel.regather`) stands aside then."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


def queue_backward_callback(fn: Callable[[], None]) -> None:
    """Run ``fn`` when the current backward ends: grad sync reduces all pending gradients then, in one go."""
    torch.autograd.Variable._execution_engine.queue_callback(fn)


def hook_registered(t: torch.Tensor, handle: Any) -> bool:
    """Is the hook of ``handle`` still on ``t``? Grad sync hooks FSDP2's persistent parameters once only."""
    return handle.id in (t._backward_hooks or {})


def tensor_version(t: torch.Tensor) -> int:
    """``t``'s in-place write counter: materialize tells whether an initializer wrote a placeholder."""
    return t._version


# a mode that sees every aten op: the shadow check records the collectives each region issues
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
# maps over nested args/outputs (tuples, dicts, dataclasses) as torch flattens them: modes and output hooks
from torch.utils._pytree import tree_leaves, tree_map  # noqa: E402


# ---------------------------------------------------------------- ops

# one fused in-place multiply over every gradient: clipping scales all grads in one call
foreach_mul_ = torch._foreach_mul_
# SDPA's math-path softmax (a fully masked row gives 0, not NaN): sdpa_math matches it bit for bit
safe_softmax = torch._safe_softmax
# one of the ops torch's loss_parallel patches: its handler's presence says loss_parallel is active
LOG_SOFTMAX = torch.ops.aten._log_softmax.default
# what CPU SDPA dispatches to with dropout_p == 0: the ops meshplan gives a DTensor sharding rule
CPU_FLASH_ATTENTION = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
CPU_FLASH_ATTENTION_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


# ---------------------------------------------------------------- modules and styles
DropoutNd = nn.modules.dropout._DropoutNd  # the base of every nn.Dropout*: how tp finds the dropouts of a model


def module_parameters(m: nn.Module) -> dict[str, nn.Parameter | None]:
    """``m``'s own parameter slots, the live dict: materialize swaps tensors in and out without hooks or checks
    (``setattr`` would refuse a plain tensor); the experts style shows grouped experts their local shards."""
    return m._parameters


def module_buffers(m: nn.Module) -> dict[str, torch.Tensor | None]:
    """``m``'s own buffer slots, the live dict: materialize re-ties shared buffers after ``to_empty``."""
    return m._buffers


def style_prepare_fns(style: Any) -> tuple[Callable, Callable]:
    """A torch Colwise/RowwiseParallel style's input and output hooks, bound as ``_apply`` binds them."""
    return (partial(style._prepare_input_fn, style.input_layouts, style.desired_input_layouts),
            partial(style._prepare_output_fn, style.output_layouts, style.use_local_output))


# ---------------------------------------------------------------- data parallelism

# activation checkpointing per block that keeps the block a module (FSDP2 shards it, hooks still fire)
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (  # noqa: E402
    _CHECKPOINT_PREFIX as CHECKPOINT_PREFIX,  # the path segment a checkpoint wrapper adds to parameter names
    CheckpointWrapper, checkpoint_wrapper)


def replicate(module: nn.Module, **kwargs: Any) -> nn.Module:
    """torch's DDP built on FSDP2 (``replicate_with_fsdp``): ``data_parallel: ddp`` with FSDP2's mixed precision
    and offload policies. Imported on use: the module costs about a second to import."""
    from torch.distributed._composable.replicate_with_fsdp import replicate as _replicate
    return _replicate(module, **kwargs)


# ---------------------------------------------------------------- pipeline parallelism

def module_view(m: nn.Module) -> nn.Module:
    """A shallow copy of ``m`` sharing its parameters, buffers and children, with its own child slots and hook
    tables (nn.Module keeps them in private dicts): a pipeline stage is a view of the model whose children of
    other stages are replaced, and whose FSDP root hooks must not reach the model or the other stages."""
    view = copy.copy(m)
    for name, value in m.__dict__.items():
        if isinstance(value, dict) and name not in ("_parameters", "_buffers"):
            view.__dict__[name] = type(value)(value)
    return view


def retarget_graph_device(stage_module: nn.Module, device: torch.device) -> None:
    """Move a traced stage's factory ops (``torch.zeros(device=...)``) to ``device``: tracing burns the trace
    device in, ``Pipe.build_stage`` fixes it but the free ``build_stage`` for one stage module does not."""
    from torch.distributed.pipelining._IR import _modify_graph_op_device
    if isinstance(stage_module, torch.fx.GraphModule):
        _modify_graph_op_device(stage_module, device)


def remove_split_marker(m: nn.Module) -> None:
    """Undo ``pipeline(split_spec=...)``'s patch of ``m.forward`` (kept as ``m._orig_forward``): tracing leaves the
    model as it was."""
    if "_orig_forward" in vars(m):
        del m.forward, m._orig_forward


def unshard_in_place(module: nn.Module) -> None:
    """FSDP2 units under ``module`` gather with ``async_op=True``: each all-gather result freed after its copy-out."""
    module._set_unshard_async_op(True)


def step_microbatches(schedule: Any, n: int) -> None:
    """Run a one-stage schedule's own step loop on stand-in stages that record their calls: GPipe and 1F1B run
    their loop, not their ``pipeline_order`` IR (wrong for 1F1B's last rank in torch 2.13), so the order of the
    picture of ``meshplan check --schedule`` is what the loop calls."""
    schedule._step_microbatches([()] * n, [{}] * n, [None] * n)


# ---------------------------------------------------------------- context parallelism

@contextlib.contextmanager
def ring_attention_dispatch(load_balance: bool) -> Iterator[None]:
    """DTensor's context-parallel SDPA handlers (ring attention over the query's mesh, sequence-sharded q/k/v)
    enabled, with torch's causal load-balance flag set to ``load_balance`` (head-tail chunks, as meshplan lays
    them out). What ``context_parallel()`` does around SDPA, without its buffer sharding and its monkey-patch."""
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp_attention
    old = cp_attention._cp_options.enable_load_balance
    cp_attention._cp_options.enable_load_balance = load_balance
    cp_attention._enable_cp_dtensor_dispatcher()
    try:
        yield
    finally:
        cp_attention._disable_cp_dtensor_dispatcher()
        cp_attention._cp_options.enable_load_balance = old


# ---------------------------------------------------------------- faults

def set_group_timeout(group: Any, seconds: float) -> None:
    """``group``'s collective timeout: DeviceMesh sub-groups do not inherit init_process_group's (they get 30 min)."""
    torch.distributed.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=seconds), group)


def group_options(seconds: float) -> Any:
    """Options making a DeviceMesh dim's groups with this timeout: gloo keeps it for point-to-point waits."""
    options = torch._C._distributed_c10d.Backend.Options
    return options(torch.distributed.get_backend(), datetime.timedelta(seconds=seconds))


def default_store() -> Any:
    """The default group's c10d store (torchrun's agent hosts it): where ranks keep their heartbeats."""
    return torch.distributed.distributed_c10d._get_default_store()


def flight_recorder_dump(stack_traces: bool = False, only_active: bool = False) -> dict:
    """torch's flight recorder, ``{}`` when off: the entries say process_group, profiling_name, retired, frames…"""
    raw = torch._C._distributed_c10d._dump_fr_trace(includeCollectives=True, includeStackTraces=stack_traces,
                                                     onlyActive=only_active)
    return pickle.loads(raw) if raw else {}


# ---------------------------------------------------------------- checkpoints

#: the private globals a DCP ``.metadata`` pickle names (torch 2.13): a file's byte range, the memory-format enum,
#: a layout by name. meshplan's restricted unpickler (:mod:`meshplan.checkpoint.safe_read`) loads these and public
#: metadata classes only, so a crafted checkpoint cannot run code
CHECKPOINT_PRIVATE_GLOBALS = frozenset({("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
                                        ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
                                        ("torch.serialization", "_get_layout")})
