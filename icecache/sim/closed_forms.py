"""Closed forms of the simulator (pure functions; docs/simulator_anchors.md, Closed forms).

A transfer costs ``calls * alpha + bytes / bandwidth``; identical jobs on a pool of T threads finish after
``ceil(J / T) * t``; unequal jobs by the longest-first rule; a flow line of identical items after
``sum + (L - 1) * max``. Units: seconds (``_s``), bytes, bytes per second (``_Bps``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from icecache.core.errors import ConfigError

__all__ = ["transfer_time_s", "pool_makespan_s", "lpt_makespan_s", "flowline_makespan_s"]


def transfer_time_s(nbytes: float, calls: int, alpha_s: float, bandwidth_Bps: float) -> float:
    """Time of ``calls`` transfers moving ``nbytes`` in total: ``calls * alpha + nbytes / bandwidth``.

    Parameters
    ----------
    nbytes : float
        Bytes moved in total (>= 0).
    calls : int
        Number of separate transfer calls (each pays the fixed cost ``alpha_s``); 0 when nothing moves.
    alpha_s : float
        Fixed cost of one call, seconds.
    bandwidth_Bps : float
        Sustained bandwidth, bytes per second (> 0).
    """
    if nbytes < 0 or calls < 0:
        raise ConfigError(f"transfer needs nbytes >= 0 and calls >= 0, got {nbytes}, {calls}")
    if bandwidth_Bps <= 0:
        raise ConfigError(f"bandwidth must be > 0, got {bandwidth_Bps}")
    if calls == 0:
        return 0.0
    return calls * alpha_s + nbytes / bandwidth_Bps


def pool_makespan_s(job_s: float, jobs: int, threads: int) -> float:
    """Makespan of ``jobs`` identical jobs of ``job_s`` seconds on ``threads`` threads: ``ceil(J/T) * t``."""
    if jobs < 0 or threads < 1 or job_s < 0:
        raise ConfigError(f"pool needs jobs >= 0, threads >= 1, job_s >= 0; got {jobs}, {threads}, {job_s}")
    return math.ceil(jobs / threads) * job_s


def lpt_makespan_s(job_times_s: Sequence[float], threads: int) -> float:
    """Makespan of unequal jobs on ``threads`` threads with the longest-processing-time-first rule."""
    if threads < 1:
        raise ConfigError(f"threads must be >= 1, got {threads}")
    loads = [0.0] * threads
    for t in sorted(job_times_s, reverse=True):
        i = loads.index(min(loads))
        loads[i] += t
    return max(loads) if loads else 0.0


def flowline_makespan_s(stage_times_s: Sequence[Sequence[float]]) -> float:
    """Finish time of items flowing in order through single-server stages in series.

    ``stage_times_s[i][j]`` is item i's time at stage j. Recurrence ``C[i][j] = max(C[i-1][j], C[i][j-1]) +
    t[i][j]``; for identical items it equals ``sum(t) + (L - 1) * max(t)``.
    """
    prev: list[float] | None = None
    for row in stage_times_s:
        cur: list[float] = []
        for j, t in enumerate(row):
            ready = max(prev[j] if prev is not None else 0.0, cur[j - 1] if j else 0.0)
            cur.append(ready + t)
        prev = cur
    return prev[-1] if prev else 0.0
