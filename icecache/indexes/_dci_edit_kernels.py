"""Compiled kernels that edit a DCI tree (`icecache.indexes.dci_build`, `icecache.indexes.dci_update`): parent
assignment for a build, MD's level schedule, sorted-run inserts and removals, the brute-force parent searches of
decode inserts, adoption scans, 2-means orders and the nearest page of a point.

The storage names and distance modes are those of `icecache.indexes._dci_kernels` (the search kernels), whose
`descend` the parent assignment runs. Everything here is ``@njit(nogil=True, cache=True)``, with no numba threads.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from icecache.indexes._dci_kernels import FASTMATH, descend, sqdist

_INF = np.inf


@njit(nogil=True, cache=True)
def assign_parents(
    nodes, X, Xr, ext, proj, mode, msq, run_key, run_id, cl_start, cl_size, sub,
    top_level, stop_level, L, m, F,
    num_to_visit, prop_to_visit, num_to_retrieve, prop_to_retrieve,
    cnt, cnt_stamp, cand_stamp, eval_stamp, dist, stamp, pool_ids, gsc, out_parent, out_dist,
):
    """Parent search (k = 1, construction config) for every id in ``nodes``: the nearest node of
    ``stop_level`` found by the descent over the levels above, with ``mode`` 0 (Euclidean) or 2
    (key-key). Ties go to the lower id. Writes ``out_parent``/``out_dist`` (``-1``/inf if none found)."""
    M = proj.shape[1]
    Q = np.empty((1, X.shape[1]), np.float32)
    QP = np.empty((1, M), np.float64)
    qext = np.empty(1, np.float32)
    for i in range(nodes.shape[0]):
        t = nodes[i]
        Q[0] = X[t]
        for j in range(M):
            QP[0, j] = proj[t, j]
        qext[0] = ext[t]
        lo, hi = descend(
            Q, QP, qext, mode, msq, X, Xr, ext, run_key, run_id, cl_start, cl_size, sub,
            top_level, stop_level, L, m, F, 1, 0, False,
            num_to_visit, prop_to_visit, num_to_retrieve, prop_to_retrieve,
            cnt, cnt_stamp, cand_stamp, eval_stamp, dist, stamp, pool_ids, gsc, False, False,
        )
        best = -1
        bd = _INF
        for a in range(lo, hi):
            u = pool_ids[a]
            du = dist[a]
            if du < bd or (du == bd and u < best):
                bd = du
                best = u
        out_parent[i] = best
        out_dist[i] = bd


@njit(nogil=True, cache=True)
def md_schedule(n, counts, nxt, p0, p1, cap0, cap1, out_level, out_new_top):
    """Run the MD deterministic level schedule (docs/index.md, promotion schedule) for ``n`` more points.

    ``counts`` ``[64]`` (points per level; the number of levels is the count of leading non-zero
    entries, passed as ``counts[63]``) and ``nxt`` ``[1]`` are updated in place. ``cap0``/``cap1`` =
    ceil(1/p0), ceil(1/p1): the top level's size cap. Writes each point's level and whether it opened a
    new top level."""
    for i in range(n):
        t = nxt[0]
        h = counts[63]
        if t == h:
            counts[t] = 1
            counts[63] = h + 1
            nxt[0] = 0
            out_level[i] = t
            out_new_top[i] = True
            continue
        counts[t] += 1
        out_level[i] = t
        out_new_top[i] = False
        if t == h - 1:
            cap = cap0 if t == 0 else cap1
            nxt[0] = t + 1 if counts[t] == cap else 0
        else:
            p = p0 if t == 0 else p1
            nxt[0] = t + 1 if counts[t] >= counts[t + 1] / p else 0


@njit(nogil=True, cache=True)
def cluster_insert(run_key, run_id, Xr, start, size, keys, tid, x):
    """Insert token ``tid`` (key row ``x`` ``[d]``, projections ``keys`` ``[M]``) into the cluster block at
    ``start`` (holding ``size`` members, capacity > size) keeping every run sorted by (key, id) and ``Xr``
    in run-0 order. Returns its run-0 position."""
    pos0 = 0
    for j in range(run_key.shape[0]):
        kv = keys[j]
        lo = 0
        hi = size
        while lo < hi:
            mid = (lo + hi) >> 1
            km = run_key[j, start + mid]
            if km < kv or (km == kv and run_id[j, start + mid] < tid):
                lo = mid + 1
            else:
                hi = mid
        for a in range(size, lo, -1):
            run_key[j, start + a] = run_key[j, start + a - 1]
            run_id[j, start + a] = run_id[j, start + a - 1]
        run_key[j, start + lo] = kv
        run_id[j, start + lo] = tid
        if j == 0:
            pos0 = lo
            for a in range(size, lo, -1):
                Xr[start + a] = Xr[start + a - 1]
            Xr[start + lo] = x
    return pos0


@njit(nogil=True, cache=True)
def cluster_remove(run_key, run_id, Xr, start, size, tid):
    """Remove token ``tid`` from every run of the cluster block at ``start`` (``size`` members), and its
    row from ``Xr``."""
    for j in range(run_key.shape[0]):
        a = 0
        while a < size and run_id[j, start + a] != tid:
            a += 1
        if a == size:
            raise RuntimeError("cluster_remove: token not in cluster (internal bug)")
        for b in range(a, size - 1):
            run_key[j, start + b] = run_key[j, start + b + 1]
            run_id[j, start + b] = run_id[j, start + b + 1]
        if j == 0:
            for b in range(a, size - 1):
                Xr[start + b] = Xr[start + b + 1]


@njit(nogil=True, cache=True, fastmath=FASTMATH, inline="always")
def mips_distance(X, x, Y, row, ext_x, ext_row, msq):
    """Lifted MIPS distance ``msq - <X[x], Y[row]> - ext_x ext_row`` in float64, clamped at 0 (docs/index.md,
    MIPS to L2 transform). One definition, inlined, for every brute-force scan, so that a scan over scattered
    rows and one over a packed copy of them make the same sums in the same order."""
    s = 0.0
    for a in range(X.shape[1]):
        s += np.float64(X[x, a]) * np.float64(Y[row, a])
    s = msq - s - np.float64(ext_x) * np.float64(ext_row)
    if s < 0.0:
        s = 0.0
    return s


@njit(nogil=True, cache=True, fastmath=FASTMATH, inline="always")
def _rows_sqdist(X, x, y) -> float:
    """Squared Euclidean distance of rows ``x`` and ``y`` of ``X``, summed in float64."""
    s = 0.0
    for a in range(X.shape[1]):
        t = np.float64(X[x, a]) - np.float64(X[y, a])
        s += t * t
    return s


@njit(nogil=True, cache=True, fastmath=FASTMATH)  # vectorised sums: 25 -> 3 us per insert at 8k
def brute_nearest_one(x, up, X, ext, mode, msq):
    """Exact nearest node of ``up`` to point ``x`` (ties -> first in ``up``): ``(id, distance)``."""
    best = -1
    bd = np.inf
    for i in range(up.shape[0]):
        u = up[i]
        s = _rows_sqdist(X, x, u) if mode == 0 else mips_distance(X, x, X, u, ext[x], ext[u], msq)
        if s < bd:
            bd = s
            best = u
    if mode == 0:
        bd = np.sqrt(bd)
    return best, bd


@njit(nogil=True, cache=True, fastmath=FASTMATH)
def brute_nearest_packed(x, up, UX, uext, X, ext, msq):
    """`brute_nearest_one` in MIPS mode over nodes whose keys ``UX`` ``[m, d]`` and lifts ``uext`` ``[m]`` are
    packed in ``up``'s order (`DCITree.level1_packed`): the same sums (`mips_distance`), read from contiguous
    rows instead of one scattered row per node (a decode insert reads them from cold caches)."""
    best = -1
    bd = np.inf
    for i in range(up.shape[0]):
        s = mips_distance(X, x, UX, i, ext[x], uext[i], msq)
        if s < bd:
            bd = s
            best = up[i]
    return best, bd


@njit(nogil=True, cache=True, fastmath=FASTMATH)  # vectorised sums: 25 -> 3 us per insert at 8k
def adopt_scan(x, ys, X, ext, pdist, mode, msq, margin):
    """Mask over ``ys``: the point is closer to ``x`` than to its parent by more than ``margin``."""
    out = np.zeros(ys.shape[0], np.bool_)
    for i in range(ys.shape[0]):
        y = ys[i]
        if mode == 0:
            s = np.sqrt(_rows_sqdist(X, x, y))
        else:
            s = 0.0
            for a in range(X.shape[1]):
                s += np.float64(X[x, a]) * np.float64(X[y, a])
            s = msq - s - np.float64(ext[x]) * np.float64(ext[y])
            if s < 0.0:
                s = 0.0
        out[i] = s < pdist[y] - margin
    return out


@njit(nogil=True, cache=True)
def _two_means_order(X, ids, a, b, cut, iters):
    """Reorder ``ids[a:b]`` so that ``ids[a:cut]`` / ``ids[cut:b]`` are the two sides of a balanced 2-means
    split (deterministic: farthest-pair start, ``iters`` steps, stable ordering by the side score)."""
    c = b - a
    d = X.shape[1]
    c0 = np.empty(d)
    c1 = np.empty(d)
    # Farthest-pair start: the point farthest from the first one, then the point farthest from that.
    best, i1 = -1.0, a
    for i in range(a, b):
        v = sqdist(X[ids[i]], X[ids[a]])
        if v > best:
            best, i1 = v, i
    best, i2 = -1.0, a
    for i in range(a, b):
        v = sqdist(X[ids[i]], X[ids[i1]])
        if v > best:
            best, i2 = v, i
    for j in range(d):
        c0[j] = X[ids[i1], j]
        c1[j] = X[ids[i2], j]
    score = np.empty(c)
    seg = ids[a:b].copy()
    for it in range(iters + 1):
        for i in range(c):
            s = 0.0
            for j in range(d):
                s += np.float64(X[seg[i], j]) * (c1[j] - c0[j])
            score[i] = s
        order = np.argsort(score, kind="mergesort")
        if it == iters:
            for i in range(c):
                ids[a + i] = seg[order[i]]
            return
        c0[:] = 0.0
        c1[:] = 0.0
        for i in range(c):
            t = seg[order[i]]
            if a + i < cut:
                for j in range(d):
                    c0[j] += X[t, j]
            else:
                for j in range(d):
                    c1[j] += X[t, j]
        n0 = cut - a
        n1 = c - n0
        for j in range(d):
            c0[j] /= max(n0, 1)
            c1[j] /= max(n1, 1)


@njit(nogil=True, cache=True)
def kway_order(X, ids, k, iters):
    """Reorder ``ids`` ``[c]`` so that the ``k`` contiguous groups with boundaries ``floor(i c / k)`` are
    tight: recursive balanced 2-means bisection (a segment of groups ``[g0, g1)`` is cut at group
    ``(g0 + g1) // 2``). Group sizes are those of the even split, so they differ by at most one."""
    c = ids.shape[0]
    if k <= 1 or c <= 1:
        return
    stack = np.empty((2 * k + 2, 2), np.int64)
    stack[0, 0] = 0
    stack[0, 1] = k
    top = 1
    while top > 0:
        top -= 1
        g0 = stack[top, 0]
        g1 = stack[top, 1]
        if g1 - g0 <= 1:
            continue
        gm = (g0 + g1) // 2
        a = (g0 * c) // k
        b = (g1 * c) // k
        cut = (gm * c) // k
        if b - a >= 2:
            _two_means_order(X, ids, a, b, cut, iters)
        stack[top, 0] = g0
        stack[top, 1] = gm
        stack[top + 1, 0] = gm
        stack[top + 1, 1] = g1
        top += 2


@njit(nogil=True, cache=True)
def nearest_page(x, members, page_of, X):
    """Page (among those holding ``members``) whose centroid is nearest to point ``x``; ties -> lower id."""
    c = members.shape[0]
    d = X.shape[1]
    pages = np.empty(c, np.int64)
    npg = 0
    for i in range(c):
        p = page_of[members[i]]
        seen = False
        for j in range(npg):
            if pages[j] == p:
                seen = True
                break
        if not seen:
            pages[npg] = p
            npg += 1
    sums = np.zeros((npg, d))
    cnt = np.zeros(npg)
    for i in range(c):
        t = members[i]
        p = page_of[t]
        for j in range(npg):
            if pages[j] == p:
                for a in range(d):
                    sums[j, a] += X[t, a]
                cnt[j] += 1.0
                break
    best, bp = np.inf, -1
    for j in range(npg):
        s = 0.0
        for a in range(d):
            v = np.float64(X[x, a]) - sums[j, a] / cnt[j]
            s += v * v
        if s < best or (s == best and pages[j] < bp):
            best, bp = s, pages[j]
    return bp
