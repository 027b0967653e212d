"""Real torchrun/gloo launches (world 4 and 8) for init and topology."""

import pytest

from _launch import case_result, launch

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module", params=[4, 8])
def results(request):
    return request.param, launch("tests/dist/topology_worker.py", request.param)


def test_groups_reduce_over_engine_ranks(results):
    n, res = results
    values = case_result(res, "init_and_groups", n)
    assert len({tuple(v) for v in values.values()}) == 1  # same fingerprints everywhere


def test_init_keeps_a_cpu_jobs_freed_memory(results):
    """meshplan/mesh/host_memory.py, on every rank: a 4 MiB tensor comes from the heap, and 200 of them fault in
    at most a few heap extensions' pages (204,800 faults if each came from a fresh mmap); a 64 MiB one too."""
    n, res = results
    values = case_result(res, "host_memory", n).values()
    assert all(mapped == 0 and faults < 20480 and large == 0 for mapped, faults, large in values), values


def test_layout_mismatch_fails_on_every_rank(results):
    n, res = results
    assert set(case_result(res, "mismatch", n).values()) == {"raised"}


@pytest.mark.parametrize("case, where", [("init_plan_mismatch", "meshplan.init"),
                                         ("parallelize_plan_mismatch", "meshplan.parallelize")])
def test_plan_mismatch_fails_on_every_rank_with_a_diff(results, case, where):
    n, res = results
    values = case_result(res, case, n)
    messages = {v["message"] for v in values.values()}
    assert len(messages) == 1, messages  # the same one line everywhere
    msg = messages.pop()
    assert "\n" not in msg
    assert msg.startswith(f"ranks disagree on the plan given to {where}: "), msg
    assert "tensor_parallel.sequence_parallel: rank 0 has false, rank 1 has true" in msg, msg
    assert "tensor_parallel.rules.'layers.*.b'.style: rank 0 has \"rowwise\", rank 1 has \"colwise\"" in msg, msg
    assert msg.endswith("every rank must load the same plan"), msg
    if case == "parallelize_plan_mismatch":
        assert "rank(s) [1] pass another plan than they gave meshplan.init" in msg, msg
    assert max(v["seconds"] for v in values.values()) < 30  # no hang until the process-group timeout (120 s)


#: what each one-rank mismatch's message must hold (besides naming rank 0 and rank 1)
MISMATCH_TEXT = {
    "sequence_parallel": "tensor_parallel.sequence_parallel: rank 0 has false, rank 1 has true",
    "loss_parallel": "tensor_parallel.loss_parallel: rank 0 has false, rank 1 has true",
    "rule": "tensor_parallel.rules.'layers.*.b'.style: rank 0 has \"rowwise\", rank 1 has \"colwise\"",
    "fsdp_dtype": "data_parallel.param_dtype: rank 0 has \"float32\", rank 1 has \"bfloat16\"",
    "faults_timeout": "faults: rank 0 has null, rank 1 has {\"dump_dir\": null, \"flight_recorder\": 2000, "
                      "\"heartbeat_s\": 2.0, \"init_timeout_s\": 600.0, \"timeout_s\": 30.0}",
    "model_shape": "layers.0.b.weight: rank 0 has [8, 8] float32, rank 1 has [16, 8] float32; layers.0.b.bias: "
                   "rank 0 has [8] float32, rank 1 has [16] float32 (2 of 4 parameters and buffers differ); every "
                   "rank must build the same model",
    "model_layers": "layers.1.a.weight: rank 0 has no such parameter or buffer, rank 1 has [8, 8] float32",
    "model_dtype": "layers.0.a.weight: rank 0 has [8, 8] float32, rank 1 has [8, 8] bfloat16",
    "torch_version": "ranks disagree on the software: torch: rank 0 has \"2.13.0+cpu\", rank 1 has \"2.12.1+cpu\"; "
                     "every rank must run the same torch, meshplan and Python",
    "world_layout": "ranks disagree on the layout: rank 0 has 'tp=2;",
}


@pytest.mark.parametrize("name", sorted(MISMATCH_TEXT))
def test_one_rank_mismatch_fails_every_rank_with_the_diff(results, name):
    """Rank 1 with another plan key, model, dtype, torch or layout: every rank raises the same one-line PlanError
    with the diff, within seconds (no hang until the timeout, no gloo size error naming nothing)."""
    import torch
    n, res = results
    values = case_result(res, f"mismatch_{name}", n)
    messages = {v["message"] for v in values.values()}
    assert len(messages) == 1, messages  # the same line on every rank
    msg = messages.pop()
    assert "\n" not in msg and msg.startswith("ranks disagree on the "), msg
    assert MISMATCH_TEXT[name].replace("2.13.0+cpu", torch.__version__) in msg, msg
    if name == "world_layout":
        assert "vs tp=4" in msg and "every rank must load the same plan and run in the same world" in msg, msg
    assert max(v["seconds"] for v in values.values()) < 30


def test_every_group_waits_the_plans_timeout(results):
    n, res = results
    for value in case_result(res, "group_timeouts", n).values():
        assert value["torch"] == 1800.0  # a DeviceMesh sub-group, torch alone: 30 minutes
        assert value["groups"] >= 3 and value["init"] == [77.0] and value["steady"] == [33.0], value
