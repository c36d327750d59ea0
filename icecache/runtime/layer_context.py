"""What a sparse layer uses of its `IceCache`, handed down once: `LayerContext` and `FaultHooks`.

The cache owns its index workers, stage timer, decode accounting and fault hooks, resolves its pager
(`icecache.runtime.pager_choice`) at the first update, and then gives each sparse layer one frozen
`LayerContext`. A layer never holds a reference back to its cache (vLLM's managers delegate downward the same
way).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from icecache.core.config import IceCacheConfig
from icecache.core.errors import ConfigError
from icecache.core.pager import SemanticPager
from icecache.runtime.selection import DecodeAccounting
from icecache.runtime.timing import StageTimer
from icecache.runtime.workers import IndexWorkers

#: ``(layer_idx, row, kv_head, head_dim) -> pager`` (made with ``record_moves=True``)
PagerFactory = Callable[[int, int, int, int], SemanticPager]

#: Fault-injection points for reliability tests (`FaultHooks`): "build" (layer, row, head) runs in an
#: index-build worker; "load" (layer, length) before the bulk loader; "decode" (layer, length) at the start of a
#: decode step.
FAULT_POINTS = ("build", "load", "decode")


class FaultHooks:
    """Hooks run at the layers' fault points (`FAULT_POINTS`), set by `IceCache.inject_fault` at any time."""

    def __init__(self) -> None:
        self._hooks: dict[str, Callable[..., Any]] = {}

    def set(self, point: str, hook: Callable[..., Any] | None) -> None:
        """Run ``hook`` (which may raise) at ``point``; None removes it."""
        if point not in FAULT_POINTS:
            raise ConfigError(f"unknown fault point {point!r}; known: {', '.join(FAULT_POINTS)}")
        if hook is None:
            self._hooks.pop(point, None)
        else:
            self._hooks[point] = hook

    def __call__(self, point: str, *args: Any) -> None:
        """Called by a layer at each fault point: runs the injected hook, if any."""
        hook = self._hooks.get(point)
        if hook is not None:
            hook(*args)


@dataclass(frozen=True)
class LayerContext:
    """Everything a sparse layer needs from its cache, resolved at the cache's first update.

    ``make_pager`` makes each (row, KV head)'s pager; ``max_length`` is the positions device buffers are sized
    for (the prompt, or ``max_cache_len`` when larger). Where decode inserts run is the workers' setting
    (``workers.prefetch_inserts``)."""

    config: IceCacheConfig
    make_pager: PagerFactory
    workers: IndexWorkers
    timer: StageTimer
    accounting: DecodeAccounting
    faults: FaultHooks
    max_length: int
