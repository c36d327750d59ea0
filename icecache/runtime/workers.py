"""`IndexWorkers`: per-layer background index work (offload + build at prefill, inserts at decode) on a CPU
thread pool.

Prefill: while the model computes layer i+1, the jobs of layer i (one per batch row and KV head: copy the
middle K/V into the host store, build the pager) run on worker threads. Decode: the token that leaves the
window at the next step is inserted into the pagers and host stores of its layer while the next layers compute.
The compiled index kernels release the GIL, so the jobs overlap with the model's own compute. A layer waits
only for its own jobs (`wait(layer)`), and an exception in a worker is raised there, in the caller, with the
layer named.

Two kinds of threads. Prefill jobs ("build") run with torch's default intra-op threads: they use the cores the
model's prefill leaves idle. Decode jobs ("insert") run on threads whose torch ops use one OpenMP thread: a
decode step is many small torch ops, each forking an OpenMP team over every core, and a worker with a team of its
own takes those cores from it (measured on 2 cores, SmolLM2 at 1k tokens: every linear layer of the decode step
~100 us slower, 576x576 58 -> 163 us; TPOT with the sequential pager 82 -> 56 ms once the inserts ran on one
thread; `experiments/bench_runtime/README.md`). The build threads are released when the first insert is
submitted or the decode starts (synchronous inserts too), so their OpenMP teams do not linger beside the decode
(with them alive, at 400 tokens with synchronous inserts, every linear took 210 instead of 123 us). Whether the
decode inserts run here at all is `IceCacheConfig.inserts` (`background_inserts`): on a CPU whose cores all run
the model's ops, inline on the decode thread measured faster. A fresh insert thread starts with an empty malloc
arena: a buffer that grows on it faults in new pages, which is why buffers are built with spare
room (`icecache.core.capacity`; without it M-DCI at 8k decoded slower on this thread than on the old shared one).
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from icecache.core.config import inserts_in_background
from icecache.core.errors import IceCacheError


class BackgroundJobError(IceCacheError, RuntimeError):
    """A background offload / index-build job failed; the original exception is chained (``__cause__``)."""


#: job kinds: "build" (prefill offload + index build) and "insert" (a decode step's prefetched insert)
JOB_KINDS: tuple[str, ...] = ("build", "insert")


@functools.lru_cache(maxsize=1)
def _omp_set_num_threads() -> Callable[[int], None] | None:
    """OpenMP's ``omp_set_num_threads`` as torch loaded it (None: not found, e.g. a build without OpenMP)."""
    if not torch.backends.openmp.is_available():
        return None
    try:
        return ctypes.CDLL(None).omp_set_num_threads
    except (AttributeError, OSError):
        return None


def one_intra_op_thread() -> None:
    """Thread initializer: this thread's torch ops run on one OpenMP thread. Only this thread changes:
    ``torch.set_num_threads`` would also lower the default of every thread the process starts later."""
    setter = _omp_set_num_threads()
    if setter is None:
        warnings.warn("icecache: omp_set_num_threads not found; decode inserts keep torch's default intra-op "
                      "threads and may slow the decode step", RuntimeWarning, stacklevel=2)
        return
    torch.get_num_threads()  # torch's lazy per-thread set-up first: it would reset the count set below
    setter(1)


def background_inserts(mode: str, device: torch.device) -> bool:
    """Whether decode inserts run on a worker thread (`IceCacheConfig.inserts`): ``"background"`` / ``"inline"``
    as given; ``"auto"``: background when the KV cache is on an accelerator, or when torch's intra-op threads
    leave one of this process's CPU cores free."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return inserts_in_background(mode, device.type != "cpu", cores - torch.get_num_threads())


class IndexWorkers:
    """Two small thread pools (build, insert; see the module docstring) plus per-layer lists of futures."""

    def __init__(self, threads: int) -> None:
        self.threads = max(1, int(threads))
        self._executors: dict[str, ThreadPoolExecutor] = {}
        self._futures: dict[int, list[tuple[str, Future]]] = {}
        self._lock = threading.Lock()
        self.job_seconds = 0.0  # summed wall time of finished jobs
        self.wait_seconds = 0.0  # time callers spent blocked in `wait`
        self.closed = False
        #: decode steps insert the token that will leave the window next on a worker during this step (same
        #: result as inline); None until the cache resolves ``IceCacheConfig.inserts`` for the KV's device
        self.prefetch_inserts: bool | None = None

    def _executor_for(self, kind: str) -> ThreadPoolExecutor:
        if kind not in JOB_KINDS:
            raise ValueError(f"unknown job kind {kind!r} (one of {', '.join(JOB_KINDS)})")
        executor = self._executors.get(kind)
        if executor is None:
            if kind == "insert":
                self.release_build_threads()
            initializer = one_intra_op_thread if kind == "insert" else None
            executor = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix=f"icecache-{kind}",
                                          initializer=initializer)
            self._executors[kind] = executor
        return executor

    def release_build_threads(self) -> None:
        """Let the build threads exit once their queued jobs are done (the jobs still run; their layers wait for
        them). Called when the decode starts, whether or not it inserts on a worker: while a build thread lives,
        its OpenMP team counts against the cores and the decode step's ops run slower. Idempotent; a later
        prefill gets fresh build threads."""
        executor = self._executors.pop("build", None)
        if executor is not None:
            executor.shutdown(wait=False)

    def submit(self, layer_idx: int, label: str, fn: Callable[..., Any], *args: Any, kind: str = "build") -> Future:
        """Run ``fn(*args)`` in the background for ``layer_idx`` on the ``kind`` threads (grad/inference mode
        copied from the caller)."""
        if self.closed:
            raise BackgroundJobError("the index workers are closed (the cache was closed)")
        executor = self._executor_for(kind)
        inference = torch.is_inference_mode_enabled()

        def run() -> Any:
            t0 = time.perf_counter()
            try:
                with torch.inference_mode(inference), torch.no_grad():
                    return fn(*args)
            finally:
                with self._lock:
                    self.job_seconds += time.perf_counter() - t0

        fut = executor.submit(run)
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
        for executor in self._executors.values():
            executor.shutdown(wait=True, cancel_futures=True)
        self._executors.clear()
