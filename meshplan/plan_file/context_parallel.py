"""The ``context_parallel`` plan section, as data: sequences split across the ``cp`` axis.

Each of the ``cp`` ranks of a context-parallel group holds ``1/cp`` of every sequence (inputs, labels and
positions), load-balanced for causal attention: the sequence is cut into ``2·cp`` chunks and rank ``r`` holds
chunks ``r`` and ``2·cp−1−r``. The model's ``torch.nn.functional.scaled_dot_product_attention`` calls inside the
``attention`` modules are made exact across the shards. Torch-free; applied by :mod:`meshplan.context_parallel`.

Example (YAML)::

    layout: {cp: 2}
    context_parallel:
      method: allgather_kv
      attention: layers.*.attention
      positions: {buffer: freqs_cis}     # a RoPE table indexed by position (dim 0)

    # transformers models take position ids
    context_parallel: {attention: model.layers.*.self_attn, positions: {kwarg: position_ids}}
"""

from __future__ import annotations

from typing import Literal, Union

from pydantic import Field, field_validator

from meshplan.plan_file.strict import Strict

__all__ = ["ContextParallel", "PositionsKwarg", "PositionsBuffer", "METHODS"]

Method = Literal["allgather_kv", "ring", "torch_ring"]
#: every attention method a plan may write
METHODS: tuple[str, ...] = Method.__args__


class PositionsKwarg(Strict):
    """Positions reach the model as a keyword argument of its forward (transformers' ``position_ids``)."""

    kwarg: str = Field(..., min_length=1, description="Name of the forward's keyword argument taking the "
                                                      "(batch, seq) position ids; meshplan passes each rank's true "
                                                      "positions unless the caller passes them.")


class PositionsBuffer(Strict):
    """Positions are rows of a buffer the model slices by the local length (a RoPE table: ``freqs_cis[:seq]``)."""

    buffer: str = Field(..., min_length=1, description="Path of a buffer indexed by position, e.g. freqs_cis; "
                                                       "during the forward it holds this rank's rows in order.")
    dim: int = Field(0, ge=0, le=8, description="The buffer's position dim.")


class ContextParallel(Strict):
    """The ``context_parallel`` plan section: sequences split across ``layout.cp``, attention made exact."""

    method: Method = Field(
        "allgather_kv", description="How attention sees the whole sequence. allgather_kv: each attention layer "
                                    "all-gathers K and V over cp (Llama 3's method; any device and backend); "
                                    "communication per layer: (cp-1)/cp of the sequence's K/V forward, a "
                                    "reduce-scatter of dK/dV backward; memory: every rank saves the whole "
                                    "sequence's K/V, O(S). ring: meshplan's ring attention (any device and "
                                    "backend, gloo included): K/V blocks pass around cp by point-to-point sends "
                                    "overlapped with each block's attention; communication: cp-1 hops of 1/cp of "
                                    "K/V forward, cp-1 K/V and cp dK/dV hops backward; memory: saves only the "
                                    "local q, k, v, out, O(S/cp); honours windows and soft-caps. torch_ring: "
                                    "torch's ring attention (torch.distributed.tensor.experimental.context_"
                                    "parallel), ring's costs with torch's fused kernels; CUDA only in torch 2.13, "
                                    "causal or full attention only.")
    load_balance: bool = Field(
        True, description="Causal load balance: 2·cp chunks, rank r holds chunks r and 2·cp−1−r (equal attention "
                          "work per rank). false: rank r holds the r-th contiguous 1/cp (the last rank does most).")
    attention: tuple[str, ...] = Field(
        ..., min_length=1, description="Module-path patterns of the attention modules ('*' = one path segment); "
                                       "their scaled_dot_product_attention calls see the whole sequence. Every "
                                       "pattern must match, and the first step refuses attention found elsewhere.")
    positions: Union[PositionsKwarg, PositionsBuffer, Literal["none"], None] = Field(
        None, description="How the model learns each token's position: {kwarg: position_ids}, {buffer: <path>, "
                          "dim: 0}, or none (a model without positional encoding). Default: {kwarg: position_ids} "
                          "when the forward takes position_ids, else the plan must say.")
    seq_dim: int = Field(1, ge=1, le=8, description="The sequence dim of the inputs and labels (batch first).")

    @field_validator("attention", mode="before")
    @classmethod
    def _one_or_many(cls, v: object) -> object:
        if isinstance(v, str):
            return (v,)
        return tuple(v) if isinstance(v, list) else v
