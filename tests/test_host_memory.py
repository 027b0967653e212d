"""A CPU job's allocator (meshplan/mesh/host_memory.py): glibc keeps freed memory, so a step's large tensors reuse
their pages. Run in a child process: the setting is the process's."""

import platform
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast


def fault_rounds(rounds: int = 100) -> int:
    """Page faults of ``rounds`` rounds of two 4 MiB tensors allocated, filled and freed (after 5 unmeasured; 1,024
    pages each: 204,800 faults for 100 rounds if each tensor came from a fresh mmap). Also run by
    tests/dist/topology_worker.py after ``meshplan.init``."""
    import resource

    import torch

    def run(n: int) -> None:
        for _ in range(n):
            x, y = torch.empty(1 << 20), torch.empty(1 << 20)
            x.fill_(0), y.fill_(1)
            del x, y
    run(5)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    run(rounds)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def mmapped_by_a_tensor(mib: int = 4) -> int:
    """Bytes glibc put in mmapped chunks for one new tensor of ``mib`` MiB (``mallinfo2().hblkhd`` before and after,
    the tensor held): the tensor's size and more under glibc's default in a fresh process (its first threshold:
    128 KiB; the largest: 32 MiB), 0 from the heap."""
    import ctypes

    import torch

    class Info(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                          "fsmblks", "uordblks", "fordblks", "keepcost")]
    mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
    mallinfo2.restype = Info
    before = mallinfo2().hblkhd
    x = torch.empty(mib << 18)
    after = mallinfo2().hblkhd
    del x
    return after - before


def _child(keep: bool) -> list[str]:
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
            "from meshplan.mesh.host_memory import keep_freed_memory\n"
            f"print(keep_freed_memory() if {keep} else None)\n"
            "from test_host_memory import fault_rounds, mmapped_by_a_tensor\n"
            "print(mmapped_by_a_tensor(), fault_rounds(), mmapped_by_a_tensor(64))")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()


def test_kept_memory_serves_large_tensors_from_the_heap():
    """glibc's default maps a fresh process's 4 MiB tensor apart (and, depending on its adaptive threshold, maps
    and faults every one again: 201,600 faults in 100 rounds of two in some runs here, 0 in others); with freed
    memory kept it comes from the heap, and 200 tensors fault in at most a few heap extensions' pages (0 or
    6,144 in eight runs here, against 204,800 if each tensor faulted)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":  # another C library: nothing changes
        from meshplan.mesh.host_memory import keep_freed_memory
        assert keep_freed_memory() is False
        return
    took, mapped, faults, large = _child(True)
    assert took == "True"
    assert int(mapped) == 0 and int(faults) < 20480, (mapped, faults)
    assert int(large) == 0  # 64 MiB, over glibc's largest threshold (DDP's flat gradient buffer): the heap too
    default = _child(False)
    assert int(default[1]) >= 4 << 20 and int(default[3]) >= 64 << 20  # the default: both mapped apart
