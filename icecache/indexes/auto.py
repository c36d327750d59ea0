"""``index="auto"``: the exact scorer below a crossover number of offloaded keys, M-DCI at or above it.

Below some size, scoring every key (``exact``: one q.K product and a top-k) is both faster and more accurate
than searching an index; above it M-DCI's select, which touches a fraction of the keys, wins. Where the two
meet depends on the machine (memory bandwidth, BLAS, cores), so the crossover is measured, not assumed:
`measure_crossover` times what each pager costs per decode step and (layer, KV head), one ``select_arrays``
plus the one-token ``insert`` of the token leaving the window, on Gaussian keys at a grid of sizes for the
model's head width, GQA group and budget, and `crossover_from_times` finds where M-DCI becomes the cheaper one.
The insert counts because M-DCI's is far dearer than the exact scorer's row copy (SmolLM2 at 8k: the two
selects cost about the same inside a decode step, yet M-DCI's steps were 9-10% slower: its inserts run on the
index worker beside the model, on the same two cores). Each
timed call starts from cold caches (`EVICT_BYTES` read first; this VM reports a 480 MiB L3 shared with its host,
so 'cold' means out of the core's own caches at least), as in a decode step,
where the selects of 84+ (layer, KV head) pairs and the model's weights pass through the caches between two
selects of one head: timed hot, exact's streaming scan looked slower against M-DCI's scattered reads than it
is in the step (SmolLM2 at 8k: hot crossover 3,050 keys, yet exact was the faster pager in the step).

The runtime (`icecache.runtime.cache.IceCache`) decides once per cache, from the middle tokens per head the
generation is expected to hold (prompt, or ``max_cache_len`` when given, minus sink and window), and reports
the choice in ``stats()["index"]``. A cache that starts below the crossover keeps the exact scorer while it
grows past it (still exact; slower than M-DCI there).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from icecache.core.errors import ConfigError

AUTO = "auto"
#: the pagers ``auto`` chooses between: (below the crossover, at or above it)
CHOICES = ("exact", "mdci")
#: key counts per head at which `measure_crossover` times both selects
DEFAULT_GRID = (2048, 4096, 8192, 16384, 32768, 65536)
#: the largest crossover reported (when M-DCI is never faster, extrapolated no further)
MAX_CROSSOVER = 1 << 20
#: bytes read before each timed select so that it starts from cold caches (twice a 32 MiB last-level cache)
EVICT_BYTES = 64 << 20


def check_auto_params(params: dict[str, Any]) -> int | None:
    """The parameters ``index="auto"`` takes: only ``crossover`` (keys per head, an int >= 0) to fix the
    crossover instead of measuring it. Returns it, or None to use the measured one."""
    unknown = sorted(set(params) - {"crossover"})
    if unknown:
        raise ConfigError(f"pager 'auto' has no parameter {', '.join(map(repr, unknown))}; its parameters: crossover")
    value = params.get("crossover")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"index 'auto': crossover must be an int >= 0 (keys per head), got {value!r}")
    return value


def check_index(index: str, params: dict[str, Any], *, head_dim: int, page_size: int, seed: int) -> None:
    """Raise `ConfigError` unless ``index`` is ``"auto"`` with its parameters, or a registered pager that takes
    ``params`` (it is made once on a tiny shape to check)."""
    if index == AUTO:
        check_auto_params(params)
        return
    from icecache.indexes.registry import make_pager

    make_pager(index, head_dim=head_dim, page_size=page_size, seed=seed, **params)


def choose_index(middle_keys: int, crossover: int) -> str:
    """``"exact"`` when a head will hold fewer than ``crossover`` offloaded keys, else ``"mdci"``."""
    return CHOICES[0] if middle_keys < crossover else CHOICES[1]


def crossover_from_times(grid: Sequence[int], exact_s: Sequence[float], mdci_s: Sequence[float]) -> int:
    """Keys per head where M-DCI's select becomes faster than the exact scorer's.

    ``grid`` ``[m]`` ascending key counts, ``exact_s`` / ``mdci_s`` ``[m]`` select seconds there. The log of the
    time ratio mdci/exact is interpolated linearly in log(keys) between the first pair of grid points where it
    changes sign; beyond the grid it is extrapolated from the two outermost points (and capped to
    [0, `MAX_CROSSOVER`]). Pure function.
    """
    if not (len(grid) == len(exact_s) == len(mdci_s)) or len(grid) < 2:
        raise ValueError("need at least two grid points with one exact and one mdci time each")
    x = np.log(np.asarray(grid, dtype=np.float64))
    r = np.log(np.asarray(mdci_s, dtype=np.float64) / np.asarray(exact_s, dtype=np.float64))  # > 0: exact faster

    def root(i: int, j: int) -> float:
        if r[i] == r[j]:
            return math.inf if r[i] > 0 else 0.0
        t = x[i] + (0.0 - r[i]) * (x[j] - x[i]) / (r[j] - r[i])
        return math.exp(min(t, 700.0))  # nearly equal ratios extrapolate far: e^700 is finite, capped below

    if r[0] <= 0:  # M-DCI already faster at the smallest size
        n = root(0, 1) if r[1] < r[0] else 0.0
        return int(min(max(n, 0.0), grid[0]))
    for i in range(len(grid) - 1):
        if r[i + 1] <= 0:
            return int(round(root(i, i + 1)))
    n = root(len(grid) - 2, len(grid) - 1) if r[-1] < r[-2] else math.inf
    return int(min(max(n, grid[-1]), MAX_CROSSOVER))


def measure_crossover(head_dim: int, group: int, budget: int, page_size: int, *, grid: Sequence[int] = DEFAULT_GRID,
                      calls: int = 30, seed: int = 0, cold: bool = True, select_threads: int = 1,
                      progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Time what one decode step costs each pager per (layer, KV head): one ``select_arrays`` (``group``
    queries, ``budget`` tokens) plus the one-token ``insert`` of the token leaving the window. Gaussian keys
    ``[n, head_dim]`` for each ``n`` of ``grid``; one torch thread, and ``select_threads`` for the pagers' own
    parallel scans (`SemanticPager`); median of ``calls``; the two pagers' calls
    alternate so that the machine's drift hits both alike; ``cold``: each timed call starts from cold caches
    (`EVICT_BYTES` read first, not timed). Returns ``{"crossover_keys", "grid", "exact_s", "mdci_s"`` (select +
    insert per step) ``, "select_s", "insert_s"`` (per pager: the medians of each part) ``, "calls", "cold",
    "select_threads", "seconds"}``."""
    from icecache.indexes.registry import make_pager

    rng = np.random.default_rng(seed)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the runtime selects on one thread
    t_start = time.perf_counter()
    evict = np.ones(EVICT_BYTES // 8) if cold else None

    def timed(fn: Callable[..., Any], *args: Any) -> float:
        if evict is not None:
            evict.sum()
        t0 = time.perf_counter()
        fn(*args, check=False)
        return time.perf_counter() - t0

    step: dict[str, list[float]] = {name: [] for name in CHOICES}
    parts: dict[str, dict[str, list[float]]] = {name: {"select": [], "insert": []} for name in CHOICES}
    try:
        for n in grid:
            if progress is not None:
                progress(f"{n:,} keys")
            keys = torch.from_numpy(rng.standard_normal((n, head_dim), dtype=np.float32))
            queries = [torch.from_numpy(rng.standard_normal((group, head_dim), dtype=np.float32)) for _ in range(calls)]
            new_keys = torch.from_numpy(rng.standard_normal((calls + 1, 1, head_dim), dtype=np.float32))
            pagers = {name: make_pager(name, head_dim=head_dim, page_size=page_size, seed=seed) for name in CHOICES}
            for pager in pagers.values():
                pager.select_threads = select_threads
                pager.build(keys)
                pager.select_arrays(queries[0], budget, check=False)  # warm-up
                pager.insert(new_keys[calls], check=False)
            calls_s: dict[str, dict[str, list[float]]] = {name: {"select": [], "insert": []} for name in CHOICES}
            for i, q in enumerate(queries):
                for name, pager in pagers.items():
                    calls_s[name]["select"].append(timed(pager.select_arrays, q, budget))
                    calls_s[name]["insert"].append(timed(pager.insert, new_keys[i]))
            for name in CHOICES:
                sel, ins = calls_s[name]["select"], calls_s[name]["insert"]
                step[name].append(statistics.median(a + b for a, b in zip(sel, ins)))
                parts[name]["select"].append(statistics.median(sel))
                parts[name]["insert"].append(statistics.median(ins))
    finally:
        torch.set_num_threads(threads)
    return {
        "crossover_keys": crossover_from_times(grid, step["exact"], step["mdci"]),
        "grid": list(grid), "exact_s": step["exact"], "mdci_s": step["mdci"],
        "select_s": {name: parts[name]["select"] for name in CHOICES},
        "insert_s": {name: parts[name]["insert"] for name in CHOICES},
        "calls": calls, "cold": cold, "select_threads": select_threads, "seconds": round(time.perf_counter() - t_start, 2),
    }
