"""Host memory: how a CPU run's process gets its large blocks from glibc's malloc, so that its RSS follows the
tensors it holds (`map_large_allocations`)."""

from __future__ import annotations

import ctypes
import os

# Blocks of at least this size get a mapping of their own from malloc, returned to the system when freed.
LARGE_ALLOCATION_BYTES = 2**20
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)


def map_large_allocations(threshold: int = LARGE_ALLOCATION_BYTES) -> bool:
    """Have glibc's malloc serve every block of ``threshold`` bytes or more with a mapping of its own and give it back
    to the system when it is freed (``mallopt(M_MMAP_THRESHOLD)``, which also fixes the threshold). Returns whether
    it was set: not when ``MALLOC_MMAP_THRESHOLD_`` is in the environment (glibc's own setting: the user's stands) or
    the C library is not glibc.

    By default glibc raises the threshold to the size of the largest mapped block freed so far (up to 32 MiB): after
    the first step every activation, logit and gradient tensor of a small model comes from the heap, and the heap
    keeps what is freed, resident, in holes that later tensors of other sizes do not fill. On the CPU the peak RSS is
    then the heap's high-water mark: on the bench model 290-340 MB above the tensors alive, which made a LoRA run's
    peak higher than full fine-tuning's (bench/bench_lora_memory.py, docs/lora.md). The cost: the pages of each
    large block are faulted in anew (zeroed) at every allocation."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        return bool(ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, threshold))
    except (OSError, AttributeError):  # not glibc (musl, macOS)
        return False
