"""Pipelined models from the meta device: each rank allocates its own stages only, and ``materialize`` /
``load_safetensors`` give the numbers of the one-device model (fake group, every simulated rank)."""

import pytest
import torch
from safetensors.torch import save_file

import llama as llama_example
import meshplan
from examples.hf_models import llama
from meshplan import PlanError
from test_init_load import assert_shards, hf_reference, save

pytestmark = pytest.mark.fast

#: (layout, world): pp alone, composed with tp, with FSDP2
LAYOUTS = [({"pp": 2}, 2), ({"pp": 2, "tp": 2}, 4), ({"pp": 2, "dp_shard": 2}, 4)]


def factory(**config):
    return lambda: llama(num_hidden_layers=4, **config)


def plan(layout):
    rules = {"model.embed_tokens": "embedding", "model.layers.*.self_attn.q_proj": "colwise",
             "model.layers.*.self_attn.k_proj": "colwise", "model.layers.*.self_attn.v_proj": "colwise",
             "model.layers.*.self_attn.o_proj": "rowwise", "model.layers.*.mlp.gate_proj": "colwise",
             "model.layers.*.mlp.up_proj": "colwise", "model.layers.*.mlp.down_proj": "rowwise", "lm_head": "lm_head",
             "model.layers.*.input_layernorm": "norm", "model.layers.*.post_attention_layernorm": "norm",
             "model.norm": "norm"}
    out = {"version": 1, "layout": layout, "blocks": {"pattern": "model.layers.*"},
           "pipeline": {"schedule": "1f1b", "microbatches": 2}}
    if layout.get("tp", 1) > 1:
        out["tensor_parallel"] = {"rules": rules}
    return out


def pipelined_meta(make, layout):
    with torch.device("meta"):
        model = make()
    return meshplan.parallelize(model, plan(layout), meshplan.build_mesh(layout))


def held_elements(model):
    return sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in model.parameters())


@pytest.mark.parametrize("layout,world", LAYOUTS)
@pytest.mark.parametrize("tied", [False, True])
def test_materialize_pipelined_meta_equals_one_device_init(fake_pg, layout, world, tied):
    """Each rank's stages (tp shards, FSDP2 shards) equal transformers' one-device init with the same seed; the
    other stages' modules are drawn transiently (the random stream) and never kept; tied ends stay tied."""
    make = factory(tie_word_embeddings=tied)
    ref = hf_reference(make)
    total = sum(p.numel() for p in ref.parameters())
    for rank in range(world):
        with fake_pg(world, rank):
            model = meshplan.materialize(pipelined_meta(make, layout), seed=0)
            assert_shards(model, ref)
            assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
            assert held_elements(model) < 0.75 * total  # its stages only (tp/FSDP: its shards of them)
            stage = rank // (world // 2)  # pp is the outermost mesh dim
            assert set(model.model.layers._modules) == ({"0", "1"}, {"2", "3"})[stage]  # pruned, as before
            assert type(model.lm_head if stage == 0 else model.model.embed_tokens).__name__ == "Identity"


@pytest.mark.parametrize("layout,world", LAYOUTS)
def test_load_safetensors_pipelined_meta(fake_pg, tmp_path, layout, world):
    """A transformers checkpoint (save_pretrained, sharded with an index) read slice by slice into each rank's
    stages of a meta model; the RoPE buffers are computed as on one device."""
    make = factory()
    torch.manual_seed(7)
    full = make()
    save(full, tmp_path / "many", max_shard_size="20KB")
    for rank in range(world):
        with fake_pg(world, rank):
            model = meshplan.load_safetensors(pipelined_meta(make, layout), tmp_path / "many")
            assert_shards(model, full)
            assert torch.equal(model.model.rotary_emb.inv_freq, full.model.rotary_emb.inv_freq)


@pytest.mark.parametrize("rank", [0, 1])
def test_pipelined_checkpoint_of_other_shapes_refused_before_allocating(fake_pg, tmp_path, rank):
    """Every rank refuses a tensor of any stage whose shape differs (rank 0 does not hold lm_head), naming it,
    from the headers alone: the model is still on the meta device afterwards."""
    torch.manual_seed(0)
    sd = {k: v.contiguous() for k, v in factory()().state_dict().items()}
    sd["lm_head.weight"] = torch.zeros(5, 64)
    save_file(sd, tmp_path / "bad.safetensors")
    with fake_pg(2, rank):
        model = pipelined_meta(factory(), {"pp": 2})
        with pytest.raises(PlanError, match=r"bad.safetensors: lm_head.weight: checkpoint shape \(5, 64\), model "
                                            r"\(128, 64\); refused before allocating"):
            meshplan.load_safetensors(model, tmp_path / "bad.safetensors")
        assert all(p.is_meta for p in model.parameters())
    with fake_pg(2, 0):  # rank 0's dict, broadcast: checked there against every stage's shapes, before allocating
        model = pipelined_meta(factory(), {"pp": 2})
        with pytest.raises(PlanError, match=r"load_state_dict from rank 0: lm_head.weight: checkpoint shape "
                                            r"\(5, 64\), model \(128, 64\)"):
            meshplan.load_full_state_dict(model, sd)
        assert all(p.is_meta for p in model.parameters())


def test_materialize_pipelined_off_meta_is_refused(fake_pg):
    """Pruned after a CPU build, the other stages' modules are gone: refused with the way that works."""
    with fake_pg(2, 1):
        model = meshplan.parallelize(factory()(), plan({"pp": 2}), meshplan.build_mesh({"pp": 2}))
        with pytest.raises(PlanError, match=r"materialize: this LlamaForCausalLM holds pipeline stages \[1\] only "
                                            r"and was built off the meta device.*with torch.device\('meta'\)"):
            meshplan.materialize(model, seed=0)


@pytest.mark.parametrize("rank", [0, 1])
def test_materialize_pipelined_meta_model_level_init_weights(fake_pg, rank):
    """examples/llama.py draws every parameter in one model-level ``init_weights()`` (torchtitan style): with the
    other stage's modules back for the call, rank r's stage equals ``torch.manual_seed(0); build(args)``."""
    args = llama_example.tiny_args(n_layers=4)
    torch.manual_seed(0)
    cpu = llama_example.build(args)
    with fake_pg(2, rank):
        with torch.device("meta"):
            meta = llama_example.build(args)
        plan = {"layout": {"pp": 2}, "pipeline": {"schedule": "1f1b", "microbatches": 2}}
        model = meshplan.materialize(meshplan.parallelize(meta, plan, meshplan.build_mesh({"pp": 2})), seed=0)
        assert_shards(model, cpu)
        assert torch.equal(model.freqs_cis, cpu.freqs_cis)
        assert set(model.layers._modules) == ({"0", "1"}, {"2", "3"})[rank]
