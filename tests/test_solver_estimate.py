"""``meshplan estimate`` against what one step on the meta device's sibling, a fake process group, really does.

Each plan is applied to the example Llama (or the example MoE) under a ``fake`` group of the plan's world
size (rank 0's view: exact shapes, no communication). Checked against :mod:`meshplan.solver`:

* parameter, gradient and optimizer bytes on the rank: exact (FSDP2's padded dim-0 chunks included);
* the collectives of one ``meshplan.train_step``, counted op by op by group size: exact;
* the bytes autograd keeps for backward (``meshplan.memory``: saved tensors, and FSDP2's gathered parameters
  alive after the forward): within 10%.

Pipeline plans need real point-to-point traffic (the schedule's shape inference): tests/test_dist_solver.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
import yaml

import meshplan
from meshplan.checks.dry_run import fake_group
from meshplan.checks.model_shape import shape_of_model
from meshplan.plan_file.document import Plan
from meshplan.solver.collectives import step_collectives
from meshplan.solver.memory import rank_memory
from meshplan.solver.placement import Placement
from meshplan.solver.plans import candidate_from_plan

pytestmark = pytest.mark.fast

TP = yaml.safe_load(open("plans/llama.yaml"))["tensor_parallel"]
CP = yaml.safe_load(open("plans/llama_cp.yaml"))["context_parallel"]
EP = yaml.safe_load(open("plans/moe.yaml"))["expert_parallel"]
MOE_TP = yaml.safe_load(open("plans/moe.yaml"))["tensor_parallel"]
FULL = {"activation_checkpointing": {"mode": "full"}}
SEQ, BATCH = 64, 8

#: name → (world, plan, model, microbatches)
PLANS = {
    "tp2": (2, {"layout": {"tp": 2}, "tensor_parallel": TP}, "llama", 1),
    "tp2_no_sp": (2, {"layout": {"tp": 2}, "tensor_parallel": {**TP, "sequence_parallel": False}}, "llama", 1),
    "tp2_no_loss_parallel": (2, {"layout": {"tp": 2}, "tensor_parallel": {**TP, "loss_parallel": False}}, "llama", 1),
    "tp2_save_gathered": (2, {"layout": {"tp": 2}, "tensor_parallel": {**TP, "save_gathered_inputs": True}}, "llama", 1),
    "fsdp4": (4, {"layout": {}}, "llama", 1),
    "fsdp4_mb2": (4, {"layout": {}}, "llama", 2),
    "fsdp4_mb2_reshard": (4, {"layout": {}, "data_parallel": {"accumulate_unsharded": False}}, "llama", 2),
    "fsdp4_no_reshard": (4, {"layout": {}, "data_parallel": {"reshard_after_forward": False}}, "llama", 1),
    "fsdp4_vocab_ends": (4, {"layout": {}, "data_parallel": {"ends": "vocab_parallel"}}, "llama", 1),
    "fsdp4_mb2_reshard_vocab_ends": (4, {"layout": {}, "data_parallel": {"ends": "vocab_parallel",
                                                                         "accumulate_unsharded": False}}, "llama", 2),
    "fsdp4_vocab_ends_tied": (4, {"layout": {}, "data_parallel": {"ends": "vocab_parallel"}}, "llama_tied", 1),
    "hsdp2x2": (4, {"layout": {"dp_replicate": 2}}, "llama", 1),
    "ddp4": (4, {"layout": {"dp_replicate": 4}}, "llama", 2),
    "tp2_fsdp2": (4, {"layout": {"tp": 2}, "tensor_parallel": TP}, "llama", 1),
    "tp2_full_ac": (2, {"layout": {"tp": 2}, "tensor_parallel": TP, "blocks": FULL}, "llama", 1),
    "tp2_no_sp_full_ac": (2, {"layout": {"tp": 2}, "tensor_parallel": {**TP, "sequence_parallel": False},
                              "blocks": FULL}, "llama", 1),
    "every2_ac": (1, {"layout": {}, "blocks": {"activation_checkpointing": {"mode": "selective", "every": 2}}},
                  "llama", 1),
    "op_level_ac": (1, {"layout": {}, "blocks": {"activation_checkpointing": {"mode": "selective",
                                                                            "ops": ["aten.mm.default"]}}}, "llama", 1),
    "tp2_megatron_ac": (2, {"layout": {"tp": 2}, "tensor_parallel": TP, "blocks": {"activation_checkpointing": {
        "mode": "selective", "policy": "megatron"}}}, "llama", 1),
    "cp2": (2, {"layout": {"cp": 2}, "context_parallel": CP}, "llama", 1),
    "cp2_tp2": (4, {"layout": {"cp": 2, "tp": 2}, "context_parallel": CP, "tensor_parallel": TP}, "llama", 1),
    "cp2_full_ac": (2, {"layout": {"cp": 2}, "context_parallel": CP, "blocks": FULL}, "llama", 1),
    "ep2": (2, {"layout": {"ep": 2}, "expert_parallel": EP}, "moe", 1),
    "ep2_full_ac": (2, {"layout": {"ep": 2}, "expert_parallel": EP, "blocks": FULL}, "moe", 1),
    "tp2_ep2": (4, {"layout": {"tp": 2, "ep": 2, "etp": 1}, "tensor_parallel": MOE_TP, "expert_parallel": EP},
                "moe", 1),
}


def _model(kind: str, layers: int = 4):
    import llama
    import moe
    common = dict(dim=64, n_layers=layers, n_heads=4, n_kv_heads=2, vocab_size=128, ffn_dim=128, max_seq_len=SEQ,
                  dropout=0.0)
    torch.manual_seed(0)
    if kind == "moe":
        return moe.build(moe.ModelArgs(**common, moe_hidden=96, n_experts=4, top_k=2, capacity_factor=None,
                                       aux_loss_coef=0.0))
    return llama.build(llama.ModelArgs(**common, tie_embeddings=kind == "llama_tied"))


def _estimate(name: str, model):
    world, data, _, mb = PLANS[name]
    plan = Plan.from_data(data, source=name)
    shape, warning = shape_of_model(model)
    assert warning is None, warning
    lay = plan.layout.resolve(world)
    cand, train = candidate_from_plan(plan, world, SEQ, BATCH * lay.dp_replicate * lay.dp_shard, microbatches=mb)
    place = Placement(cand, shape.layers, 8)
    return shape, cand, train, place, plan


def _counts(collectives) -> dict[str, int]:
    """Calls by ``kind@group size``, as a CPU mesh runs them: DTensor's all-to-all there is an all-gather (the
    vocab-parallel head's logits: :func:`meshplan.solver.collectives.vocab_end_collectives`)."""
    out: dict[str, int] = {}
    for x in collectives:
        kind = "all_gather" if x.kind == "all_to_all" and "vocab-parallel" in x.what else x.kind
        key = f"{kind}@{x.group.size}"
        out[key] = out.get(key, 0) + x.count
    return out


def _measure(name: str):
    """One train_step's collectives, then the state and saved bytes, on rank 0 of a fake group."""
    from benchmarks._comm import CommLog
    world, data, kind, mb = PLANS[name]
    plan = Plan.from_data(data, source=name)
    with fake_group(world):
        model = _model(kind)
        pristine = copy.deepcopy(model)
        with meshplan.init(plan) as topo:
            meshplan.parallelize(model, plan, topo)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            x = torch.randint(0, 128, (BATCH, SEQ))
            with CommLog() as log:
                meshplan.train_step(model, (x, x), meshplan.cross_entropy, opt, topology=topo, max_grad_norm=1.0,
                                    microbatches=mb)
            state = meshplan.parallel_state(model)

            def step():
                xs, ys = x[:BATCH // mb], x[:BATCH // mb]
                if state.context_parallel is not None:
                    from meshplan.context_parallel.batch import shard_for_state
                    xs, ys, _ = shard_for_state(state, xs, ys, False, -100)
                return meshplan.cross_entropy(model(xs), ys)
            saved = meshplan.memory(model, step).saved
            local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
            params = sum(local(p).numel() * local(p).element_size() for p in model.parameters())
            grads = sum(local(p.grad).numel() * local(p.grad).element_size() for p in model.parameters()
                        if p.grad is not None)
            opt.step()
            states = sum(local(v).numel() * local(v).element_size() for st in opt.state.values()
                         for v in st.values() if torch.is_tensor(v))
    counts = {k: v for k, v in log.by_group().items() if not k.endswith("@1")}  # a group of one moves nothing
    return pristine, counts, params, grads, states, saved


@pytest.mark.parametrize("name", list(PLANS))
def test_estimate_matches_one_step(name):
    pristine, counts, params, grads, states, saved = _measure(name)
    shape, cand, train, place, _ = _estimate(name, pristine)
    mem = rank_memory(shape, cand, train, place, 0)
    assert (mem.params, mem.grads, mem.optimizer) == (params, grads, states)
    assert _counts(step_collectives(shape, cand, train, place, 0)) == counts
    if cand.microbatches == 1:  # with accumulation FSDP keeps every block gathered: not one plain forward
        kept = mem.activations + mem.gathered
        if cand.vocab_ends:  # alive after a CPU forward: the head's [n·tokens, vocab/n] output (estimate's transient)
            # and DTensor's all-gather standing in for the all-to-all on a CPU mesh (n× that; none on GPUs)
            kept += (cand.dp_shard + 1) * cand.rank_tokens(SEQ) * shape.vocab * train.act_bytes
        assert abs(kept / saved - 1) < 0.10, (kept, saved)


def test_shape_of_the_example_models_counts_their_parameters():
    for kind in ("llama", "moe"):
        shape, warning = shape_of_model(_model(kind))
        assert warning is None
        assert shape.layers == 4 and shape.hidden == 64 and shape.kv_heads == 2


def test_cli_estimate_rank_equals_what_vocab_parallel_ranks_hold(tmp_path, capsys):
    """``meshplan estimate PLAN --config CONFIG --rank R`` (what ``benchmarks/scale.py`` compares) with ``ends:
    vocab_parallel``: each rank's parameter, gradient and AdamW bytes equal its local tensors' after one step on
    the fake group (the embedding's gradient whole: torch's ``Replicate``)."""
    import json

    from meshplan.cli.main import main
    _, data, _, _ = PLANS["fsdp4_vocab_ends"]
    (tmp_path / "plan.yaml").write_text(yaml.safe_dump(data))
    config = json.dumps(dict(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=128, ffn_dim=128))
    _, _, params, grads, states, _ = _measure("fsdp4_vocab_ends")  # rank 0; the 4 ranks' chunks are equal
    for rank in (0, 3):
        assert main(["estimate", str(tmp_path / "plan.yaml"), "--config", config, "--world-size", "4", "--seq",
                     str(SEQ), "--global-batch", str(4 * BATCH), "--rank", str(rank), "--format", "json"]) == 0
        got = json.loads(capsys.readouterr().out)["rank"]
        assert (got["params"], got["grads"], got["optimizer"]) == (params, grads, states), rank
