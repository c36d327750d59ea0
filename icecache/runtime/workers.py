"""`IndexWorkers`: per-layer background index work (offload + build at prefill, inserts at decode) on a CPU
thread pool.

Prefill: while the model computes layer i+1, the jobs of layer i (one per batch row and KV head: copy the
middle K/V into the host store, build the pager) run on worker threads. Decode: the token that leaves the
window at the next step is inserted into the pagers and host stores of its layer while the next layers compute.
The compiled index kernels release the GIL, so the jobs overlap with the model's own compute. A layer waits
only for its own jobs (`wait(layer)`), and an exception in a worker is raised there, in the caller, with the
layer named.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from icecache.core.errors import IceCacheError


class BackgroundJobError(IceCacheError, RuntimeError):
    """A background offload / index-build job failed; the original exception is chained (``__cause__``)."""


class IndexWorkers:
    """A small thread pool plus per-layer lists of futures."""

    def __init__(self, threads: int) -> None:
        self.threads = max(1, int(threads))
        self._executor: ThreadPoolExecutor | None = None
        self._futures: dict[int, list[tuple[str, Future]]] = {}
        self._lock = threading.Lock()
        self.job_seconds = 0.0  # summed wall time of finished jobs
        self.wait_seconds = 0.0  # time callers spent blocked in `wait`
        self.closed = False

    def submit(self, layer_idx: int, label: str, fn: Callable[..., Any], *args: Any) -> Future:
        """Run ``fn(*args)`` in the background for ``layer_idx`` (grad/inference mode copied from the caller)."""
        if self.closed:
            raise BackgroundJobError("the index workers are closed (the cache was closed)")
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="icecache")
        inference = torch.is_inference_mode_enabled()

        def run() -> Any:
            t0 = time.perf_counter()
            try:
                with torch.inference_mode(inference), torch.no_grad():
                    return fn(*args)
            finally:
                with self._lock:
                    self.job_seconds += time.perf_counter() - t0

        fut = self._executor.submit(run)
        self._futures.setdefault(layer_idx, []).append((label, fut))
        return fut

    def pending(self, layer_idx: int) -> bool:
        return bool(self._futures.get(layer_idx))

    def wait(self, layer_idx: int) -> None:
        """Block until every job of ``layer_idx`` is done; re-raise the first failure as `BackgroundJobError`."""
        jobs = self._futures.pop(layer_idx, None)
        if not jobs:
            return
        t0 = time.perf_counter()
        try:
            first: tuple[str, BaseException] | None = None
            for label, fut in jobs:
                exc = fut.exception()  # waits; never raises the job's own exception here
                if exc is not None and first is None:
                    first = (label, exc)
            if first is not None:
                label, exc = first
                raise BackgroundJobError(
                    f"background job '{label}' of layer {layer_idx} failed: {type(exc).__name__}: {exc}"
                ) from exc
        finally:
            self.wait_seconds += time.perf_counter() - t0

    def wait_all(self) -> None:
        for layer_idx in sorted(self._futures):
            self.wait(layer_idx)

    def close(self) -> None:
        """Cancel what has not started, wait for what has, and release the threads. Idempotent."""
        self.closed = True
        self._futures.clear()
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None
