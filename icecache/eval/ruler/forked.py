"""Answer one sample's methods on forked processes that share its dense prefill (``--method-workers N``).

A decode step of these small models is mostly single-threaded Python between torch ops too small to gain from
a second intra-op thread, so one sample's methods finish sooner side by side, one CPU core each, than one after
another on every core. The prefill is computed once in the driver; each worker is forked after it and reads it
copy-on-write (nothing is pickled but the finished records). Worker ``i`` is pinned to one of the driver's CPUs
(in turn) and runs one torch and one numba thread, so the runtime's own thread policy (`IceCacheConfig.inserts`
``"auto"``) sees the one core it has. One thread is not only a choice: GNU OpenMP (torch's and numba's) cannot
start a thread team in a process forked after its parent used one, and the driver's prefill did; a forked
worker with two intra-op threads hangs in its first parallel op. Records are the same as a one-process run's,
up to timings (tests/test_ruler_runner.py).
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

#: the jobs of the sample being answered, read by the forked workers (set only while `answer_forked` runs)
_JOBS: Sequence[Callable[[int], dict[str, Any]]] | None = None
#: the driver's CPUs, split between the workers
_CORES: list[int] = []


def driver_cores() -> list[int]:
    """CPUs this process may run on."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def worker_core(cores: Sequence[int], worker: int) -> int:
    """The CPU of ``cores`` that worker number ``worker`` is pinned to (round-robin when workers outnumber
    cores)."""
    return cores[worker % len(cores)]


def _start_worker(counter: Any) -> None:
    """Pool initializer: pin this worker to its CPU, one torch and one numba thread (numba first: launching its
    OpenMP layer resets the thread count torch reads)."""
    import torch

    with counter.get_lock():
        worker = counter.value
        counter.value += 1
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, [worker_core(_CORES, worker)])
    try:
        import numba

        numba.set_num_threads(1)
    except ImportError:  # pragma: no cover - numba is a core dependency
        pass
    torch.set_num_threads(1)


def _run_job(position: int) -> tuple[int, dict[str, Any]]:
    assert _JOBS is not None, "not an answer_forked worker"
    return position, _JOBS[position](1)


def answer_forked(jobs: Sequence[Callable[[int], dict[str, Any]]], workers: int) -> Iterator[tuple[int, dict[str, Any]]]:
    """Run ``jobs`` (each ``job(threads) -> record``) on ``workers`` processes forked now; yield ``(position,
    record)`` as each finishes, longest-queued first (jobs are handed out in order, one at a time).

    A job's exception is raised here (the pool stops). Needs the ``fork`` start method (Linux, macOS)."""
    global _JOBS, _CORES
    if "fork" not in multiprocessing.get_all_start_methods():
        from icecache.core.errors import ConfigError

        raise ConfigError("--method-workers needs processes started by fork, which this platform does not have")
    context = multiprocessing.get_context("fork")
    _JOBS, _CORES = jobs, driver_cores()
    counter = context.Value("i", 0)
    try:
        with context.Pool(min(workers, len(jobs)), initializer=_start_worker, initargs=(counter,)) as pool:
            yield from pool.imap_unordered(_run_job, range(len(jobs)), chunksize=1)
    finally:
        _JOBS, _CORES = None, []
