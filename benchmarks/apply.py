"""Plan application time on a Llama-3-405B-shaped model on the meta device (fake group, tp=8).

Run: ``python benchmarks/apply.py [--layers 126] [--repeat 3]``. Shapes: 126 layers, dim 16384,
128 heads, 8 KV heads, FFN 53248, vocab 128256 (nothing is allocated: meta device, ``fake``
process group of 8 ranks, this process is rank 0). Side by side, each on a freshly built model,
only the application timed (best of ``--repeat``,
methods interleaved):

* torchtitan-style ``examples/llama.py`` model: ``meshplan.parallelize`` with ``plans/llama.yaml``
  vs torch's ``parallelize_module`` with the hand-written dict an expert writes for it (torchtitan's).
* transformers ``LlamaForCausalLM`` (same shapes): ``meshplan.parallelize`` with
  ``plans/hf_llama.yaml`` vs ``parallelize_module`` with the same hand-written dict in HF's names vs
  transformers' own ``distributed.tensor_parallel.apply_tensor_parallelism`` with the model's
  ``tp_plan`` expanded per module as ``from_pretrained`` does (``_expand_parallel_plan``; no sequence
  parallelism: HF's plan has none) — usable offline on a meta model.

``meshplan.check`` (validation + the meta dry run) is timed too. The table is printed.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _p in (ROOT, os.path.join(ROOT, "examples")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

__all__ = ["titan_dict", "main"]

SHAPE = dict(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, vocab_size=128256, ffn_dim=53248)


def titan_dict(attn="attention", ffn="feed_forward", names=None, dropouts=()):
    """The hand-written torch plan (torchtitan's Llama TP+SP plan), wildcards over the layers; ``dropouts``
    (paths under a layer) run sequence-parallel too, as ``plans/llama.yaml`` lists them."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)
    n = names or {"emb": "tok_embeddings", "norm": "norm", "out": "output", "layers": "layers",
                  "attn_norm": "attention_norm", "ffn_norm": "ffn_norm", "q": "wq", "k": "wk", "v": "wv", "o": "wo",
                  "w1": "w1", "w2": "w2", "w3": "w3"}
    L = n["layers"]
    return {
        n["emb"]: RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        n["norm"]: SequenceParallel(),
        n["out"]: ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
        f"{L}.*.{n['attn_norm']}": SequenceParallel(),
        f"{L}.*.{attn}": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
        f"{L}.*.{attn}.{n['q']}": ColwiseParallel(),
        f"{L}.*.{attn}.{n['k']}": ColwiseParallel(),
        f"{L}.*.{attn}.{n['v']}": ColwiseParallel(),
        f"{L}.*.{attn}.{n['o']}": RowwiseParallel(output_layouts=Shard(1)),
        f"{L}.*.{n['ffn_norm']}": SequenceParallel(),
        f"{L}.*.{ffn}": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        f"{L}.*.{ffn}.{n['w1']}": ColwiseParallel(),
        f"{L}.*.{ffn}.{n['w2']}": RowwiseParallel(output_layouts=Shard(1)),
        f"{L}.*.{ffn}.{n['w3']}": ColwiseParallel(),
        **{f"{L}.*.{d}": SequenceParallel() for d in dropouts},
    }


HF_NAMES = {"emb": "model.embed_tokens", "norm": "model.norm", "out": "lm_head", "layers": "model.layers",
            "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "q": "q_proj", "k": "k_proj",
            "v": "v_proj", "o": "o_proj", "w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}


def _titan(layers):
    from llama import ModelArgs, Transformer
    with torch.device("meta"):
        return Transformer(ModelArgs(**{**SHAPE, "n_layers": layers}, max_seq_len=256))


def _hf(layers):
    import transformers
    transformers.logging.set_verbosity_error()
    cfg = transformers.LlamaConfig(hidden_size=SHAPE["dim"], num_hidden_layers=layers, num_attention_heads=128,
                                   num_key_value_heads=8, intermediate_size=SHAPE["ffn_dim"], vocab_size=128256)
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(cfg)


def _timed(build, apply):
    model = build()
    gc.collect()
    t = time.perf_counter()
    apply(model)
    return time.perf_counter() - t, model


def main(argv=None) -> list[tuple]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=126)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    import meshplan
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module
    from torch.testing._internal.distributed.fake_pg import FakeStore
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    topo = meshplan.build_mesh({"tp": 8})
    mesh = init_device_mesh("cpu", (8,), mesh_dim_names=("tp",))
    L = args.layers
    titan, hf = (lambda: _titan(L)), (lambda: _hf(L))
    drop = ("attention.resid_dropout", "feed_forward.dropout")
    cases = [
        ("examples/llama.py", "meshplan.parallelize (plans/llama.yaml)", titan,
         lambda m: meshplan.parallelize(m, "plans/llama.yaml", topo)),
        ("examples/llama.py", "parallelize_module (hand-written dict)", titan,
         lambda m: parallelize_module(m, mesh, titan_dict(dropouts=drop))),
        ("examples/llama.py", "parallelize_module (hand-written dict, src_data_rank=None)", titan,
         lambda m: parallelize_module(m, mesh, titan_dict(dropouts=drop), src_data_rank=None)),
        ("HF LlamaForCausalLM", "meshplan.parallelize (plans/hf_llama.yaml)", hf,
         lambda m: meshplan.parallelize(m, "plans/hf_llama.yaml", topo)),
        ("HF LlamaForCausalLM", "parallelize_module (hand-written dict)", hf,
         lambda m: parallelize_module(m, mesh, titan_dict("self_attn", "mlp", HF_NAMES))),
        ("HF LlamaForCausalLM", "parallelize_module (hand-written dict, src_data_rank=None)", hf,
         lambda m: parallelize_module(m, mesh, titan_dict("self_attn", "mlp", HF_NAMES), src_data_rank=None)),
    ]
    try:
        from transformers.distributed.tensor_parallel import apply_tensor_parallelism
        cases.append(("HF LlamaForCausalLM", "transformers: expand model.tp_plan + apply_tensor_parallelism", hf,
                      lambda m: apply_tensor_parallelism(m, mesh, m._expand_parallel_plan(dict(m.tp_plan)))))
    except ImportError as e:  # older transformers: TP only inside from_pretrained (needs a checkpoint)
        print(f"transformers' own TP application is not importable: {e}")
    cases.append(("HF LlamaForCausalLM", "meshplan.check (validation + meta dry run)", hf,
                  lambda m: meshplan.check(m, "plans/hf_llama.yaml", world_size=8, layout={"tp": 8}).raise_if_errors()))
    best = [float("inf")] * len(cases)
    sizes = [(0, 0)] * len(cases)
    for _ in range(args.repeat):  # interleaved, so drift on a shared machine hits every method alike
        for i, (_, _, build, apply) in enumerate(cases):
            sec, model = _timed(build, apply)
            best[i] = min(best[i], sec)
            local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in model.parameters())
            sizes[i] = (sum(1 for _ in model.modules()), local)
            del model
    gen = meshplan.load_plan("plans/hf_llama.yaml").tensor_parallel
    from meshplan.tensor_parallel.generate import generate_tp_plan
    model = hf()
    t = time.perf_counter()
    generate_tp_plan(model, gen, 8)
    gen_sec = time.perf_counter() - t
    rows = [(m, how, sec, *size) for (m, how, _, _), sec, size in zip(cases, best, sizes)]
    dist.destroy_process_group()
    print(f"Plan application, Llama-3-405B shapes ({L} layers), meta device, fake group, tp=8, best of {args.repeat}")
    print(f"{'model':<20} {'method':<60} {'seconds':>8} {'modules':>8} {'local params/rank':>18}")
    for m, how, sec, mods, local in rows:
        print(f"{m:<20} {how:<60} {sec:>8.3f} {mods:>8} {local:>18,}")
    print(f"of which meshplan's rule matching + plan generation (HF model): {gen_sec:.3f} s")
    return rows


if __name__ == "__main__":
    main()
