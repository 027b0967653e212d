"""A representative slice of the transformers zoo (``benchmarks/zoo.py``): tiny models of diverse architectures,
transformers' tp_plan converted by meshplan, at tp=2. Each must be ``equal`` to one device or ``refused`` with a
reason naming the module — never WRONG, never a crash. ``tiny_config`` must keep every divisibility tp needs.
"""

import os
import re
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

pytest.importorskip("transformers")

# what each one covers beyond the plain Llama block
ZOO = {
    "llama": "reference block",
    "mistral": "sliding window",
    "qwen2": "q/k/v biases",
    "qwen3": "per-head q_norm/k_norm",
    "gemma": "scaled embedding, tied lm_head",
    "gemma2": "sliding/full layers, logit softcapping, pre/post norms",
    "gemma3_text": "sliding/full layers, q/k norms, two rope bases",
    "phi3": "fused qkv and gate_up (gathered)",
    "olmo": "LayerNorm without weights",
    "olmo2": "q/k norm over all heads",
    "cohere": "parallel block, LayerNorm, logit scale, tied lm_head",
    "starcoder2": "biases everywhere, LayerNorm",
    "granite": "embedding/residual/attention/logit multipliers",
    "gpt_neox": "parallel residual, fused query_key_value, partial rotary",
    "phi": "partial rotary, dense head bias",
    "qwen3_moe": "MoE experts",
}

MODULE = re.compile(r"[A-Za-z_][\w*]*(?:\.[\w*]+)+|module '[\w.*]+'")  # a dotted module path or module 'x'


@pytest.mark.parametrize("model_type", list(ZOO))
def test_tiny_config_keeps_divisibility(model_type):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from meshplan.hf.tiny_config import tiny_config
    for tp in (2, 4):
        full, cfg = CONFIG_MAPPING[model_type](), tiny_config(model_type, tp=tp)
        heads = cfg.num_attention_heads
        kv = getattr(cfg, "num_key_value_heads", None) or heads
        for name in ("hidden_size", "num_attention_heads", "vocab_size", "intermediate_size"):
            value = getattr(cfg, name, None)
            assert value is None or value % tp == 0, f"{model_type} tp={tp}: {name}={value}"
        assert heads == 2 * tp and kv % tp == 0, (heads, kv)
        full_kv = getattr(full, "num_key_value_heads", None) or full.num_attention_heads
        assert (kv < heads) == (full_kv < full.num_attention_heads), f"{model_type}: GQA not kept ({kv}/{heads})"
        if getattr(full, "layer_types", None):
            assert set(cfg.layer_types) == set(full.layer_types)
            assert len(cfg.layer_types) == cfg.num_hidden_layers
        assert getattr(cfg, "tie_word_embeddings", None) == getattr(full, "tie_word_embeddings", None)
        assert cfg.max_position_embeddings >= 64


def test_tiny_config_keeps_layer_kinds():
    from meshplan.hf.tiny_config import tiny_config
    g = tiny_config("gemma3_text")
    assert g.num_hidden_layers == 2 and sorted(g.layer_types) == ["full_attention", "sliding_attention"]
    assert 0 < g.sliding_window < 16
    d = tiny_config("deepseek_v3")  # one dense layer, then MoE
    assert d.num_hidden_layers == 2 and d.first_k_dense_replace == 1
    q = tiny_config("qwen2_5_vl_text")  # mrope sections fill half the (rotary) head dim
    assert sum(q.rope_parameters["mrope_section"]) == q.hidden_size // q.num_attention_heads // 2


@pytest.mark.parametrize("model_type", list(ZOO))
def test_zoo_equal_or_refused(model_type):
    from zoo_tp import classify
    row = classify(model_type, hf=False)
    assert row["class"] in ("equal", "refused"), f"{model_type} ({ZOO[model_type]}): {row['class']}: {row['reason']}"
    if row["class"] == "refused":
        assert MODULE.search(row["reason"].split(":", 2)[-1]), f"{model_type}: reason names no module: {row['reason']}"


@pytest.mark.fast
def test_cpdoc_inputs_qualify_for_the_layout_by_work():
    """The zoo's packed documents (``benchmarks/zoo_inputs.py``) restart ``position_ids`` per document with every
    length a multiple of 2·cp, so cp 2 lays them out by work on both ranks (not the row layout)."""
    import torch

    from meshplan.context_parallel.documents import document_index, documents_of
    from zoo_inputs import DOCS, packed_positions
    from zoo_plans import ROWS, SEQ
    ids = packed_positions(ROWS, SEQ)
    assert documents_of(ids) is not None and len({len(d) for d in DOCS}) > 1
    taken = [document_index(ids, 2, r) for r in range(2)]
    assert all(t is not None and t.shape == (ROWS, SEQ // 2) for t in taken)
    assert torch.equal(torch.sort(torch.cat(taken, -1)).values, torch.arange(SEQ).expand(ROWS, SEQ))
