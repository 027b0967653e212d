"""A model class that carries its own plan: ``@meshplan.plan``.

Run it on 2 CPU processes::

    torchrun --standalone --nproc-per-node 2 examples/decorated.py

Inside ``with meshplan.init(...)`` every instance is parallelized as soon as it
is constructed; outside, ``meshplan.parallelize(model)`` uses the class's plan.
The subclass adds a rule for the module it adds, merged over the parent's plan.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn as nn

if __package__ in (None, ""):  # run as a script (torchrun examples/decorated.py): make `examples` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import meshplan  # noqa: E402
from examples.llama import Transformer, tiny_args  # noqa: E402

__all__ = ["PlannedLlama", "PlannedLlamaWithAdapter"]


@meshplan.plan("plans/llama.yaml")
class PlannedLlama(Transformer):
    """The example Llama with ``plans/llama.yaml`` attached."""


@meshplan.plan({"tensor_parallel": {"rules": {"adapter.up": "colwise", "adapter.down": "rowwise"}}})
class PlannedLlamaWithAdapter(PlannedLlama):
    """Adds a bottleneck adapter before the final norm and extends the parent's rules for it."""

    def __init__(self, args) -> None:
        super().__init__(args)
        with torch.random.fork_rng(devices=[]):  # like Transformer: construction consumes no global RNG
            self.adapter = Adapter(args.dim)
        self.adapter.reset_parameters()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        freqs_cis = self.freqs_cis[: h.shape[1]]
        for layer in self.layers:
            h = layer(h, freqs_cis)
        return self.output(self.norm(h + self.adapter(h)))


class Adapter(nn.Module):
    """``down(relu(up(x)))`` with a 4x wider hidden layer; ``down`` starts at zero (an identity adapter)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, 4 * dim, bias=False)
        self.down = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))

    def reset_parameters(self) -> None:
        nn.init.normal_(self.up.weight, std=0.02)
        nn.init.zeros_(self.down.weight)


def main() -> None:
    with meshplan.init("plans/llama.yaml"):
        torch.manual_seed(0)
        model = PlannedLlamaWithAdapter(tiny_args())      # parallelized on construction
        tokens = torch.randint(0, 128, (2, 16))
        loss = meshplan.cross_entropy(model(tokens), tokens)
        loss.backward()
        if torch.distributed.get_rank() == 0:
            print(f"loss {loss.item():.4f}; adapter.up.weight {model.adapter.up.weight.placements}")


if __name__ == "__main__":
    main()
