"""The end of a job's distributed state: what ``with meshplan.init(...)`` does on exit."""

from __future__ import annotations

__all__ = ["shutdown"]


def shutdown(clean: bool = True) -> None:
    """Destroy the process group ``meshplan.init`` created."""
    import torch.distributed as dist
    if dist.is_initialized():
        dist.destroy_process_group()
