"""Timing helpers of the measurements: machine description, repeated and interleaved timings, statistics."""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["machine_info", "timeit", "STATISTICS", "interleaved"]


def machine_info() -> dict[str, Any]:
    """CPU model, usable CPUs, OS and host name, torch threads, load average."""
    import torch

    cpu = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        ncpu = len(os.sched_getaffinity(0))
    except AttributeError:
        ncpu = os.cpu_count() or 1
    return {
        "cpu_model": cpu,
        "cpu_count": ncpu,
        "platform": platform.platform(),
        "host": platform.node(),
        "torch_threads": torch.get_num_threads(),
        "loadavg_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


def timeit(fn: Callable[[], Any], reps: int, warmup: int = 1, after: Callable[[], Any] | None = None) -> list[float]:
    """Wall seconds of ``reps`` calls of ``fn`` after ``warmup`` calls (``after`` runs untimed after each)."""
    out = []
    for i in range(warmup + reps):
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        if after is not None:
            after()
        if i >= warmup:
            out.append(dt)
    return out


def _median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


#: Statistic each predictor is fitted to. The 25th percentile: timings on a shared machine have a long upper
#: tail (other users' bursts); a low percentile estimates the undisturbed cost more stably than the median.
STATISTICS: dict[str, Callable[[Sequence[float]], float]] = {
    "p25": lambda xs: float(np.percentile(xs, 25)),
    "median": _median,
    "min": lambda xs: float(min(xs)),
}


def interleaved(fns: dict[Any, Callable[[], Any]], reps: int, warmup: int = 1,
                after: dict[Any, Callable[[], Any]] | None = None) -> dict[Any, list[float]]:
    """`timeit` over several functions in rounds (one call of each per round), so that a burst of load from
    another process spreads over all points instead of spoiling one."""
    out: dict[Any, list[float]] = {k: [] for k in fns}
    for i in range(warmup + reps):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            dt = time.perf_counter() - t0
            if after and k in after:
                after[k]()
            if i >= warmup:
                out[k].append(dt)
    return out
