"""The thread-local link between `IceCache.update` and the registered attention function.

transformers never hands the cache to the attention function, so `update` publishes ``(cache, layer_idx)``
here and the attention function consumes it. One slot per thread: two generations on two threads never
see each other's caches. A publish while the same cache's previous publish was never consumed means the
model is not running the "icecache" attention (its decode would be silently wrong): that raises.
"""

from __future__ import annotations

import threading
from typing import Any

_local = threading.local()


def publish(cache: Any, layer_idx: int) -> None:
    pending = getattr(_local, "pending", None)
    if pending is not None and pending[0] is cache:
        # imported here: `import icecache` loads this module and `attention` only
        from icecache.core.errors import CacheMisuseError

        raise CacheMisuseError(
            f"IceCache layer {pending[1]} was updated but its attention never ran through IceCache: call "
            "model.set_attn_implementation('icecache') (after `import icecache`) before generating with an IceCache"
        )
    _local.pending = (cache, layer_idx)


def consume() -> tuple[Any, int] | None:
    pending = getattr(_local, "pending", None)
    _local.pending = None
    return pending


def clear(cache: Any) -> None:
    """Drop this thread's pending link if it belongs to ``cache``."""
    pending = getattr(_local, "pending", None)
    if pending is not None and pending[0] is cache:
        _local.pending = None
