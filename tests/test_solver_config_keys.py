"""Model configs whose shape takes more than a key rename (meshplan/solver/config_keys.py): DBRX's nested
``ffn_config`` / ``attn_config`` and ERNIE 4.5's range of MoE layers, read from transformers' own configs."""

from __future__ import annotations

import pytest

from meshplan.solver.config_keys import moe_layer_range, nested
from meshplan.solver.shape import shape_from_config

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.fast


def test_dbrx_reads_its_experts_and_kv_heads_from_the_nested_sections():
    cfg = transformers.DbrxConfig(d_model=256, n_heads=8, n_layers=2, vocab_size=128,
                                  attn_config={"kv_n_heads": 2},
                                  ffn_config={"ffn_hidden_size": 512, "moe_num_experts": 8, "moe_top_k": 2})
    s = shape_from_config(cfg.to_dict())
    assert (s.layers, s.hidden, s.heads, s.kv_heads, s.vocab) == (2, 256, 8, 2, 128)
    assert (s.experts, s.top_k, s.expert_width, s.moe_layers) == (8, 2, 512, 2)


def test_ernie_moe_reads_its_experts_shared_experts_and_dense_first_layer():
    cfg = transformers.Ernie4_5_MoeConfig(hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                                          num_attention_heads=8, num_key_value_heads=2, vocab_size=128,
                                          moe_intermediate_size=128, moe_k=2, moe_num_experts=8,
                                          moe_num_shared_experts=2, moe_layer_start_index=1)
    s = shape_from_config(cfg.to_dict())
    assert (s.experts, s.top_k, s.expert_width, s.shared_ffn) == (8, 2, 128, 256)
    assert (s.dense_layers, s.moe_layers) == (1, 3)


@pytest.mark.parametrize("start,end,every,dense", [(0, -1, 1, 0), (1, -1, 1, 1), (0, -1, 2, 4), (2, 5, 1, 4),
                                                    (0, 99, 1, 0)])
def test_an_moe_layer_range_counts_the_layers_outside_it(start, end, every, dense):
    out = {"layers": 8}
    moe_layer_range({"moe_layer_start_index": start, "moe_layer_end_index": end, "moe_layer_interval": every}, out)
    assert out["dense_layers"] == dense


def test_a_stated_dense_count_and_a_key_at_the_top_win():
    out = {"layers": 8, "dense_layers": 3}
    moe_layer_range({"moe_layer_start_index": 1}, out)
    assert out["dense_layers"] == 3
    assert nested({"kv_n_heads": 4, "attn_config": {"kv_n_heads": 1}})["kv_n_heads"] == 4
    assert nested({"hidden": 8}) == {"hidden": 8}


def test_ernie_vl_reads_the_text_experts_width():
    """ERNIE 4.5 VL lists its experts' widths per modality (text, vision): the text model's are the first."""
    cfg = transformers.AutoConfig.for_model("ernie4_5_vl_moe").to_dict()
    s = shape_from_config(cfg)
    text = cfg["text_config"]
    assert (s.experts, s.top_k, s.expert_width) == (text["moe_num_experts"], text["moe_k"],
                                                      text["moe_intermediate_size"][0])
