"""A tried and dropped exact scorer (2026-12-03): a bounded two-pass top-k over split keys. Kept here as the
record of `README.md`; the runtime does not use it (`icecache.indexes.exact` scans float32 keys).

Every key ``k`` ``[d]`` float32 is stored split in two ``uint16`` rows: ``hi``, its upper 16 bits (a bfloat16,
truncated toward zero), and ``lo``, its lower 16 bits; and its norm ``||k||``. A select of the top ``k`` keys by
``max_r q_r . key`` over the query group ``q`` ``[g, d]``:

1. scores every key from ``hi`` alone (``approx``): half the bytes of a float32 scan, which is memory-bound;
2. bounds the error: truncation changes each coordinate by less than ``2^-7 |k_i|``, so
   ``|score - approx| <= 2^-7 ||q|| ||k||`` (Cauchy-Schwarz), plus float32 rounding of both dot products and of
   the bounds themselves, covered with a wide margin by ``2^-12 ||q|| ||k||``: ``e = BOUND ||q|| ||k||``;
3. ``L`` = the k-th largest lower bound ``approx - e``; the candidates are the keys whose upper bound
   ``approx + e`` reaches ``L``. At least k keys score ``>= L``; every other key scores strictly below it, so
   the candidates hold the exact top k, ties included;
4. scores the candidates exactly (``hi`` and ``lo`` joined give the float32 key back, bit for bit) and takes
   their top k, best first, ties by position.

The result (positions and float scores) is what scoring every key exactly gives: the same function
(`_exact_score`) scores a key wherever it runs, on any thread. Small selections (``n <= SMALL_FACTOR * k`` or
fewer than `MIN_BOUNDED_KEYS` keys) skip the bound and score every key exactly.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from icecache.indexes.exact import _kth_largest, top_of_scores

FASTMATH = {"reassoc", "contract"}
#: relative error bound of a truncated-bfloat16 dot product: 2^-7 (truncation) + 2^-12 (float32 rounding margin)
BOUND = 2.0**-7 + 2.0**-12
#: query rows scored per pass over a key (four accumulators; a group is padded with copies of its first row)
ROWS = 4
#: score every key exactly when there are at most this many keys per selected one ...
SMALL_FACTOR = 2
#: ... or fewer keys than this (the bounded pass would not pay)
MIN_BOUNDED_KEYS = 1024
#: fewest keys per thread for which a parallel scan pays for waking the other threads (measured ~20 us)
MIN_KEYS_PER_THREAD = 2048
#: smallest norm a key is bounded with: keeps the bound above the absolute error of subnormal coordinates
MIN_NORM = 2.0**-100


@njit(nogil=True, cache=False)
def split_into(keys: np.ndarray, hi: np.ndarray, lo: np.ndarray, norms: np.ndarray, start: int) -> None:
    """Write ``keys`` ``[m, d]`` float32 split into rows ``start .. start + m - 1`` of ``hi`` / ``lo`` (upper / lower
    16 bits of every float, ``uint16``) and ``norms`` (``||k||`` float32, rounded up, at least `MIN_NORM`)."""
    bits = keys.view(np.uint32)
    for r in range(keys.shape[0]):
        sq = 0.0
        for i in range(keys.shape[1]):
            hi[start + r, i] = np.uint16(bits[r, i] >> np.uint32(16))
            lo[start + r, i] = np.uint16(bits[r, i] & np.uint32(0xFFFF))
            sq += np.float64(keys[r, i]) * np.float64(keys[r, i])
        norms[start + r] = np.float32(max(np.sqrt(sq) * (1.0 + 2.0**-20), MIN_NORM))


def pad_queries(queries: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Query groups ``[..., g, d]`` padded to a multiple of `ROWS` rows with copies of their first row (the max
    over the rows is unchanged), float32 contiguous; and each group's ``BOUND * max_r ||q_r||`` (``[...]``
    float32, rounded up) for the error bound."""
    q = np.ascontiguousarray(queries, dtype=np.float32)
    g = q.shape[-2]
    extra = -g % ROWS
    if extra:
        first = np.repeat(q[..., :1, :], extra, axis=-2)
        q = np.ascontiguousarray(np.concatenate([q, first], axis=-2))
    qnorm = np.sqrt((q.astype(np.float64) ** 2).sum(-1)).max(-1, initial=0.0)
    return q, (BOUND * qnorm * (1.0 + 2.0**-20)).astype(np.float32)


@njit(nogil=True, cache=False, fastmath=FASTMATH, inline="always")
def _rows_max(qpad: np.ndarray, row: np.ndarray) -> np.float32:
    """``max_r qpad[r] . row`` (``qpad`` ``[4m, d]``): each key read once per four query rows."""
    d = row.shape[0]
    best = np.float32(-np.inf)
    for b in range(0, qpad.shape[0], ROWS):
        s0 = np.float32(0.0)
        s1 = np.float32(0.0)
        s2 = np.float32(0.0)
        s3 = np.float32(0.0)
        for i in range(d):
            x = row[i]
            s0 += qpad[b, i] * x
            s1 += qpad[b + 1, i] * x
            s2 += qpad[b + 2, i] * x
            s3 += qpad[b + 3, i] * x
        best = max(best, max(max(s0, s1), max(s2, s3)))
    return best


@njit(nogil=True, cache=False, fastmath=FASTMATH, inline="always")
def _exact_score(qpad: np.ndarray, hi: np.ndarray, lo: np.ndarray, j: int, bits: np.ndarray) -> np.float32:
    """The float32 score of key ``j`` (its two halves joined in ``bits`` ``[d]`` uint32 scratch)."""
    for i in range(hi.shape[1]):
        bits[i] = (np.uint32(hi[j, i]) << np.uint32(16)) | np.uint32(lo[j, i])
    return _rows_max(qpad, bits.view(np.float32))


@njit(nogil=True, cache=False, fastmath=FASTMATH, inline="always")
def _scan(qpad: np.ndarray, hi: np.ndarray, lo: np.ndarray, start: int, stop: int, exact: bool,
          out: np.ndarray) -> None:
    """``out[j]`` for ``j`` in ``[start, stop)``: the exact score, or (``exact`` False) the score of ``hi``."""
    d = hi.shape[1]
    bits = np.empty(d, np.uint32)
    if exact:
        for j in range(start, stop):
            out[j] = _exact_score(qpad, hi, lo, j, bits)
        return
    approx = bits.view(np.float32)
    for j in range(start, stop):
        for i in range(d):
            bits[i] = np.uint32(hi[j, i]) << np.uint32(16)
        out[j] = _rows_max(qpad, approx)


@njit(nogil=True, cache=False, fastmath=FASTMATH)
def exact_scores(qpad: np.ndarray, hi: np.ndarray, lo: np.ndarray, n: int) -> np.ndarray:
    """The float32 score ``[n]`` of each of the first ``n`` split keys, exactly as a select computes it (the
    reference of the tests)."""
    out = np.empty(n, np.float32)
    _scan(qpad, hi, lo, 0, n, True, out)
    return out


@njit(nogil=True, cache=False, inline="always")
def scores_exactly(n: int, budget: int) -> bool:
    """Whether a select of ``budget`` of ``n`` keys scores every key exactly (no bounded pass)."""
    return n <= SMALL_FACTOR * budget or n < MIN_BOUNDED_KEYS


@njit(nogil=True, cache=False, fastmath=FASTMATH, inline="always")
def _finish(qpad: np.ndarray, bound: np.float32, hi: np.ndarray, lo: np.ndarray, norms: np.ndarray, n: int,
            budget: int, scores: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Top ``min(budget, n)`` from ``scores[:n]``: exact scores when `scores_exactly`, else the ``hi`` scores,
    bounded and refined as in the module docstring."""
    if scores_exactly(n, budget):
        return top_of_scores(scores[:n], budget)
    lower = np.empty(n, np.float32)
    for j in range(n):
        lower[j] = scores[j] - bound * norms[j]
    cut = _kth_largest(lower, budget)
    count = 0
    for j in range(n):
        if scores[j] + bound * norms[j] >= cut:
            count += 1
    cand = np.empty(count, np.int64)
    c = 0
    for j in range(n):
        if scores[j] + bound * norms[j] >= cut:
            cand[c] = j
            c += 1
    bits = np.empty(hi.shape[1], np.uint32)
    exact = np.empty(count, np.float32)
    for c in range(count):
        exact[c] = _exact_score(qpad, hi, lo, cand[c], bits)
    at, vals = top_of_scores(exact, budget)
    pos = np.empty(at.shape[0], np.int64)
    for t in range(at.shape[0]):
        pos[t] = cand[at[t]]
    return pos, vals


@njit(nogil=True, cache=False, fastmath=FASTMATH)
def head_top_serial(qpad: np.ndarray, bound: np.float32, hi: np.ndarray, lo: np.ndarray, norms: np.ndarray, n: int,
                    budget: int) -> tuple[np.ndarray, np.ndarray]:
    """`head_top` on one thread."""
    scores = np.empty(n, np.float32)
    _scan(qpad, hi, lo, 0, n, scores_exactly(n, budget), scores)
    return _finish(qpad, bound, hi, lo, norms, n, budget, scores)


@njit(nogil=True, cache=False, fastmath=FASTMATH, parallel=True)
def head_top_parallel(qpad: np.ndarray, bound: np.float32, hi: np.ndarray, lo: np.ndarray, norms: np.ndarray, n: int,
                      budget: int, chunks: int) -> tuple[np.ndarray, np.ndarray]:
    """`head_top` with the scan split in ``chunks`` contiguous ranges over numba's threads."""
    scores = np.empty(n, np.float32)
    exact = scores_exactly(n, budget)
    for c in prange(chunks):
        _scan(qpad, hi, lo, c * n // chunks, (c + 1) * n // chunks, exact, scores)
    return _finish(qpad, bound, hi, lo, norms, n, budget, scores)


def head_top(qpad: np.ndarray, bound: np.float32, hi: np.ndarray, lo: np.ndarray, norms: np.ndarray, n: int,
             budget: int, threads: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """The ``min(budget, n)`` best of the first ``n`` split keys (``hi``, ``lo`` ``[>= n, d]`` uint16, ``norms``
    ``[>= n]``) for a padded query group (`pad_queries`), best first, ties by position: ``(positions int64,
    scores float32)``, on up to ``threads`` threads (fewer when ``n`` is small); the result does not depend on
    them."""
    if n <= 0 or budget <= 0:
        return np.empty(0, np.int64), np.empty(0, np.float32)
    chunks = max(1, min(threads, n // MIN_KEYS_PER_THREAD))
    if chunks > 1:
        return head_top_parallel(qpad, bound, hi, lo, norms, n, budget, chunks)
    return head_top_serial(qpad, bound, hi, lo, norms, n, budget)


@njit(nogil=True, cache=False, fastmath=FASTMATH, parallel=True)
def _layer_top_parallel(qpad: np.ndarray, bounds: np.ndarray, his: tuple, los: tuple, norms: tuple, n: int, budget: int,
                        chunks: int) -> np.ndarray:
    """`layer_top` on numba's threads: the scans of every (head, chunk) first, then each head's top k."""
    heads = qpad.shape[0]
    scores = np.empty((heads, n), np.float32)
    exact = scores_exactly(n, budget)
    for t in prange(heads * chunks):
        h, c = t // chunks, t % chunks
        _scan(qpad[h], his[h], los[h], c * n // chunks, (c + 1) * n // chunks, exact, scores[h])
    out = np.empty((heads, min(budget, n)), np.int64)
    for h in prange(heads):
        out[h] = _finish(qpad[h], bounds[h], his[h], los[h], norms[h], n, budget, scores[h])[0]
    return out


@njit(nogil=True, cache=False, fastmath=FASTMATH)
def _layer_top_serial(qpad: np.ndarray, bounds: np.ndarray, his: tuple, los: tuple, norms: tuple, n: int,
                      budget: int) -> np.ndarray:
    heads = qpad.shape[0]
    scores = np.empty(n, np.float32)
    exact = scores_exactly(n, budget)
    out = np.empty((heads, min(budget, n)), np.int64)
    for h in range(heads):
        _scan(qpad[h], his[h], los[h], 0, n, exact, scores)
        out[h] = _finish(qpad[h], bounds[h], his[h], los[h], norms[h], n, budget, scores)[0]
    return out


def layer_top(qpad: np.ndarray, bounds: np.ndarray, his: tuple, los: tuple, norms: tuple, n: int, budget: int,
              threads: int = 1) -> np.ndarray:
    """`head_top` for every KV head of a layer in one compiled call: ``qpad`` ``[H, 4m, d]`` (`pad_queries` of
    ``[H, g, d]``, with its ``bounds`` ``[H]``), one split-key triple per head
    (the first ``n`` rows live). Returns positions ``[H, min(budget, n)]`` int64, each row best first, ties by
    position: the same as `head_top` head by head."""
    chunks = max(1, min(threads, n // MIN_KEYS_PER_THREAD))
    if threads > 1 and len(his) * n >= 2 * MIN_KEYS_PER_THREAD:  # enough work for a second thread
        return _layer_top_parallel(qpad, bounds, his, los, norms, n, budget, chunks)
    return _layer_top_serial(qpad, bounds, his, los, norms, n, budget)
