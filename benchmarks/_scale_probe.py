"""A per-action memory probe for ``benchmarks/_scale_worker.py`` (``SCALE_PROBE=1``): ``VmRSS`` and ``VmHWM`` before
and after each FSDP2 unit's all-gather, reshard, pre/post-backward and reduce-scatter, each pipeline stage's forward /
backward chunk and each optimizer step, written to ``probe<R>.txt`` in the launch's folder (docs/scale.md: where the
peak is). Diagnostic only: it wraps torch's methods in this process and never changes what they do.
"""

from __future__ import annotations

import functools
import time
from pathlib import Path


def _kib() -> tuple[int, int]:
    rss = hwm = 0
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1])
        elif line.startswith("VmHWM:"):
            hwm = int(line.split()[1])
    return rss, hwm


def install(path: str) -> None:
    """Wrap the actions named in the module docstring; each writes ``label rss_before hwm_before rss_after
    hwm_after`` (MiB) to ``path``."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as pg
    from torch.distributed.pipelining import stage as st
    from torch.optim import Optimizer
    out = open(path, "a", buffering=1)

    def wrap(owner, name, label):
        fn = getattr(owner, name)

        @functools.wraps(fn)
        def probed(self, *a, **k):
            before = _kib()
            try:
                return fn(self, *a, **k)
            finally:
                after = _kib()
                out.write(f"{time.strftime('%H:%M:%S')} {label(self, a, k):60s} rss {before[0] >> 10:6d} -> "
                          f"{after[0] >> 10:6d}  hwm {before[1] >> 10:6d} -> {after[1] >> 10:6d}\n")
        probed._scale_probed = True
        setattr(owner, name, probed)

    for name in ("unshard", "reshard", "pre_backward", "post_backward"):
        wrap(pg.FSDPParamGroup, name, lambda s, a, k, n=name: f"fsdp {n} {s._module_fqn or '<root>'}")
    wrap(st.PipelineStage, "forward_one_chunk", lambda s, a, k: f"stage {s.stage_index} F{a[0] if a else ''}")
    wrap(st.PipelineStage, "backward_one_chunk", lambda s, a, k: f"stage {s.stage_index} B{a[0] if a else ''}")
    wrap(st.PipelineStage, "perform_reduce_grad", lambda s, a, k: f"stage {s.stage_index} REDUCE_GRAD")
    wrap(Optimizer, "zero_grad", lambda s, a, k: "optimizer zero_grad")
    orig = Optimizer.__init__

    @functools.wraps(orig)
    def init(self, *a, **k):
        orig(self, *a, **k)
        if not getattr(type(self).step, "_scale_probed", False):
            wrap(type(self), "step", lambda s, a_, k_: "optimizer step")
            type(self).step._scale_probed = True
    Optimizer.__init__ = init
