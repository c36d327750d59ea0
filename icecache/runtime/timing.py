"""Per-stage wall-clock timers for the decode path (select, gather, copy, scatter, attend, insert, other)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

STAGES = ("select", "gather", "copy", "scatter", "attend", "insert", "other")


class StageTimer:
    """Accumulates seconds per named stage. Not thread-safe: one timer per cache, used on the caller's thread."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {s: 0.0 for s in STAGES}
        self.enabled = True

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0

    def reset(self) -> None:
        for k in self.seconds:
            self.seconds[k] = 0.0
