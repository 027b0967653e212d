"""Host memory on a CPU job: glibc keeps freed memory for reuse instead of giving it back to the kernel.

A CUDA job allocates through torch's caching allocator, which keeps freed blocks. A CPU job allocates through
glibc's ``malloc``, which by default serves a large tensor from a fresh ``mmap`` (or trims the heap under it once
freed), so the next tensor of that size starts on pages the kernel must fault in and zero again. A training step
that allocates the same large tensors every step pays those faults every step: an eager MoE's expert loop writes
a zero-filled gradient of a whole stacked expert weight per expert (4 MiB each in ``benchmarks/calibrate.py``'s
MoE), and on the 2-vCPU VM of 2026-11-27 one step of that model at world 8 took 34,000-47,000 page faults and
2.6-3.2 s; with freed memory kept, 0-3,000 faults and 1.8-2.0 s (the dense Llama: no faults after its first step
either way). A tensor above glibc's largest mmap threshold (32 MiB) is always mapped apart unless mapping is off:
torch's ``replicate`` (DDP on FSDP2) reduces a model's gradients through one flat buffer (54 MB for that
MoE), and at world 2 each step took 40,000 faults (the expert fills beside it 5 ms per 4 MiB instead of 0.7)
until mapping was turned off too: 0-3 faults. Intel's guidance for torch on CPUs (``torch.backends.xeon.run_cpu``)
preloads jemalloc or tcmalloc for the same reason; this asks glibc itself, in-process, with ``mallopt``.

The setting is the process's, not meshplan's: it holds for every allocation after the call. A process's resident
memory then stays at its peak instead of falling back after a step.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform

__all__ = ["keep_freed_memory", "MMAP_THRESHOLD", "TRIM_THRESHOLD", "MMAP_MAX"]

#: allocations up to this size come from the heap (glibc's largest ``M_MMAP_THRESHOLD``: 32 MiB on 64-bit)
MMAP_THRESHOLD = 32 << 20
#: free memory at the heap's top that glibc keeps before trimming it (1 GiB: in practice never)
TRIM_THRESHOLD = 1 << 30
#: chunks glibc may serve from their own mmap at once (0: none; every allocation from the heap, whatever its size)
MMAP_MAX = 0
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_MMAP_MAX = -1, -3, -4  # glibc's malloc.h


def keep_freed_memory() -> bool:
    """Ask glibc to serve every allocation from its heap (no chunk mapped apart: :data:`MMAP_MAX`; the threshold
    :data:`MMAP_THRESHOLD` as well, for a later change of the first) and to keep up to :data:`TRIM_THRESHOLD` of
    freed memory there (``mallopt``), so a step's large tensors reuse pages instead of faulting in fresh ones.
    :func:`meshplan.init` calls it for a CPU job.

    Returns:
        True when glibc took the three settings; False elsewhere (another C library: nothing changed).

    Example::

        >>> from meshplan.mesh.host_memory import keep_freed_memory
        >>> keep_freed_memory() in (True, False)
        True
    """
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return all([bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)), bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)),
                bool(mallopt(_M_MMAP_MAX, MMAP_MAX))])
