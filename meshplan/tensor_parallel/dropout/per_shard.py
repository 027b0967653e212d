"""Per-shard randomness for dropout inside tensor-parallel regions (Megatron's RNG tracker, on modules).

Inside a TP region (a module that owns colwise projections) every tp rank holds
different heads/features, so its dropout mask must differ: equivalent to one
mask drawn for the full tensor, then split (the seeds' rule). Where the tensor
is replicated (the residual stream without sequence parallelism) the mask
must be the same on every tp rank, or the replicas drift apart.

``fork`` hooks switch the default generator to a stream derived from one draw
of the shared stream plus the tp rank; ``shared`` hooks switch back inside a
forked region. Deriving the stream from the shared generator (instead of
keeping state) keeps activation-checkpoint recomputation exact: checkpoint
restores the shared state, so the same masks are drawn again.

This is ``dropout_rng: per_shard`` (the default); ``single_device`` (masks equal
to the one-device run's) lives in :mod:`meshplan.tensor_parallel.dropout.single_device`.
"""

from __future__ import annotations

import torch
import torch.nn as nn

__all__ = ["TpRng"]

_STRIDE = 1_000_003


class TpRng:
    """RNG-stream switching for one parallelized model (no global state).

    Args:
        tp_rank: this rank's coordinate on the tp axis.
        device_type: ``"cpu"`` or ``"cuda"``; the generator that dropout uses.
    """

    def __init__(self, tp_rank: int, device_type: str = "cpu"):
        # under LocalTensorMode simulation the rank is symbolic and all ranks share one generator
        self.tp_rank = tp_rank if isinstance(tp_rank, int) else 0
        self.device_type = device_type
        self._saved: list = []  # stack of shared states while forked
        self._depth = 0

    def _get(self):
        return torch.cuda.get_rng_state() if self.device_type == "cuda" else torch.get_rng_state()

    def _set(self, state) -> None:
        (torch.cuda.set_rng_state if self.device_type == "cuda" else torch.set_rng_state)(state)

    def _fork(self, *_):
        self._depth += 1
        if self._depth > 1:
            return
        seed = int(torch.randint(0, 2**62, (1,), device=self.device_type).item())  # advances the shared stream
        self._saved.append(self._get())
        gen = torch.cuda.default_generators[torch.cuda.current_device()] if self.device_type == "cuda" \
            else torch.default_generator
        gen.manual_seed(seed + _STRIDE * (self.tp_rank + 1))

    def _join(self, *_):
        self._depth -= 1
        if self._depth == 0:
            self._set(self._saved.pop())

    def _shared_enter(self, *_):
        if self._depth == 0:
            return
        forked = self._get()
        self._set(self._saved[-1])
        self._saved.append(forked)

    def _shared_exit(self, *_):
        if self._depth == 0:
            return
        forked = self._saved.pop()
        self._saved[-1] = self._get()
        self._set(forked)

    def fork(self, module: nn.Module) -> None:
        """Dropout inside ``module`` differs per tp rank."""
        module.register_forward_pre_hook(self._fork)
        module.register_forward_hook(self._join, always_call=True)

    def shared(self, module: nn.Module) -> None:
        """Dropout inside ``module`` is identical on every tp rank, even inside a forked module."""
        module.register_forward_pre_hook(self._shared_enter)
        module.register_forward_hook(self._shared_exit, always_call=True)
