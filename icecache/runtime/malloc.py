"""glibc heap settings for long generations (process-wide; a no-op elsewhere).

glibc serves an allocation from its heaps below the *mmap threshold* and with ``mmap`` above it, and by default
raises that threshold to the size of any mmapped block that is freed (up to 32 MiB). Once a large block has
come and gone (hnswlib growing a graph, a big temporary), every later mid-sized buffer comes from a heap; buffers
freed on worker threads stay in those threads' heaps, and the resident size creeps up by tens to hundreds of KB
per decode step. Measured in the tiny-model soak with the `hnsw` pager (``experiments/reliability.md``):
intermittent growth of 39-318 KB per step with the default, none in any run with the threshold fixed.

`pin_mmap_threshold` fixes the threshold (which also turns the dynamic adjustment off), so large blocks always
go back to the system when freed. `IceCache` calls it once per process; set ``ICECACHE_KEEP_MALLOC=1`` (or your
own ``MALLOC_MMAP_THRESHOLD_``) to keep the allocator as it is.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading

M_MMAP_THRESHOLD = -3  # mallopt parameter number in glibc's malloc.h
DEFAULT_THRESHOLD = 128 * 1024  # glibc's own starting value

_lock = threading.Lock()
_applied: int | None = None


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        lib = ctypes.CDLL(name)
    except OSError:
        return None
    return lib if hasattr(lib, "mallopt") and hasattr(lib, "gnu_get_libc_version") else None


def pin_mmap_threshold(nbytes: int = DEFAULT_THRESHOLD, *, force: bool = False) -> bool:
    """Fix glibc's mmap threshold at ``nbytes`` (bytes, > 0) for this process. Returns whether it is now pinned
    by this function (False: not glibc, or left alone because ``ICECACHE_KEEP_MALLOC=1`` or
    ``MALLOC_MMAP_THRESHOLD_`` is set, unless ``force``). Idempotent; thread-safe."""
    global _applied
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
        raise ValueError(f"nbytes must be a positive int, got {nbytes!r}")
    if not force and (os.environ.get("ICECACHE_KEEP_MALLOC", "") not in ("", "0") or "MALLOC_MMAP_THRESHOLD_" in os.environ):
        return False
    with _lock:
        if _applied == nbytes:
            return True
        lib = _libc()
        if lib is None or lib.mallopt(ctypes.c_int(M_MMAP_THRESHOLD), ctypes.c_int(nbytes)) != 1:
            return False
        _applied = nbytes
        return True


def pinned_threshold() -> int | None:
    """The threshold `pin_mmap_threshold` set in this process, or None."""
    return _applied
