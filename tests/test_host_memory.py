"""A CPU job's allocator (meshplan/mesh/host_memory.py): glibc keeps freed memory, so a step's large tensors reuse
their pages. Run in a child process: the setting is the process's."""

import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.fast

ROUNDS = """
import resource, torch
from meshplan.mesh.host_memory import keep_freed_memory
print(keep_freed_memory() if {keep} else None)
def rounds(n):
    for _ in range(n):
        x, y = torch.empty(1 << 20), torch.empty(1 << 20)
        x.fill_(0), y.fill_(1)
        del x, y
rounds(5)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
rounds(100)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(keep: bool) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", ROUNDS.format(keep=keep)], capture_output=True, text=True,
                         check=True).stdout.split()
    return out[0], int(out[1])


def test_kept_memory_takes_no_fault_per_large_tensor():
    """On Linux with glibc both settings take, and 200 tensors of 4 MiB (1,024 pages each; 204,800 faults if each
    came from a fresh mmap) fault in at most a few heap extensions' pages (0 or 1,024 in six runs here)."""
    took, faults = _faults(True)
    assert took == str(platform.system() == "Linux" and platform.libc_ver()[0] == "glibc")
    if took == "True":
        assert faults < 4096, faults
