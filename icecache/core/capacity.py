"""`grown_capacity`: the one growth policy of every append-only buffer (pager key buffers, page tables, the
DCI tree, host K/V stores).

Doubling keeps appends amortised O(1). A bulk fill (a prefill build into an empty or small buffer) also gets a
quarter spare, so that the first decode inserts do not reallocate every buffer of every head at once. Before
this policy each buffer was built exactly full: on SmolLM2 at 8k tokens with M-DCI, 84 of the 90 host stores
doubled within the first 31 decode steps, each a fresh 16 MB zero-fill (~30 ms of page faults on the insert
worker) that the next layer waited for (`experiments/bench_runtime/README.md`, question 4).
"""

from __future__ import annotations

#: a bulk fill allocates ``needed * (1 + 1 / SPARE_DIVISOR)`` rows
SPARE_DIVISOR = 4


def grown_capacity(needed: int, current: int, minimum: int = 64) -> int:
    """Rows to allocate when ``needed`` rows do not fit in ``current`` rows: the largest of twice ``current``,
    ``needed`` plus a quarter spare, and ``minimum``."""
    if needed < 0 or current < 0:
        raise ValueError(f"capacities are >= 0 (needed={needed}, current={current})")
    return max(needed + needed // SPARE_DIVISOR, 2 * current, minimum)


__all__ = ["SPARE_DIVISOR", "grown_capacity"]
