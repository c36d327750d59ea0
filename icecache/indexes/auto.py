"""``index="auto"``: M-DCI's pages ranked by scoring every key below a crossover number of offloaded keys per
head, M-DCI's tree search at or above it.

Both choices use the same semantic pages (`icecache.indexes.mdci.MDCIPager`); they differ in how a select ranks
them. Below some size, scoring every key (``mdci[search=exhaustive]``: one q.K scan and each page's best key,
`icecache.indexes.page_scan`) is faster than the tree's descent and misses nothing; above it the descent, which
touches a fraction of the keys, is faster. Where the two meet depends on the machine (memory bandwidth, cores),
so the crossover is measured, not assumed: `measure_crossover` times what each costs per decode step and (layer,
KV head), one ``select_arrays`` plus the one-token ``insert`` of the token leaving the window, on Gaussian keys at
a grid of sizes for the model's head width, GQA group and budget, and `crossover_from_times` finds where the tree
search becomes the cheaper one. Each timed call starts from cold caches (`EVICT_BYTES` read first), as in a decode
step, where the selects of 84+ (layer, KV head) pairs and the model's weights pass through the caches between two
selects of one head.

Until 2026-12-05 the choice below the crossover was the exact top-B token oracle (``exact``), whose select and
insert are cheaper still. It was dropped for accuracy: on SmolLM2 4k RULER NIAH (200 samples) it scored 4.1
points below M-DCI at budget 256 (paired bootstrap 95% interval [-7.1, -1.4]); ranking M-DCI's own pages
exhaustively kept M-DCI's score on the samples where the two disagreed (``experiments/auto_pages/``).

The runtime (`icecache.runtime.pager_choice.resolve_pager`) decides once per cache, from the middle tokens per head the
generation is expected to hold (prompt, or ``max_cache_len`` when given, minus sink and window), and reports
the choice in ``stats()["index"]``. A cache that starts below the crossover keeps scoring every key while it
grows past it (same pages; slower than the tree search there).
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
#: what ``auto`` chooses between, as pager specs (`icecache.core.spec`; what ``stats()["index"]`` reports): below
#: the crossover, at or above it
CHOICES: tuple[str, ...] = ("mdci[search=exhaustive]", "mdci")
#: short labels of the two choices in `measure_crossover`'s result
LABELS = ("exhaustive", "tree")
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


def choose_index(middle_keys: int, crossover: int) -> str:
    """``"mdci[search=exhaustive]"`` when a head will hold fewer than ``crossover`` offloaded keys, else
    ``"mdci"`` (a name of `CHOICES`)."""
    return CHOICES[0] if middle_keys < crossover else CHOICES[1]


def crossover_from_times(grid: Sequence[int], scan_s: Sequence[float], index_s: Sequence[float]) -> int:
    """Keys per head where an index's select becomes faster than a scan of every key.

    ``grid`` ``[m]`` ascending key counts, ``scan_s`` (every key scored: ``mdci[search=exhaustive]``) / ``index_s``
    (the tree search) ``[m]`` seconds there. The log of the time ratio index/scan is interpolated linearly in
    log(keys) between the first pair of grid points where it
    changes sign; beyond the grid it is extrapolated from the two outermost points (and capped to
    [0, `MAX_CROSSOVER`]). Pure function.
    """
    if not (len(grid) == len(scan_s) == len(index_s)) or len(grid) < 2:
        raise ValueError("need at least two grid points with one scan and one index time each")
    x = np.log(np.asarray(grid, dtype=np.float64))
    r = np.log(np.asarray(index_s, dtype=np.float64) / np.asarray(scan_s, dtype=np.float64))  # > 0: the scan is faster

    def root(i: int, j: int) -> float:
        if r[i] == r[j]:
            return math.inf if r[i] > 0 else 0.0
        t = x[i] + (0.0 - r[i]) * (x[j] - x[i]) / (r[j] - r[i])
        return math.exp(min(t, 700.0))  # nearly equal ratios extrapolate far: e^700 is finite, capped below

    if r[0] <= 0:  # the index already faster at the smallest size
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
    """Time what one decode step costs each choice (`CHOICES`, labelled `LABELS`) per (layer, KV head): one
    ``select_arrays`` (``group`` queries, ``budget`` tokens) plus the one-token ``insert`` of the token leaving
    the window (the same M-DCI insert for both: it is timed so that a step's cost is whole). Gaussian keys
    ``[n, head_dim]`` for each ``n`` of ``grid``; one torch thread, and ``select_threads`` for the pagers' own
    parallel scans (`SemanticPager`); median of ``calls``; the two pagers' calls alternate so that the
    machine's drift hits both alike; ``cold``: each timed call starts from cold caches (`EVICT_BYTES` read
    first, not timed). Returns ``{"crossover_keys", "grid", "exhaustive_s", "tree_s"`` (select + insert per
    step) ``, "select_s", "insert_s"`` (per label: the medians of each part) ``, "calls", "cold",
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

    step: dict[str, list[float]] = {name: [] for name in LABELS}
    parts: dict[str, dict[str, list[float]]] = {name: {"select": [], "insert": []} for name in LABELS}
    try:
        for n in grid:
            if progress is not None:
                progress(f"{n:,} keys")
            keys = torch.from_numpy(rng.standard_normal((n, head_dim), dtype=np.float32))
            queries = [torch.from_numpy(rng.standard_normal((group, head_dim), dtype=np.float32)) for _ in range(calls)]
            new_keys = torch.from_numpy(rng.standard_normal((calls + 1, 1, head_dim), dtype=np.float32))
            pagers = {label: make_pager(spec, head_dim=head_dim, page_size=page_size, seed=seed)
                      for label, spec in zip(LABELS, CHOICES)}
            for pager in pagers.values():
                pager.select_threads = select_threads
                pager.build(keys)
                pager.select_arrays(queries[0], budget, check=False)  # warm-up
                pager.insert(new_keys[calls], check=False)
            calls_s: dict[str, dict[str, list[float]]] = {name: {"select": [], "insert": []} for name in LABELS}
            for i, q in enumerate(queries):
                for name, pager in pagers.items():
                    calls_s[name]["select"].append(timed(pager.select_arrays, q, budget))
                    calls_s[name]["insert"].append(timed(pager.insert, new_keys[i]))
            for name in LABELS:
                sel, ins = calls_s[name]["select"], calls_s[name]["insert"]
                step[name].append(statistics.median(a + b for a, b in zip(sel, ins)))
                parts[name]["select"].append(statistics.median(sel))
                parts[name]["insert"].append(statistics.median(ins))
    finally:
        torch.set_num_threads(threads)
    return {
        "crossover_keys": crossover_from_times(grid, step["exhaustive"], step["tree"]),
        "grid": list(grid), "exhaustive_s": step["exhaustive"], "tree_s": step["tree"],
        "select_s": {name: parts[name]["select"] for name in LABELS},
        "insert_s": {name: parts[name]["insert"] for name in LABELS},
        "calls": calls, "cold": cold, "select_threads": select_threads, "seconds": round(time.perf_counter() - t_start, 2),
    }
