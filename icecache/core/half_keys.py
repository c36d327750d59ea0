"""`HalfKeys`: a float16 copy of a pager's float32 keys, with each key's norm, for the native scan's first pass.

The native scan (`icecache.kernels`) scores every key from this half-size copy, bounds each score's error by the
key's norm, and re-scores in float32 only the keys that could reach the top k: the selection equals the float32
scan's, read from about half the bytes (DRAM-bound at 8k tokens and more). The copy is filled by the scan call
itself (rows ``[done, n)`` converted before scanning): an insert costs no Python work beyond growing the arrays.
Kept only when the native kernels are loaded; ``ICECACHE_HALF_KEYS=off`` turns it off (the float32 scan runs). A
key beyond float16's range (|x| >= 65520) turns the copy off for its pager for good (the call sets ``done`` to -1).
"""

from __future__ import annotations

import os

import numpy as np

from icecache.core.capacity import grown_capacity
from icecache.kernels.library import native_kernels


class HalfKeys:
    """Rows ``[0, done)`` of a pager's keys in float16 ``[capacity, d]`` and their float32 norms ``[capacity]``."""

    def __init__(self, head_dim: int) -> None:
        self.head_dim = head_dim
        self.half = np.zeros((0, head_dim), np.float16)
        self.norms = np.zeros(0, np.float32)
        self.done = 0  # rows converted; -1: off (a key overflowed float16)

    @classmethod
    def for_native(cls, head_dim: int) -> HalfKeys | None:
        """A copy when the native kernels are loaded and the copy is on (``ICECACHE_HALF_KEYS``), else None."""
        if os.environ.get("ICECACHE_HALF_KEYS", "").lower() in ("off", "0") or native_kernels() is None:
            return None
        return cls(head_dim)

    @property
    def usable(self) -> bool:
        return self.done >= 0

    def reset(self, n: int) -> None:
        """Forget every row (a rebuild); room for ``n``."""
        self.half = np.zeros((grown_capacity(n, 0), self.head_dim), np.float16)
        self.norms = np.zeros(self.half.shape[0], np.float32)
        self.done = 0

    def reserve(self, n: int) -> None:
        """Room for ``n`` rows (capacity doubling; converted rows kept)."""
        if not self.usable or n <= self.half.shape[0]:
            return
        capacity = grown_capacity(n, self.half.shape[0])
        half = np.zeros((capacity, self.head_dim), np.float16)
        half[: self.done] = self.half[: self.done]
        norms = np.zeros(capacity, np.float32)
        norms[: self.done] = self.norms[: self.done]
        self.half, self.norms = half, norms

    def nbytes(self) -> int:
        """Bytes held (0 when off)."""
        return self.half.nbytes + self.norms.nbytes if self.usable else 0
