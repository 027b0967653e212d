"""The contenders of ``benchmarks/tp.py``: the shapes, the models, and how each contender parallelizes,
runs forward + backward and clips (meshplan, a hand-written torch plan, transformers' own tp_plan, and
meshplan on the example Llama). See ``benchmarks/tp.py`` for what is measured.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

__all__ = ["Shape", "QUICK", "hand_written_plan", "build_model", "parallelize", "forward_backward", "clip", "batch"]


@dataclass(frozen=True)
class Shape:
    """Model and batch shapes (divisible by tp = 2 and 4)."""

    batch: int = 2
    seq: int = 128
    hidden: int = 256
    ffn: int = 704
    layers: int = 4
    heads: int = 8
    kv_heads: int = 4
    vocab: int = 2048

    def hf_config(self) -> dict:
        return dict(vocab_size=self.vocab, hidden_size=self.hidden, intermediate_size=self.ffn,
                    num_hidden_layers=self.layers, num_attention_heads=self.heads,
                    num_key_value_heads=self.kv_heads, max_position_embeddings=self.seq)

    def titan_args(self):
        from llama import tiny_args
        return tiny_args(dim=self.hidden, n_layers=self.layers, n_heads=self.heads, n_kv_heads=self.kv_heads,
                         vocab_size=self.vocab, ffn_dim=self.ffn, max_seq_len=self.seq)


QUICK = Shape(batch=2, seq=32, hidden=64, ffn=128, layers=2, heads=4, kv_heads=4, vocab=128)


def hand_written_plan() -> dict:
    """torchtitan's Llama TP+SP plan, written by hand for transformers' ``LlamaForCausalLM``.

    transformers passes the attention input as ``hidden_states=`` (a keyword) and derives positions and the
    causal mask from the hidden states' shape, so the residual stream stays a ``Shard(1)`` DTensor
    (``use_local_output=False``) rather than torchtitan's local shard.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)
    layer = "model.layers.*"
    return {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1),
                                              use_local_output=False),
        f"{layer}.input_layernorm": SequenceParallel(),
        f"{layer}.self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                                 desired_input_kwarg_layouts={"hidden_states": Replicate()}),
        f"{layer}.self_attn.q_proj": ColwiseParallel(),
        f"{layer}.self_attn.k_proj": ColwiseParallel(),
        f"{layer}.self_attn.v_proj": ColwiseParallel(),
        f"{layer}.self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        f"{layer}.post_attention_layernorm": SequenceParallel(),
        f"{layer}.mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        f"{layer}.mlp.gate_proj": ColwiseParallel(),
        f"{layer}.mlp.up_proj": ColwiseParallel(),
        f"{layer}.mlp.down_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        "model.norm": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    }


def build_model(name: str, shape: Shape, seed: int = 0) -> torch.nn.Module:
    """The unparallelized model of contender ``name`` (same seed → same weights)."""
    torch.manual_seed(seed)
    if name == "titan":
        from llama import build
        return build(shape.titan_args())
    from hf_models import llama
    return llama(**shape.hf_config())


def parallelize(name: str, model: torch.nn.Module, mesh) -> torch.nn.Module:
    """Apply contender ``name``'s plan to ``model`` over the 1-D tp ``mesh``, in place."""
    if name in ("meshplan", "titan"):
        import meshplan
        return meshplan.parallelize(model, os.path.join(ROOT, "plans", "llama.yaml" if name == "titan"
                                                        else "hf_llama.yaml"), mesh)
    if name == "hand":
        from torch.distributed.tensor.parallel import parallelize_module
        return parallelize_module(model, mesh, hand_written_plan())
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism
    return apply_tensor_parallelism(model, mesh, model._expand_parallel_plan(dict(model.tp_plan)))


def forward_backward(name: str, model: torch.nn.Module, tokens: torch.Tensor, labels: torch.Tensor) -> float:
    """One forward + backward with the contender's loss; returns the loss."""
    if name == "titan":
        import meshplan
        loss = meshplan.cross_entropy(model(tokens), labels)
    elif name == "meshplan":
        import meshplan
        loss = meshplan.cross_entropy(model(input_ids=tokens).logits, labels)
    elif name == "hand":
        from torch.distributed.tensor.parallel import loss_parallel
        with loss_parallel():  # torch's: the backward must run inside too
            loss = F.cross_entropy(model(input_ids=tokens).logits.flatten(0, 1), labels.flatten())
            loss.backward()
        return float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss)
    else:
        loss = F.cross_entropy(model(input_ids=tokens).logits.flatten(0, 1), labels.flatten())
    loss.backward()
    return float(loss)


def clip(name: str, model: torch.nn.Module, max_norm: float = 1.0) -> None:
    """Gradient clipping as each contender's user would do it."""
    if name in ("meshplan", "titan"):
        import meshplan
        meshplan.clip_grad_norm_(model.parameters(), max_norm)
    else:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)


def batch(shape: Shape, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, shape.vocab, (shape.batch, shape.seq + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
