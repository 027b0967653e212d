"""Tiny transformers models whose attention has per-head parts beside its projections, and their tp plans
(issue 24): gpt-oss's attention sinks, DiffLlama's lambdas (head pairs: q/k/v packed 2), Olmo2's norm over the
whole q/k projection, lara_mini's gated-delta-net whose out_proj is gathered, Doge's per-KV-head dynamic mask
(``A`` and ``dt_proj``). Shared by tests/test_tp_heads.py
(simulated ranks) and tests/dist/hf_worker.py (real gloo)."""

ATTN = {"model.layers.*.self_attn.q_proj": "colwise", "model.layers.*.self_attn.k_proj": "colwise",
        "model.layers.*.self_attn.v_proj": "colwise", "model.layers.*.self_attn.o_proj": "rowwise"}
MLP = {"model.layers.*.mlp.gate_proj": "colwise", "model.layers.*.mlp.up_proj": "colwise",
       "model.layers.*.mlp.down_proj": "rowwise"}
PACKED2 = {k: {"style": "colwise", "packed": 2} for k in list(ATTN)[:3]}
LAMBDAS = ["lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"]

RULES = {
    # attention only: gpt-oss's experts are the expert_parallel section's (they run whole here)
    "gpt_oss": {**ATTN, "model.layers.*.self_attn": {"style": "head_params", "sharded": ["sinks"]}},
    "diffllama": {**ATTN, **PACKED2, **MLP, "model.layers.*.self_attn": {"style": "head_params", "summed": LAMBDAS}},
    "olmo2": {**ATTN, **MLP, "model.layers.*.self_attn.q_norm": "projection_norm",
              "model.layers.*.self_attn.k_norm": "projection_norm"},
    # Doge: the dynamic mask's per-KV-head rate A and dt_proj onto num_key_value_heads (reduce-scattered: each
    # rank gets its own heads' values)
    "doge": {**ATTN, **MLP, "model.layers.*.self_attn.q_norm": "head_norm",
             "model.layers.*.self_attn.k_norm": "head_norm",
             "model.layers.*.self_attn.dt_proj": {"style": "rowwise", "output_layouts": "shard(-1)",
                                                  "use_local_output": True},
             "model.layers.*.self_attn": {"style": "head_params", "sharded": ["A"]}},
    "lara_mini": {**ATTN, "model.layers.*.self_attn.q_norm": "head_norm", "model.layers.*.self_attn.k_norm": "head_norm",
                  "model.layers.*.linear_attn.out_proj": {"style": "colwise", "output_layouts": "replicate",
                                                          "input_layouts": "replicate"}},
}


def plan(model_type: str, tp: int = 2) -> dict:
    """The plan of ``model_type`` (no sequence parallelism: the residual stream is replicated)."""
    return {"layout": {"tp": tp}, "tensor_parallel": {"sequence_parallel": False, "loss_parallel": False,
                                                      "rules": RULES[model_type]}}


def tiny(model_type: str, dtype=None):
    """A tiny random ``model_type`` (seed 0: the same on every rank), experts in eager loops (float64 works)."""
    import torch

    from meshplan.hf.tiny_models import tiny_model
    model, why = tiny_model(model_type, tp=2, seed=0)
    assert model is not None, why
    model.config._experts_implementation = "eager"
    return model.to(dtype or torch.float64)
