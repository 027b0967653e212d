"""One torchrun launch for the cases of several workers (``tests/_launch.py``: :data:`SHARED`, :func:`run_suite`).

Arguments: ``worker`` or ``worker:case,case`` (a subset), e.g. ``cp_worker dp_worker hf_worker:llama_matrix``. One
gloo process group serves every worker (``meshplan.init`` in a worker's context adopts it and leaves it open).
"""

import sys

import torch.distributed as dist

from _launch import run_suite

if __name__ == "__main__":
    dist.init_process_group("gloo")
    run_suite(sys.argv[1:])
