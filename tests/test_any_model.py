"""Correct on any model, or a clear error (LocalTensorMode, tp=2): the architectures that broke naive TP, the
checks that refuse what cannot run, and ``check_numerics`` catching each failure class on purpose-broken code."""

import copy
import warnings

import pytest
import yaml
import torch

import meshplan
from _launch import ROOT
from _float64 import RTOL, float64_model, keep_float64
from examples.architectures import FACTORIES, gemma2, phi3, qwen3
from examples.hf_models import llama
from meshplan import PlanError
from meshplan.checks.numerics import check_numerics

pytestmark = pytest.mark.fast
warnings.filterwarnings("ignore")


def _meta(factory, **kw):
    with torch.device("meta"):
        return factory(**kw)


def _plan(path, rules=None, drop=(), **tp):
    data = meshplan.load_plan(path).model_dump(exclude_unset=True)
    data["tensor_parallel"]["rules"].update(rules or {})
    for k in drop:
        data["tensor_parallel"]["rules"].pop(k)
    data["tensor_parallel"].update(tp)
    return data


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_architecture_plans_check_and_match_one_device(name):
    factory, plan = FACTORIES[name]
    assert meshplan.check(_meta(factory), plan).ok
    torch.manual_seed(0)
    with keep_float64():  # float64: the errors are ~1e-15 whatever the CPU's kernels (float32 was ~1e-7)
        report = check_numerics(float64_model(factory()), plan, tp=2)
    assert report.ok, report.summary()
    assert report.loss_error <= RTOL and max(report.errors.values()) <= RTOL, report.summary()


@pytest.mark.parametrize("mode", ["fsdp", "hsdp", "ddp"])
def test_numerics_with_an_explicit_data_parallel_mode(mode):
    """``check --numerics`` simulates tp alone (dp 1): a plan that names its data-parallel mode checks like one
    that infers it (FSDP2's storage resizing crashed on simulated ranks: "resize_() on an invalid python storage")."""
    data = yaml.safe_load((ROOT / "plans" / "hf_llama.yaml").read_text())
    data["data_parallel"] = {"mode": mode}
    torch.manual_seed(0)
    with keep_float64():
        report = check_numerics(float64_model(llama()), data, tp=2)
    assert report.crash is None and report.ok, report.summary()


def _errors(model, plan, **kw):
    report = meshplan.check(model, plan, **kw)
    assert not report.ok
    return " | ".join(map(str, report.errors))


def test_keep_float64_keeps_model_reductions_asked_for_float32():
    """DiffLlama's lambdas (``torch.sum(q * k, dim=-1, dtype=torch.float32)``) stay float64: in float32 their
    gradients differed by 4.5e-7 at cp 2 (the zoo's WRONG), fp32 summation order, not a sharding error."""
    x = torch.randn(8, dtype=torch.float64)
    with keep_float64():
        assert torch.sum(x * x, dim=-1, dtype=torch.float32).dtype == torch.float64
        assert x.float().dtype == torch.float64
        assert torch.zeros(2, dtype=torch.float32).dtype == torch.float32


def test_unequal_packed_parts_refused_with_the_parts():
    e = _errors(_meta(phi3), _plan("plans/phi3.yaml", {"model.layers.*.self_attn.qkv_proj": {"style": "colwise", "packed": 3},
                                                       "model.layers.*.self_attn.o_proj": "rowwise"}))
    assert "packed(3) cannot shard out_features(128): its fused q|k|v parts are unequal (64|32|32" in e


def test_gathered_phi3_at_tp4_keeps_global_head_counts():
    """num_key_value_heads(2) does not divide by 4, but the gathered qkv output never reaches local heads."""
    assert meshplan.check(_meta(phi3), "plans/phi3.yaml", layout={"tp": 4}).ok
    torch.manual_seed(0)
    assert check_numerics(phi3(), "plans/phi3.yaml", tp=4).ok


def test_per_head_norms_need_head_norm():
    e = _errors(_meta(qwen3), _plan("plans/qwen3.yaml", drop=["model.layers.*.self_attn.q_norm"]))
    assert "module 'model.layers.0.self_attn.q_norm' (Qwen3RMSNorm) runs on this rank's shards" in e
    assert "expected 'model.layers.*.self_attn.q_norm: head_norm'" in e
    e = _errors(_meta(qwen3), _plan("plans/qwen3.yaml", {"model.layers.*.self_attn.k_norm": "replicate"}))
    assert "'replicate' assumes replicated inputs; found replicate, expected head_norm" in e
    e = _errors(_meta(llama), _plan("plans/hf_llama.yaml", {"model.norm": "head_norm"}))
    assert "module 'model.norm' (head_norm) is not inside a module whose colwise children output local shards" in e


def test_embedding_must_produce_the_sequence_sharded_stream():
    e = _errors(_meta(gemma2), _plan("plans/gemma2.yaml", {"model.embed_tokens": "replicate"}))
    assert "module 'model.embed_tokens' (nn.Embedding) writes to the sequence-sharded residual stream" in e
    assert meshplan.check(_meta(gemma2), _plan("plans/gemma2.yaml", {"model.embed_tokens": "replicate"},
                                               drop=[k for k, v in meshplan.load_plan("plans/gemma2.yaml")
                                                     .tensor_parallel.rules.items() if v.style == "norm"],
                                               sequence_parallel=False)).ok


def test_norm_style_on_a_linear_is_refused():
    e = _errors(_meta(llama), _plan("plans/hf_llama.yaml", {"model.layers.*.self_attn.q_proj": "norm"}))
    assert "module 'model.layers.0.self_attn.q_proj' is Linear; style norm expects a norm or dropout" in e


def test_parallelize_runs_the_same_validation_as_check():
    bad = _plan("plans/hf_llama.yaml", {"model.layers.*.self_attn.q_proj": "norm"}, drop=["model.norm"])
    want = _errors(_meta(llama), bad)
    from _local import local_ranks
    with local_ranks(2):
        with pytest.raises(PlanError) as info:
            meshplan.parallelize(llama(), bad, meshplan.build_mesh({"tp": 2}))
    for line in want.split(" | "):
        assert line in str(info.value)


def test_layout_less_plan():
    data = _plan("plans/hf_llama.yaml")
    data.pop("layout")
    report = meshplan.check(_meta(llama), data)
    assert report.ok and report.tp == 1 and "the plan has no layout and none was given" in report.warnings[0]
    from meshplan.mesh.runtime import _plan_and_layout
    with pytest.raises(PlanError, match="meshplan.init: the plan has no layout section"):
        _plan_and_layout(data)
    from meshplan.hf.convert import from_hf
    assert from_hf("llama")["layout"] == {"tp": 2}


def test_train_step_counts_tokens_as_the_models_loss():
    """transformers' causal LM shifts its labels: 28 targets here, not the 29 valid labels."""
    torch.manual_seed(0)
    model = llama()
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 128, (2, 16))
    labels = ids.clone()
    labels[0, :3] = -100
    res = meshplan.train_step(model, {"input_ids": ids, "labels": labels}, None,
                              torch.optim.SGD(model.parameters(), lr=0.0), microbatches=2)
    assert res.num_tokens == 28 and (labels != -100).sum() == 29
    assert abs(res.loss - float(ref(input_ids=ids, labels=labels).loss)) < 1e-6
    with pytest.raises(PlanError, match="loss_fn=None uses the model's own loss"):
        meshplan.train_step(model, (ids, labels), None, torch.optim.SGD(model.parameters(), lr=0.0))


# ---- check_numerics catches each failure class, with the static checks fooled on purpose -------------------

def test_numerics_flags_a_style_that_drops_subclass_behaviour(monkeypatch):
    """The old embedding style replaced forward: Gemma2's sqrt(hidden) scale was lost."""
    from meshplan.tensor_parallel import vocab_embedding

    def replacing_apply(self, module, mesh):
        module = vocab_embedding.distribute_module(module, mesh, self._partition)
        module.forward = lambda ids, _m=module: self._output(mesh, self._lookup(mesh, ids, _m.weight, _m.padding_idx))
        return module
    monkeypatch.setattr(vocab_embedding.VocabParallelEmbedding, "_apply", replacing_apply)
    torch.manual_seed(0)
    report = check_numerics(gemma2(), "plans/gemma2.yaml", tp=2)
    assert not report.ok and report.loss_error > 1e-4 and "model.embed_tokens.weight" in report.failed
    assert report.summary().startswith("WRONG at tp=2: loss")


def test_numerics_flags_per_head_norm_grads_not_summed(monkeypatch):
    from meshplan.tensor_parallel.check import validate
    monkeypatch.setattr(validate, "region_errors", lambda *a, **k: [])
    torch.manual_seed(0)
    report = check_numerics(qwen3(), _plan("plans/qwen3.yaml", drop=["model.layers.*.self_attn.q_norm",
                                                                     "model.layers.*.self_attn.k_norm"]), tp=2)
    assert not report.ok and {"model.layers.0.self_attn.q_norm.weight", "model.layers.1.self_attn.k_norm.weight"} <= \
        set(report.failed)


def test_numerics_reports_a_crash_with_torchs_message(monkeypatch):
    """Head counts divided although the module sees global (DTensor) heads: torch's view fails."""
    from meshplan.plan_file import style_semantics as tp
    from meshplan.tensor_parallel.check import validate
    monkeypatch.setattr(tp, "gives_local_shards", lambda o: True)
    monkeypatch.setattr(validate, "region_errors", lambda *a, **k: [])
    factory, plan = FACTORIES["torch_transformer"]
    torch.manual_seed(0)
    report = check_numerics(factory(), plan, tp=2)
    assert not report.ok and report.crash is not None and report.summary().startswith("crash at tp=2:")


def test_numerics_flags_in_place_ops_on_views(monkeypatch):
    from meshplan.tensor_parallel import styles
    monkeypatch.setattr(styles, "owned_local", lambda x: x.to_local() if hasattr(x, "to_local") else x)
    factory, plan = FACTORIES["olmo"]
    torch.manual_seed(0)
    report = check_numerics(factory(), plan, tp=2)
    assert report.crash is not None and "modified inplace" in report.crash


def test_cli_check_numerics(capsys, tmp_path):
    from meshplan.cli.main import main
    code = main(["check", "plans/qwen3.yaml", "--model", "examples.architectures:qwen3", "--numerics"])
    out = capsys.readouterr().out.splitlines()
    assert code == 0 and out[-2] == "ok" and out[-1].startswith("numerics: ok at tp=2: loss rel err")
    data = meshplan.load_plan("plans/qwen3.yaml").model_dump(exclude_unset=True, mode="json")
    data.pop("layout")
    f = tmp_path / "p.json"
    import json
    f.write_text(json.dumps(data))
    code = main(["check", str(f), "--model", "examples.architectures:qwen3"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "the plan has no layout and no --tp was given" in err and "\n" not in err


class _CenteredMLP(torch.nn.Module):
    """An MLP whose own code centres the gate over its features (as Gemma-3n's activation sparsity takes the
    mean and std of the gate projection): on tp-sharded features each rank would centre its shard alone."""

    def __init__(self, dim=16, hidden=32):
        super().__init__()
        self.gate, self.down = torch.nn.Linear(dim, hidden), torch.nn.Linear(hidden, dim)

    def forward(self, x):
        g = self.gate(x)
        return self.down(torch.relu(g - g.mean(-1, keepdim=True)))


class _Toy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.mlp, self.out = torch.nn.Embedding(32, 16), _CenteredMLP(), torch.nn.Linear(16, 32)

    def forward(self, tokens):
        h = self.emb(tokens)
        return self.out(h + self.mlp(h))


_TOY_PLAN = {"layout": {"tp": 2}, "tensor_parallel": {"sequence_parallel": False, "rules": {
    "emb": "embedding", "mlp.gate": "colwise", "mlp.down": "rowwise", "out": "lm_head"}}}


def test_check_finds_code_that_computes_across_shards():
    """The shadow run: the MLP's own mean over the sharded features needs a collective once the gate output is
    kept a DTensor, so check refuses it, naming the module; the numerics check confirms it is really wrong."""
    torch.manual_seed(0)
    report = meshplan.check(_Toy(), _TOY_PLAN)
    assert not report.ok and len(report.errors) == 1
    assert "module 'mlp' computes across the tp-sharded features of its colwise outputs" in str(report.errors[0])
    gathered = copy.deepcopy(_TOY_PLAN)
    gathered["tensor_parallel"]["rules"].update({"mlp.gate": {"style": "colwise", "output_layouts": "replicate"},
                                                 "mlp.down": {"style": "rowwise", "input_layouts": "replicate"}})
    assert meshplan.check(_Toy(), gathered).ok
    assert check_numerics(_Toy(), gathered, tp=2).ok


def test_numerics_flags_cross_shard_code_that_check_missed(monkeypatch):
    from meshplan.checks import shadow
    monkeypatch.setattr(shadow, "cross_shard_errors", lambda *a, **k: [])
    torch.manual_seed(0)
    report = check_numerics(_Toy(), _TOY_PLAN, tp=2)
    assert not report.ok and "mlp.gate.weight" in report.failed


def test_shadow_run_covers_deeper_models_than_its_small_copy():
    """The shadow run rebuilds a transformers model small (2 layers); the plan's rules are matched on that copy."""
    report = meshplan.check(_meta(llama, num_hidden_layers=6), "plans/hf_llama.yaml")
    assert report.ok and not [w for w in report.warnings if "cross-shard check skipped" in w], report.warnings
    report = meshplan.check(_meta(gemma2, num_hidden_layers=6), _plan("plans/gemma2.yaml"))
    assert report.ok and not report.warnings, report.warnings
