"""The rendezvous store of a torchrun worker group that may be restarted (``torchrun --max-restarts N``).

torchrun's agent (c10d rendezvous, which ``--standalone`` uses too) keeps ONE TCP store for the whole job and
hands every worker group its address (``MASTER_ADDR``/``MASTER_PORT``, ``TORCHELASTIC_USE_AGENT_STORE=True``).
``init_process_group`` writes each rank's gloo address under keys that do not change from one restart to the
next, so a restarted rank can read the address of a peer that died with the previous group before the peer's
successor overwrites it: gloo then fails with ``connectFullMesh … Connection refused`` (measured: 1 of 2
restarts with ``--standalone``, 3 of 6 with ``--rdzv-backend c10d --rdzv-endpoint``). Prefixing the keys with
the restart count (``TORCHELASTIC_RESTART_COUNT``) gives every group fresh keys. The launcher-side equivalent
for scripts that call ``init_process_group`` themselves is ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (a new store
per restart); see docs/checkpoints.md.
"""

from __future__ import annotations

import datetime
import os
from typing import Any

import torch.distributed as dist

__all__ = ["restart_store"]


def restart_store(timeout: datetime.timedelta) -> Any:
    """A client of the torchrun agent's store, its keys prefixed with this group's restart count; None when
    not launched by a torchrun agent that shares its store (``init_process_group`` then reads ``env://``)."""
    env = os.environ
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or "MASTER_ADDR" not in env or "MASTER_PORT" not in env:
        return None
    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False, timeout=timeout)
    return dist.PrefixStore(f"meshplan/restart{env.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
