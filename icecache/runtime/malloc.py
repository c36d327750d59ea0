"""glibc heap settings for long generations (process-wide; a no-op elsewhere). `IceCacheConfig.heap_policy`
picks one.

glibc serves an allocation from its heaps below the *mmap threshold* and with ``mmap`` above it, and by default
raises that threshold to the size of any mmapped block that is freed (up to 32 MiB). Once a large block has
come and gone (hnswlib growing a graph, a big temporary), mid-sized buffers come from the heaps; those freed
on worker threads stay in the workers' heaps, and the resident size creeps up by tens to hundreds of KB per
decode step (``experiments/reliability.md``: the tiny-model soak with the `hnsw` pager grew 71-318 KB per step
in 6 of 14 runs; SmolLM2 with `mdci` 324 KB per step, 172 of them explained).

* `trim_heap` (``heap_policy="trim"``, the default: every 256 decode steps) hands the free pages of every heap
  back; cheap, and it bounds most of the growth (hnsw probe: 4-30 KB per step).
* `pin_mmap_threshold` (``"pin"``) fixes the threshold, which also stops the dynamic adjustment, so large
  blocks always go back when freed: no growth in any measured run (hnsw 20k soak 7.6 KB per step), but every
  large allocation is a fresh mapping: index builds ~40% and decode steps ~3% slower on our CPU.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import threading

M_MMAP_THRESHOLD = -3  # mallopt parameter number in glibc's malloc.h
DEFAULT_THRESHOLD = 128 * 1024  # glibc's own starting value

_lock = threading.Lock()
_applied: int | None = None


@functools.lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL | None:
    """glibc's handle (found once: `find_library` runs ``ldconfig``), or None elsewhere."""
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
    by this function (False: not glibc, or left alone because the user set ``MALLOC_MMAP_THRESHOLD_``, unless
    ``force``). Idempotent; thread-safe."""
    global _applied
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
        raise ValueError(f"nbytes must be a positive int, got {nbytes!r}")
    if not force and "MALLOC_MMAP_THRESHOLD_" in os.environ:
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


def trim_heap() -> bool:
    """Return the free memory of every glibc heap (every thread's arena) to the system (``malloc_trim(0)``).
    Returns whether anything was released; False where not glibc. Costs about a millisecond per GB of heap."""
    lib = _libc()
    if lib is None or not hasattr(lib, "malloc_trim"):
        return False
    return bool(lib.malloc_trim(ctypes.c_size_t(0)))
