"""DeepSeek's Multi-head Latent Attention under tensor parallelism (LocalTensorMode, tp 2 and 4): transformers'
``mla_kv_a_proj`` plans converted, the latent path replicated with its gradient kept partial, heads split after it,
each tiny model equal to one device; a colwise on the wrong input refused by check and parallelize alike."""

import json
import warnings

import pytest
import torch

import meshplan
from meshplan.checks.numerics import check_numerics
from meshplan.hf.convert import from_hf, to_hf
from meshplan.hf.styles import resolve_alias
from meshplan.hf.tiny_config import tiny_config
from meshplan.hf.tiny_models import model_class

pytestmark = pytest.mark.fast
warnings.filterwarnings("ignore")
ATTN = "model.layers.*.self_attn."


def _model(model_type, tp, **overrides):
    """A tiny fp32 model of ``model_type`` (overrides: config values, e.g. ``q_lora_rank=None``)."""
    config = tiny_config(model_type, tp=tp, **overrides)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return model_class(model_type)(config).float().eval()


def _plan(model_type, tmp_path=None, tp=2, **overrides):
    """from_hf of ``model_type`` (through a config.json with ``overrides`` when given)."""
    source = model_type
    if overrides:
        source = tmp_path / "config.json"
        source.write_text(json.dumps({"model_type": model_type, **overrides}))
    plan = from_hf(source, tp=tp)
    plan.pop("_origin")
    return plan


def test_mla_kv_a_proj_is_the_latent_style():
    assert resolve_alias("mla_kv_a_proj") == {"style": "latent"}
    rules = _plan("deepseek_v2")["tensor_parallel"]["rules"]
    assert {k: rules[ATTN + k] for k in ("q_a_proj", "q_a_layernorm", "kv_a_proj_with_mqa", "kv_a_layernorm")} == \
        dict.fromkeys(("q_a_proj", "q_a_layernorm", "kv_a_proj_with_mqa", "kv_a_layernorm"), "latent")
    assert rules[ATTN + "q_b_proj"] == rules[ATTN + "kv_b_proj"] == "latent_colwise"
    assert rules[ATTN + "o_proj"] == "rowwise" and ATTN + "q_proj" not in rules  # q_lora_rank set: no q_proj
    back = to_hf(_plan("minicpm3"))  # transformers' own plan again: the other latent modules need no rule there
    assert back[ATTN + "kv_a_proj_with_mqa"] == "mla_kv_a_proj" and back[ATTN + "kv_b_proj"] == "colwise"
    assert ATTN + "q_a_proj" not in back and ATTN + "kv_a_layernorm" not in back


def test_lite_variant_q_proj_is_latent_colwise(tmp_path):
    """DeepSeek-V2-Lite (q_lora_rank None): q_proj takes the block input beside the latent; every colwise of a
    latent block is latent_colwise (a DTensor block input taken as colwise does)."""
    rules = _plan("deepseek_v2", tmp_path, q_lora_rank=None)["tensor_parallel"]["rules"]
    assert rules[ATTN + "q_proj"] == rules[ATTN + "kv_b_proj"] == "latent_colwise"
    assert ATTN + "q_a_proj" not in rules and ATTN + "q_b_proj" not in rules


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("model_type", ["deepseek_v2", "minicpm3", "glm4_moe_lite"])
def test_mla_models_match_one_device(model_type, tp):
    """deepseek_v2 and glm4_moe_lite with their MoE experts (expert_parallel section, etp 1), minicpm3 dense."""
    plan = _plan(model_type, tp=tp)
    model = _model(model_type, tp)
    assert meshplan.check(model, plan, layout={"tp": tp}).ok
    report = check_numerics(model, plan, tp=tp)
    assert report.ok and report.loss_error <= 1e-5 and max(report.errors.values()) <= 1e-5, report.summary()


@pytest.mark.parametrize("sp,lp", [(False, False), (True, False), (False, True)])
def test_dense_lite_deepseek_v2_matches_one_device(tmp_path, sp, lp):
    """Dense layers only, q_proj colwise beside the latent, every sequence/loss parallel mode at tp 4."""
    over = {"q_lora_rank": None, "first_k_dense_replace": 2, "num_hidden_layers": 2}
    plan = _plan("deepseek_v2", tmp_path, tp=4, **over)
    plan.pop("expert_parallel", None)  # the small copy from_hf reads keeps an MoE layer; this model has none
    plan["layout"] = {"tp": 4}
    plan["tensor_parallel"].update(sequence_parallel=sp, loss_parallel=lp)
    model = _model("deepseek_v2", 4, **over)
    assert not any("experts" in n for n, _ in model.named_modules())
    report = check_numerics(model, plan, tp=4)
    assert report.ok and report.loss_error <= 1e-5 and max(report.errors.values()) <= 1e-5, report.summary()


def test_colwise_beside_a_latent_is_refused(tmp_path):
    """A plain colwise on a latent would all-reduce its gradient and the latent's parameter gradients would be
    summed tp times: check and parallelize refuse colwise in a block with latent modules, naming the fix."""
    plan = _plan("deepseek_v2", tmp_path, q_lora_rank=None)
    plan["tensor_parallel"]["rules"][ATTN + "kv_b_proj"] = "colwise"
    model = _model("deepseek_v2", 2, q_lora_rank=None)
    errors = " | ".join(map(str, meshplan.check(model, plan).errors))
    assert "module 'model.layers.0.self_attn.kv_b_proj' (colwise) sits beside MLA latent modules" in errors
    assert "found colwise, expected latent_colwise" in errors and "q_proj" not in errors
    assert "sits beside MLA latent modules" in check_numerics(model, plan, tp=2).summary()  # parallelize: the same


def test_axk2_gated_norm_and_gate_projection_match_one_device():
    """AXK2: q_gate_proj takes cat(q_a_layernorm(q), q) (a latent, not a plain one), and its gated RMSNorm holds
    a gate MLP (the norm style replicates submodules' parameters)."""
    plan = _plan("axk2")
    assert plan["tensor_parallel"]["rules"][ATTN + "q_gate_proj"] == "latent_colwise"
    report = check_numerics(_model("axk2", 2), plan, tp=2)
    assert report.ok and report.loss_error <= 1e-5 and max(report.errors.values()) <= 1e-5, report.summary()


def _counts(cm):
    return {str(k).split(".")[-1]: v for k, v in cm.get_comm_counts().items()}


@pytest.mark.parametrize("sp", [True, False])
def test_exact_collectives_as_any_attention_block(tmp_path, sp):
    """A dense DeepSeek-V2-Lite shape (2 layers, SP on/off, logits gathered): the collectives of Llama's
    tests/test_tp.py, the latent adding none; its partial gradients join the one coalesced all-reduce."""
    from torch.distributed.tensor.debug import CommDebugMode

    from _local import local_ranks
    over = {"q_lora_rank": None, "first_k_dense_replace": 2, "num_hidden_layers": 2}
    plan = _plan("deepseek_v2", tmp_path, tp=2, **over)
    plan.pop("expert_parallel", None)
    plan["layout"] = None
    plan["tensor_parallel"].update(sequence_parallel=sp, loss_parallel=False)
    model = _model("deepseek_v2", 2, **over)
    tokens = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    with local_ranks(2):
        meshplan.parallelize(model, plan, meshplan.build_mesh({"tp": 2}))
        with CommDebugMode() as fwd:
            loss = model(input_ids=tokens, labels=tokens).loss
        with CommDebugMode() as bwd:
            loss.backward()
    n = 2
    if sp:
        assert _counts(fwd) == {"all_gather_into_tensor": 2 * n + 2, "reduce_scatter_tensor": 2 * n + 1}
        assert _counts(bwd) == {"all_gather_into_tensor": 2 * n + 1, "reduce_scatter_tensor": 2 * n + 1,
                                "all_reduce": 1}
    else:
        assert _counts(fwd) == {"all_reduce": 2 * n + 1, "all_gather_into_tensor": 1}
        assert _counts(bwd) == {"all_reduce": 2 * n + 1 + 1}


def test_numerics_flags_colwise_on_a_latent_when_check_is_fooled(tmp_path, monkeypatch):
    """With the check fooled, a plain colwise kv_b_proj all-reduces the latent's gradient and the tp sum counts
    it twice: check_numerics names the latent parameters."""
    import meshplan.hf.mla as mla
    monkeypatch.setattr(mla, "latent_misfits", lambda rules: [])
    plan = _plan("deepseek_v2", tmp_path, q_lora_rank=None)
    plan["tensor_parallel"]["rules"][ATTN + "kv_b_proj"] = "colwise"
    report = check_numerics(_model("deepseek_v2", 2, q_lora_rank=None), plan, tp=2)
    assert not report.ok and "model.layers.0.self_attn.kv_a_layernorm.weight" in report.failed, report.summary()
