"""The ``init`` plan section, as data: how :func:`meshplan.materialize` initializes a meta-device model. Torch-free.

``exact`` replays the one-device random stream on every rank (the same numbers as a one-device init with the seed,
O(model) work per rank); ``sharded`` runs the initializers on each rank's local shards with draws keyed by (seed,
parameter name, global index): the same distribution, the same full tensors under every layout, O(shard) per rank
(``docs/checkpoints.md``, "Initialization modes"). ``materialize(model, mode=...)`` wins over the plan.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from meshplan.plan_file.strict import Strict

__all__ = ["Init"]


class Init(Strict):
    """The ``init`` plan section.

    Example (YAML)::

        init:
          mode: sharded     # each rank initializes its own shards only
    """

    mode: Literal["exact", "sharded"] = Field(
        "exact",
        description="How meshplan.materialize initializes a model parallelized on the meta device: 'exact' gives "
                    "the same numbers as a one-device init with the seed (every rank replays every full tensor: "
                    "O(model) per rank); 'sharded' runs the model's initializers on each rank's shards with random "
                    "draws keyed by (seed, parameter name, global element index): the same distribution, the same "
                    "full tensors under every layout, O(shard) per rank. The mode= argument of materialize wins.")
