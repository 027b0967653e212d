"""What an eager stage receives and sends: the model's own code runs at both ends, the boundary at the blocks.

A stage view runs the model's whole ``forward``. Its container keeps every block slot: the stage's own blocks,
and :class:`Skipped` pass-throughs for the other stages' blocks, so a forward that picks something by the
block's index (``config.layer_types[i]``: Gemma2/3's sliding or full mask) gives each block what the model gives
it. At the two boundaries:

* a stage that is not the first gets the previous stage's hidden state in place of the token ids; the model's
  code before the blocks still runs on it (an identity embedding, then Granite's ``× embedding_multiplier`` or
  Gemma's ``× √hidden``), and its result is dropped: the stage's first block is fed the received tensor itself;
* a stage that is not the last sends what the model hands to the next stage's first block (the input of the
  first pass-through after its blocks); the model's code after the blocks (an identity head, Cohere's
  ``× logit_scale``, Granite's ``/ logits_scaling``, Gemma2's soft-capping) runs and is dropped.

So the first stage runs the model's code before the blocks, the last stage the code after them, each exactly
as the model does, and no stage applies them to a hidden state. The split probe
(:mod:`meshplan.pipeline.probe`) compares the chained stages' output with the whole model's.
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn

__all__ = ["Skipped", "Boundary", "hidden_of", "install_ends"]


def hidden_of(args: tuple, kwargs: dict) -> Any:
    """A block's hidden-state input: the first positional argument, else the first keyword argument."""
    return args[0] if args else next(iter(kwargs.values()), None)


class Boundary:
    """One stage view's boundary state: the tensor it received (fed once to its first block) and the one it
    sends (taken at the first pass-through after its blocks)."""

    def __init__(self) -> None:
        self.received: Any = None
        self.sent: Any = None
        self.taking = False
        self.tuples = False  # the stage's last block returned a tuple (Falcon): its slots after it return one too


class Skipped(nn.Module):
    """The slot of another stage's block: returns its hidden-state input unchanged (as a 1-tuple where the
    stage's blocks return tuples); the first one after the stage's own blocks (``sends``) notes it as the tensor
    the stage sends."""

    def __init__(self, boundary: Boundary, sends: bool = False) -> None:
        super().__init__()
        self.boundary, self.sends = boundary, sends

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        hidden = hidden_of(args, kwargs)
        if self.sends and self.boundary.taking:
            self.boundary.sent, self.boundary.taking = hidden, False
        return (hidden,) if self.boundary.tuples else hidden

    def extra_repr(self) -> str:
        return "sends its input" if self.sends else ""


def install_ends(view: nn.Module, blocks: tuple[nn.Module, nn.Module], boundary: Boundary, first: bool,
                 last: bool) -> None:
    """Hook ``view`` (a stage of a model with a block container): a non-first stage feeds its input to
    the first of its ``blocks`` (its first and last block); a non-last stage returns what its :class:`Skipped`
    slot after the blocks noted (and the slots after its last block return a tuple where that block does). The
    blocks' hooks act only while the view runs (the model calling a block directly is unaffected). The feed runs
    before the block's other input hooks (tensor parallelism's input layouts)."""

    def enter(_m: nn.Module, args: tuple, kwargs: dict) -> None:
        boundary.received = None if first else hidden_of(args, kwargs)
        boundary.sent, boundary.taking = None, not last

    def feed(_m: nn.Module, args: tuple, kwargs: dict) -> Any:
        x, boundary.received = boundary.received, None  # once: the block's later calls (none) keep theirs
        if x is None:
            return None
        if args:
            return (x, *args[1:]), kwargs
        key = next(iter(kwargs))
        return args, {**kwargs, key: x}

    def note(_m: nn.Module, _args: tuple, out: Any) -> None:
        if boundary.taking:
            boundary.tuples = isinstance(out, tuple)

    def leave(_m: nn.Module, _args: tuple, _kwargs: dict, out: Any) -> Any:
        sent, boundary.sent, boundary.received = boundary.sent, None, None
        if last:
            return out
        assert sent is not None, "a non-last stage's pass-through after its blocks did not run"
        return sent

    view.register_forward_pre_hook(enter, with_kwargs=True)
    if not first:
        blocks[0].register_forward_pre_hook(feed, with_kwargs=True, prepend=True)
    if not last:
        blocks[1].register_forward_hook(note)
    view.register_forward_hook(leave, with_kwargs=True)
