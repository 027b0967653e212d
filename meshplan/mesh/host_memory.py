"""Host memory on a CPU job: glibc keeps freed memory for reuse instead of giving it back to the kernel.

A CUDA job allocates through torch's caching allocator, which keeps freed blocks. A CPU job allocates through
glibc's ``malloc``, which by default serves a large tensor from a fresh ``mmap`` (or trims the heap under it once
freed), so the next tensor of that size starts on pages the kernel must fault in and zero again. A training step
that allocates the same large tensors every step pays those faults every step: an eager MoE's expert loop writes
a zero-filled gradient of a whole stacked expert weight per expert (4 MiB each in ``benchmarks/calibrate.py``'s
MoE), and on the 2-vCPU VM of 2026-11-27 one step of that model at world 8 took 34,000-47,000 page faults and
2.6-3.2 s; with freed memory kept, 0-3,000 faults and 1.8-2.0 s (the dense Llama: no faults after its first step
either way). Intel's guidance for torch on CPUs (``torch.backends.xeon.run_cpu``) preloads jemalloc or tcmalloc
for the same reason; this asks glibc itself, in-process, with ``mallopt``.

The setting is the process's, not meshplan's: it holds for every allocation after the call. A process's resident
memory then stays at its peak instead of falling back after a step.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform

__all__ = ["keep_freed_memory", "MMAP_THRESHOLD", "TRIM_THRESHOLD"]

#: allocations up to this size come from the heap (glibc's largest ``M_MMAP_THRESHOLD``: 32 MiB on 64-bit)
MMAP_THRESHOLD = 32 << 20
#: free memory at the heap's top that glibc keeps before trimming it (1 GiB: in practice never)
TRIM_THRESHOLD = 1 << 30
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h


def keep_freed_memory() -> bool:
    """Ask glibc to serve allocations up to :data:`MMAP_THRESHOLD` from its heap and to keep up to
    :data:`TRIM_THRESHOLD` of freed memory there (``mallopt``), so a step's large tensors reuse pages instead of
    faulting in fresh ones. :func:`meshplan.init` calls it for a CPU job.

    Returns:
        True when glibc took both settings; False elsewhere (another C library: nothing changed).

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
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
