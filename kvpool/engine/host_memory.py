"""Freed activation memory kept by the process (glibc), so a step does not fault its pages in again.

A prefill step's activations are megabytes per op (1,088 rows x 3,072 bf16 values is 6.7 MB),
above glibc's mmap threshold: each such tensor was mapped fresh and unmapped when freed, and the
next step faulted every page in again and had the kernel zero it (measured: ~20,000 page faults,
about a tenth of a 1,088-token prefill's time on one thread). With a fixed threshold at glibc's
maximum and no trimming, those tensors come from the heap and are reused. The cost is that the
largest step's working set stays resident, which serving needs again at the next long prompt.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

logger = logging.getLogger(__name__)

# mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 32 << 20  # glibc's ceiling on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX)
NEVER_TRIM = (1 << 31) - 1  # an int: mallopt's value argument

_applied: bool | None = None


def keep_freed_memory() -> bool:
    """Apply the settings once per process; False where the C library is not glibc."""
    global _applied
    if _applied is None:
        _applied = _apply()
    return _applied


def _apply() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and others have no mallopt
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX) == 1 and mallopt(M_TRIM_THRESHOLD, NEVER_TRIM) == 1
    if not ok:
        logger.warning("mallopt refused the activation-memory settings; large steps will fault their pages in")
    return ok
