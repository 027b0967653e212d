"""Every private torch API in ``meshplan/_torch.py`` still imports and behaves as meshplan uses it (torch 2.13)."""

import inspect
import json

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from meshplan import _torch

pytestmark = pytest.mark.fast


def test_private_names_import():
    for name in _torch.__all__:
        assert getattr(_torch, name) is not None, name


def test_simulated_ranks_compute_collectives_per_rank():
    from meshplan.mesh.topology import build_mesh
    with _torch.simulated_ranks(2):
        mesh = build_mesh({"tp": 2})["tp"]
        x = DTensor.from_local(torch.ones(3), mesh, [Partial()]).redistribute(mesh, [Replicate()])
        local = x.to_local()
        assert isinstance(local, _torch.LocalTensor)
        values = _torch.rank_tensors(local)
        assert sorted(values) == [0, 1] and all(torch.equal(v, torch.full((3,), 2.0)) for v in values.values())


# ---------------------------------------------------------------- DTensor internals


def test_local_tensor_is_the_stored_shard_without_autograd(fake_pg):
    with fake_pg(2):
        mesh = init_device_mesh("cpu", (2,))
        x = DTensor.from_local(torch.arange(4.0), mesh, [Shard(0)], run_check=False).requires_grad_()
        local = _torch.local_tensor(x)
        assert type(local) is torch.Tensor and local.grad_fn is None and torch.equal(local, torch.arange(4.0))
        plain = torch.ones(2)
        assert _torch.local_tensor(plain) is plain


def test_strided_shard_and_local_shape(fake_pg):
    with fake_pg(2, rank=1):
        mesh = init_device_mesh("cpu", (2,))
        p = _torch.StridedShard(0, split_factor=3)
        assert p.dim == 0 and p.split_factor == 3 and isinstance(p, Placement)
        shape, offset = _torch.compute_local_shape_and_global_offset((6, 4), mesh, [Shard(0)])
        assert tuple(shape) == (3, 4) and tuple(offset) == (3, 0)


def test_functional_collectives_run_per_rank():
    from meshplan.mesh.topology import build_mesh
    with _torch.simulated_ranks(2):
        mesh = build_mesh({"tp": 2})["tp"]
        x = DTensor.from_local(torch.ones(2), mesh, [Shard(0)]).to_local()
        out = _torch.funcol.all_reduce(x, "sum", mesh.get_group())
        if isinstance(out, _torch.funcol.AsyncCollectiveTensor):
            out = out.wait()
        assert all(torch.equal(v, torch.full((2,), 2.0)) for v in _torch.rank_tensors(out).values())


def test_loss_parallel_patches_the_handler_table():
    from torch.distributed.tensor.parallel import loss_parallel
    table = _torch.dtensor_op_handlers()
    assert isinstance(table, dict) and _torch.LOG_SOFTMAX not in table
    with loss_parallel():
        assert _torch.LOG_SOFTMAX in _torch.dtensor_op_handlers()
    assert _torch.LOG_SOFTMAX not in _torch.dtensor_op_handlers()


def test_sharding_rule_api():
    assert {"args_schema", "kwargs_schema"} <= set(_torch.OpSchema.__dataclass_fields__)
    assert callable(_torch.OpSchema.get_mesh_from_args)
    assert isinstance(_torch.OpStrategy.ndim, property) and isinstance(_torch.OpStrategy.shape, property)
    assert issubclass(_torch.OpStrategy, _torch.StrategyType)
    params = inspect.signature(_torch.expand_to_full_mesh_op_strategy).parameters
    assert {"input_index", "is_valid_strategy_cb"} <= set(params)
    assert list(inspect.signature(_torch.is_tensor_evenly_shardable_on_dim).parameters) == ["shape", "spec", "dim"]
    prop = _torch.sharding_propagator()
    assert all(isinstance(getattr(prop, t), dict)
               for t in ("op_strategy_funcs", "op_to_rules", "op_single_dim_strategy_funcs"))
    assert list(inspect.signature(prop.register_op_strategy).parameters)[:2] == ["op_overload", "strategy_func"]
    assert isinstance(_torch.CPU_FLASH_ATTENTION, _torch.OpOverload)
    assert isinstance(_torch.CPU_FLASH_ATTENTION_BACKWARD, _torch.OpOverload)


# ---------------------------------------------------------------- meshes


def test_flatten_mesh(fake_pg):
    with fake_pg(4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
        named = _torch.flatten_mesh(mesh, "ab")
        assert named.mesh_dim_names == ("ab",) and named.size() == 4
        assert _torch.flatten_mesh(mesh).size() == 4


# ---------------------------------------------------------------- autograd and dispatch


def test_queue_backward_callback_runs_after_backward():
    ran = []
    x = torch.ones(2, requires_grad=True)
    y = x * 2
    y.register_hook(lambda g: _torch.queue_backward_callback(lambda: ran.append(x.grad is not None)))
    y.sum().backward()
    assert ran == [True]


def test_saved_tensors_hooks_active():
    assert not _torch.saved_tensors_hooks_active()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        assert _torch.saved_tensors_hooks_active()
    x = torch.ones(2, requires_grad=True)
    seen = []
    torch.utils.checkpoint.checkpoint(lambda a: seen.append(_torch.saved_tensors_hooks_active()) or a * 2, x,
                                      use_reentrant=False)
    assert seen == [True]  # non-reentrant activation checkpointing runs the forward under its hooks


def test_hook_registered_and_tensor_version():
    t = torch.ones(2, requires_grad=True)
    handle = t.register_hook(lambda g: g)
    assert _torch.hook_registered(t, handle)
    handle.remove()
    assert not _torch.hook_registered(t, handle)
    v = _torch.tensor_version(t.detach())
    t.detach().add_(1)
    assert _torch.tensor_version(t) > v


def test_dispatch_mode_and_pytree():
    seen = []

    class Record(_torch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    with Record():
        torch.ones(2) + 1
    assert "aten.add" in seen
    assert _torch.tree_map(lambda v: v * 2, {"a": (1, [2])}) == {"a": (2, [4])}
    assert _torch.tree_leaves({"a": (1, [2]), "b": 3}) == [1, 2, 3]


# ---------------------------------------------------------------- ops


def test_ops():
    grads = [torch.ones(2), torch.full((3,), 2.0)]
    _torch.foreach_mul_(grads, 0.5)
    assert torch.equal(grads[1], torch.ones(3))
    masked = torch.tensor([[0.0, 0.0], [float("-inf"), float("-inf")]])
    assert torch.equal(_torch.safe_softmax(masked, -1), torch.tensor([[0.5, 0.5], [0.0, 0.0]]))
    assert torch.allclose(_torch.LOG_SOFTMAX(torch.zeros(2), 0, False), torch.full((2,), -0.6931), atol=1e-4)


# ---------------------------------------------------------------- modules and styles


def test_modules():
    assert all(issubclass(c, _torch.DropoutNd) for c in (nn.Dropout, nn.Dropout1d, nn.AlphaDropout))
    lin, bn = nn.Linear(2, 2), nn.BatchNorm1d(2)
    assert _torch.module_parameters(lin) is lin.__dict__["_parameters"] and set(_torch.module_parameters(lin)) == {
        "weight", "bias"}
    assert {"running_mean", "running_var"} <= set(_torch.module_buffers(bn))


def test_style_prepare_fns():
    from torch.distributed.tensor.parallel import ColwiseParallel
    style = ColwiseParallel()
    inp, out = _torch.style_prepare_fns(style)
    assert inp.args == (style.input_layouts, style.desired_input_layouts)
    assert out.args == (style.output_layouts, style.use_local_output)
    assert list(inspect.signature(inp).parameters) == ["mod", "inputs", "device_mesh"]


# ---------------------------------------------------------------- data parallelism


def test_data_parallel():
    model = nn.Sequential(_torch.checkpoint_wrapper(nn.Linear(2, 2)))
    assert isinstance(model[0], _torch.CheckpointWrapper)
    assert [n for n, _ in model.named_parameters()] == [f"0.{_torch.CHECKPOINT_PREFIX}weight",
                                                        f"0.{_torch.CHECKPOINT_PREFIX}bias"]
    from torch.distributed._composable.replicate_with_fsdp import replicate
    assert {"mesh", "mp_policy", "offload_policy"} <= set(inspect.signature(replicate).parameters)


def test_ring_attention_dispatch_enables_and_restores_torchs_cp_handlers():
    """context_parallel.ring: torch's CP SDPA handlers join DTensor's custom handlers inside, the load-balance flag
    is set for the call, and both are restored after (the ring kernels themselves need CUDA)."""
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp_attention
    flash = torch.ops.aten._scaled_dot_product_flash_attention.default
    handlers = lambda: DTensor._op_dispatcher._custom_op_handlers  # noqa: E731
    before, flag = dict(handlers()), cp_attention._cp_options.enable_load_balance
    assert flash not in before
    with _torch.ring_attention_dispatch(load_balance=not flag):
        assert flash in handlers() and cp_attention._cp_options.enable_load_balance is (not flag)
    assert dict(handlers()) == before and cp_attention._cp_options.enable_load_balance is flag


# ---------------------------------------------------------------- faults


def test_group_timeouts_store_and_flight_recorder():
    """In a process of its own (the flight recorder's size is read once, when the first group is made): a new group
    gets torch's 30 minutes, not init_process_group's timeout (so do DeviceMesh's sub-groups: test_dist_topology),
    until set_group_timeout; group_options makes a DeviceMesh dim's group with its timeout; the default store is a
    Store; the recorder lists each collective with the fields meshplan.faults.flight reads."""
    import os
    import subprocess
    import sys
    import textwrap
    code = textwrap.dedent("""
        import datetime, json, torch, torch.distributed as dist
        from meshplan import _torch
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=5))
        tp = dist.new_group([0])
        timeout = lambda g: g._get_backend(torch.device("cpu")).options._timeout.total_seconds()
        before = [timeout(dist.group.WORLD), timeout(tp)]
        _torch.set_group_timeout(tp, 7.0)
        from torch.distributed.device_mesh import init_device_mesh
        made = init_device_mesh("cpu", (1, 1), mesh_dim_names=("a", "b"), backend_override={"b": _torch.group_options(9.0)})
        dist.all_reduce(torch.ones(3), group=tp)
        import time
        deadline = time.monotonic() + 60  # gloo retires the entry from its worker thread, after wait() returned
        while True:
            dump = _torch.flight_recorder_dump(stack_traces=True)
            e = dump["entries"][-1]
            if str(e["retired"]) == "True" or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        print(json.dumps({"before": before, "after": timeout(tp), "made": timeout(made.get_group("b")), "store": isinstance(_torch.default_store(),
                          dist.Store), "entry": {k: str(e[k]) for k in ("process_group", "profiling_name",
                          "collective_seq_id", "retired", "pg_id")}, "frames": bool(e["frames"]),
                          "time": e["time_created_ns"] > 0, "status": sorted(dump["pg_status"][str(e["pg_id"])]),
                          "name": tp.group_name}))
        dist.destroy_process_group()
    """)
    env = {**os.environ, "TORCH_FR_BUFFER_SIZE": "50", "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0 and out.stdout.strip(), out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["before"] == [5.0, 1800.0] and got["after"] == 7.0 and got["made"] == 9.0 and got["store"], got
    entry = got["entry"]
    assert entry["profiling_name"] == "gloo:all_reduce" and entry["process_group"].startswith(f"('{got['name']}'")
    assert entry["retired"] == "True" and got["frames"] and got["time"]
    assert "last_completed_collective" in got["status"], got


# ---------------------------------------------------------------- checkpoints


def test_checkpoint_private_globals_resolve_and_a_real_metadata_needs_no_other(tmp_path):
    """The private names meshplan's restricted unpickler allows exist, and a DCP save names no global outside them
    and the public metadata classes (a torch that pickles another would make every checkpoint refused)."""
    import importlib
    import warnings

    import torch.distributed.checkpoint as dcp
    from meshplan.checkpoint.safe_read import read_metadata
    for module, name in _torch.CHECKPOINT_PRIVATE_GLOBALS:
        assert getattr(importlib.import_module(module), name) is not None, (module, name)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    dcp.save({"w": torch.ones(2, 3, dtype=torch.bfloat16), "lr": 0.1}, checkpoint_id=str(tmp_path), no_dist=True)
    md = read_metadata(tmp_path)
    assert tuple(md.state_dict_metadata["w"].size) == (2, 3)


def test_forget_groups_drops_the_root_mesh_reference(fake_pg):
    """forget_groups drops a destroyed group from its root mesh's registry (its last reference: a gloo group's
    threads end only when it goes)."""
    import torch.distributed as dist
    with fake_pg(4, 1):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
        group = mesh.get_group("b")
        assert group.group_name in mesh._pg_registry
        dist.destroy_process_group(group)
        _torch.forget_groups([mesh["b"]], [group.group_name])
        assert group.group_name not in mesh._pg_registry and mesh.get_group("a").group_name in mesh._pg_registry


def test_unshard_in_place_sets_fsdp_async_unshard(fake_pg):
    """``data_parallel.prefetch: false`` relies on it: every FSDP2 param group gathers with async_op=True."""
    from torch.distributed.fsdp import fully_shard
    with fake_pg(2):
        mesh = init_device_mesh("cpu", (2,))
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        fully_shard(model[0], mesh=mesh)
        fully_shard(model, mesh=mesh)
        _torch.unshard_in_place(model)
        groups = [g for m in model.modules() if hasattr(m, "_get_fsdp_state")
                  for g in m._get_fsdp_state()._fsdp_param_groups]
        assert len(groups) == 2 and all(g.unshard_async_op for g in groups)
