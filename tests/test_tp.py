"""Tensor/sequence parallelism in one process (LocalTensorMode): parity, exact collectives, final grads."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

import llama
import meshplan
from _local import assert_close_rel, from_ranks, local_ranks
from meshplan import PlanError

pytestmark = pytest.mark.fast
PLAN = meshplan.load_plan("plans/llama.yaml")


def plan_with(**tp):
    d = PLAN.model_dump(exclude_unset=True)
    d["tensor_parallel"].update(tp)
    d.pop("layout", None)
    return d


def reference(args, batch=4, seq=16, seed=0):
    torch.manual_seed(seed)
    model = llama.build(args)
    tokens = torch.randint(0, args.vocab_size, (batch, seq))
    labels = torch.randint(0, args.vocab_size, (batch, seq))
    labels[0, :5] = -100
    loss = F.cross_entropy(model(tokens).flatten(0, 1), labels.flatten(), ignore_index=-100)
    loss.backward()
    return model, tokens, labels, loss


def counts(cm):
    return {str(k).split(".")[-1]: v for k, v in cm.get_comm_counts().items()}


def run_tp(args, tp, sp, lp, batch=4):
    ref, tokens, labels, ref_loss = reference(args, batch=batch)
    with local_ranks(tp):
        topo = meshplan.build_mesh({"tp": tp})
        model = copy.deepcopy(ref)
        model.zero_grad(set_to_none=True)
        meshplan.parallelize(model, plan_with(sequence_parallel=sp, loss_parallel=lp), topo)
        if sp == "batch":  # each tp rank holds its own part of the batch
            n = batch // tp
            tokens_in = from_ranks({r: tokens[r * n:(r + 1) * n] for r in range(tp)})
            labels_in = from_ranks({r: labels[r * n:(r + 1) * n] for r in range(tp)})
        else:
            tokens_in, labels_in = tokens, labels
        with CommDebugMode() as fwd:
            logits = model(tokens_in)
        if lp:
            if sp == "batch":
                labels_in = labels  # the logits hold the whole tp group's batch
            loss = meshplan.cross_entropy(logits, labels_in)
        elif sp == "batch":
            valid = (labels != -100).sum()
            loss = F.cross_entropy(logits.flatten(0, 1), labels_in.flatten(), reduction="sum") / valid
        else:
            loss = F.cross_entropy(logits.flatten(0, 1), labels_in.flatten())
        with CommDebugMode() as bwd:
            loss.backward()
        if sp != "batch" or lp:
            assert_close_rel(loss, ref_loss)
        refp = dict(ref.named_parameters())
        for name, p in model.named_parameters():
            g = p.grad
            assert isinstance(g, DTensor) == isinstance(p, DTensor), name
            if isinstance(p, DTensor):  # final grads: the parameter's placement and local shape
                assert g.placements == p.placements, (name, g.placements, p.placements)
                assert g.to_local().shape == p.to_local().shape, name
            assert_close_rel(g, refp[name].grad, 1e-5)
        return counts(fwd), counts(bwd)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("sp", [True, False, "batch"])
@pytest.mark.parametrize("lp", [True, False])
def test_parity_example_llama(tp, sp, lp):
    args = llama.tiny_args(n_kv_heads=4)
    run_tp(args, tp, sp, lp)


def test_parity_stored_head_counts():
    run_tp(llama.tiny_args(n_kv_heads=4, head_reshape="stored"), 2, True, True)


def test_exact_collectives_sp():
    # per layer: 2 all-gathers + 2 reduce-scatters each way; embedding reduce-scatter fwd / all-gather bwd;
    # lm_head all-gather fwd / reduce-scatter bwd; loss_parallel: 3 small all-reduces; norms: ONE coalesced
    n = llama.tiny_args().n_layers
    fwd, bwd = run_tp(llama.tiny_args(n_kv_heads=4), 2, True, False)
    assert fwd == {"all_gather_into_tensor": 2 * n + 1 + 1, "reduce_scatter_tensor": 2 * n + 1}  # +1: logits gathered
    assert bwd == {"all_gather_into_tensor": 2 * n + 1, "reduce_scatter_tensor": 2 * n + 1, "all_reduce": 1}


def test_exact_collectives_sp_loss_parallel():
    n = llama.tiny_args().n_layers
    fwd, bwd = run_tp(llama.tiny_args(n_kv_heads=4), 2, True, True)
    assert fwd == {"all_gather_into_tensor": 2 * n + 1, "reduce_scatter_tensor": 2 * n + 1}
    assert bwd == {"all_gather_into_tensor": 2 * n + 1, "reduce_scatter_tensor": 2 * n + 1, "all_reduce": 1}


def test_exact_collectives_no_sp():
    n = llama.tiny_args().n_layers
    fwd, bwd = run_tp(llama.tiny_args(n_kv_heads=4), 2, False, False)
    assert fwd == {"all_reduce": 2 * n + 1, "all_gather_into_tensor": 1}  # embedding all-reduce; logits gathered
    assert bwd == {"all_reduce": 2 * n + 1}  # one per block conversion, + the lm_head input


def test_fresh_styles_every_apply():
    from meshplan.tensor_parallel.generate import generate_tp_plan
    model = llama.build(llama.tiny_args())
    a, _ = generate_tp_plan(model, PLAN.tensor_parallel, 2)
    b, _ = generate_tp_plan(model, PLAN.tensor_parallel, 2)
    assert a.keys() == b.keys() and all(a[k] is not b[k] for k in a)
    assert "layers.0.attention" in a and "layers.1.feed_forward" in a  # one conversion per block
    assert repr(a["tok_embeddings"]).startswith("VocabParallelEmbedding(")


def test_errors_name_plan_rule_module_and_numbers():
    model = llama.build(llama.tiny_args())  # n_kv_heads 2
    with local_ranks(4):
        topo = meshplan.build_mesh({"tp": 4})
        with pytest.raises(PlanError, match=r"module 'layers.0.attention': tp\(4\) does not divide n_kv_heads\(2\); "
                                             r"valid tp: 1, 2"):
            meshplan.parallelize(copy.deepcopy(model), "plans/llama.yaml", topo)
    with local_ranks(2):
        topo = meshplan.build_mesh({"tp": 2})
        bad = plan_with(rules={"layers.*.atention.wq": "colwise"})
        with pytest.raises(PlanError, match=r"tensor_parallel.rules.'layers.\*.atention.wq': matches no module of "
                                             r"Transformer; found none, expected at least one; closest module paths: layers.0.attention.wq"):
            meshplan.parallelize(copy.deepcopy(model), bad, topo)
        clash = plan_with(rules={"layers.*.attention.wq": "colwise", "layers.*.attention.w?": "rowwise"})
        with pytest.raises(PlanError, match=r"module 'layers.0.attention.wq' is claimed by"):
            meshplan.parallelize(copy.deepcopy(model), clash, topo)
        wrong = plan_with(rules={"layers.*.attention_norm": "colwise"})
        with pytest.raises(PlanError, match=r"module 'layers.0.attention_norm' is RMSNorm; style colwise expects nn.Linear"):
            meshplan.parallelize(copy.deepcopy(model), wrong, topo)
        exact = plan_with(rules={"layers.*.attention.wq": "colwise", "layers.0.attention.wq": "rowwise"})
        from meshplan.plan_file.patterns import match_rules
        m = match_rules(model, meshplan.Plan.from_data(exact).tensor_parallel.rules)
        assert m["layers.0.attention.wq"][1].style == "rowwise" and m["layers.1.attention.wq"][1].style == "colwise"


def test_rule_with_torch_kwargs_overrides():
    d = plan_with()
    d["tensor_parallel"]["rules"]["output"] = {"style": "lm_head", "output_layouts": "replicate", "use_local_output": True}
    ref, tokens, labels, ref_loss = reference(llama.tiny_args())
    with local_ranks(2):
        model = copy.deepcopy(ref)
        meshplan.parallelize(model, d, meshplan.build_mesh({"tp": 2}))
        out = model(tokens)
        assert not isinstance(out, DTensor) and out.shape == (4, 16, 128)


def test_tied_embeddings_work():
    args = llama.tiny_args(n_kv_heads=4, tie_embeddings=True)
    fwd, bwd = run_tp(args, 2, True, True)
    ref = llama.build(args)
    with local_ranks(2):
        model = meshplan.parallelize(ref, "plans/llama.yaml", meshplan.build_mesh({"tp": 2}))
        assert model.output.weight is model.tok_embeddings.weight


def test_tied_with_different_placements_is_an_error():
    model = llama.build(llama.tiny_args(tie_embeddings=True))
    d = plan_with()
    d["tensor_parallel"]["rules"]["tok_embeddings"] = "embedding_colwise"
    with local_ranks(2):
        with pytest.raises(PlanError, match="tied parameters get different placements: tok_embeddings.weight"):
            meshplan.parallelize(model, d, meshplan.build_mesh({"tp": 2}))


def test_tp_one_applies_no_style_and_check_says_so(fake_pg):
    """tp 1 is no tensor parallelism (as torchtitan and Megatron): the section's rules are checked, nothing is
    applied (styles over one rank shard nothing and cost every parameter a DTensor and every block its hooks), and
    ``meshplan check`` lists no collective for it and says why."""
    from meshplan.checks.explain import summary_lines
    data = {**PLAN.model_dump(exclude_unset=True), "layout": {"tp": 1, "dp_replicate": 2}}
    plan = meshplan.Plan.from_data(data, source="tp1")
    model = llama.build(llama.tiny_args(n_kv_heads=4))
    with fake_pg(2, 0):
        meshplan.parallelize(model, plan, meshplan.build_mesh(plan.layout))
    placements = {tuple(p.placements) for p in model.parameters() if isinstance(p, DTensor)}
    assert len(placements) == 1 and len(next(iter(placements))) == 1  # DDP's one Replicate, no tp dim
    assert not any(m._forward_pre_hooks for m in model.modules() if m is not model)
    lines = summary_lines(meshplan.check(llama.build(llama.tiny_args(n_kv_heads=4)), plan, 2))
    assert "collectives per forward: none" in lines and "collectives per backward: none" in lines
    assert any(x.startswith("tensor parallelism: tp 1 is none") for x in lines)
    bad = plan.model_copy(update={"tensor_parallel": plan.tensor_parallel.model_copy(
        update={"rules": {**plan.tensor_parallel.rules, "nothing.here": plan.tensor_parallel.rules["norm"]}})})
    with pytest.raises(PlanError, match="nothing.here"), fake_pg(2, 0):  # still checked at tp 1
        meshplan.parallelize(llama.build(llama.tiny_args(n_kv_heads=4)), bad, meshplan.build_mesh(bad.layout))
