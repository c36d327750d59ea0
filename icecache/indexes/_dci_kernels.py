"""Compiled kernels of the DCI index's searches (`icecache.indexes.dci`): distances, the prioritized
single-cluster search, the multi-level descent and page ranking. The kernels that edit a tree (parent assignment,
the level schedule, sorted-run edits, parent searches of inserts) are in `icecache.indexes._dci_edit_kernels`.

Everything here is ``@njit(nogil=True, cache=True)``: a search releases the GIL, so a thread pool runs
many heads in parallel, and the machine code is compiled once and cached on disk. No kernel here uses numba's
own threads (``prange``); `icecache.indexes.dci_layer` runs `rank_pages` for several trees on them, one scratch
set per tree, so results never depend on thread count or timing.

Storage the kernels read (owned by `icecache.indexes.dci_tree.DCITree`, whose attribute names its docstring maps to
these; the names used throughout):

    X         [cap, d]     float32  raw vectors (keys), row = token id
    ext       [cap]        float32  MIPS extra coordinate sqrt(max(msq - |x|^2, 0)); zeros in Euclidean mode
    run_key   [M, S]       float32  slab of sorted runs: the projections of a cluster's members on direction j
    run_id    [M, S]       int32    token id of each run entry
    Xr        [S, d]       float32  the keys again, in run-0 slab order: Xr[p] = X[run_id[0, p]] at every live
                                    run position p (a cluster search that takes a stretch of run 0 streams it)
    cl_start  [cap + 1]    int64    cluster c = node c - 1 (c = 0 is the virtual root) starts at run position
    cl_size   [cap + 1]    int64    cl_start[c] and holds cl_size[c] members, sorted by (key, id) in every run
    sub       [cap]        int64    number of descendants of each node (coverage rule)

Distance modes (ascending = better): 0 Euclidean ``min_g |x - q_g|``; 1 MIPS ``-max_g <q_g, x>``;
2 key-key (MIPS construction) ``min_g max(msq - <q_g, x> - qext_g ext_x, 0)``, half the squared distance
between scaled-form transformed keys (docs/index.md, MIPS to L2 transform).

Scratch (one set per thread, see `icecache.indexes.dci_search.thread_scratch`): stamp-tagged arrays so that no
``O(n)`` clearing is needed per query. ``stamp[0]`` is a counter that only grows. A search's results are
pool-ordered: ``pool_ids[i]`` is the i-th evaluated token, ``dist[i]`` its distance and ``gsc[i, g]`` its
``<q_g, x>`` (MIPS), so a descent writes them sequentially instead of at scattered token ids.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

_INF = np.inf
FASTMATH = {"reassoc", "contract"}  # vectorisable dot products; no "ninf": the kernels rely on inf priorities


@njit(nogil=True, cache=True, fastmath=FASTMATH)
def _dot(a, b) -> float:
    s = 0.0
    for i in range(a.shape[0]):
        s += np.float64(a[i]) * np.float64(b[i])
    return s


@njit(nogil=True, cache=True, fastmath=FASTMATH)
def sqdist(a, b) -> float:
    s = 0.0
    for i in range(a.shape[0]):
        t = np.float64(a[i]) - np.float64(b[i])
        s += t * t
    return s


@njit(nogil=True, cache=True, fastmath=FASTMATH)
def _row_dot(A, r, Q, g) -> float:
    """``<A[r], Q[g]>`` in float64. Rows are passed as (array, index), never as slices: a slice handed to
    a compiled call costs two atomic reference-count updates, as much as the dot product itself."""
    s = 0.0
    for i in range(A.shape[1]):
        s += np.float64(A[r, i]) * np.float64(Q[g, i])
    return s


@njit(nogil=True, cache=True, fastmath=FASTMATH)
def _row_sqdist(A, r, Q, g) -> float:
    """``|A[r] - Q[g]|^2`` in float64."""
    s = 0.0
    for i in range(A.shape[1]):
        t = np.float64(A[r, i]) - np.float64(Q[g, i])
        s += t * t
    return s


@njit(nogil=True, cache=True, fastmath=FASTMATH, inline="always")
def _group_dots(A, r, Q, gsc, row, store_g) -> float:
    """``max_g <q_g, A[r]>`` over the rows of ``Q`` ``[g, d]``; with ``store_g`` each ``<q_g, A[r]>`` goes
    to ``gsc[row, g]``."""
    best = -_INF
    for g in range(Q.shape[0]):
        v = 0.0
        for i in range(A.shape[1]):
            v += np.float64(A[r, i]) * np.float64(Q[g, i])
        if store_g:
            gsc[row, g] = v
        if v > best:
            best = v
    return best


@njit(nogil=True, cache=True, inline="always")
def query_distance(A, r, t, Q, g, qext, mode, msq, ext) -> float:
    """Distance (ascending = closer) of token ``t``, whose key is row ``r`` of ``A`` (``X`` by id or
    ``Xr`` by run position), to query ``g`` of ``Q`` in ``mode`` (``ext[t]`` is read in mode 2 only)."""
    if mode == 0:
        return math.sqrt(_row_sqdist(A, r, Q, g))
    if mode == 1:
        return -_row_dot(A, r, Q, g)
    v = msq - _row_dot(A, r, Q, g) - np.float64(qext[g]) * np.float64(ext[t])
    return v if v > 0.0 else 0.0


@njit(nogil=True, cache=True, inline="always")
def point_distance(A, r, t, Q, qext, mode, msq, ext) -> float:
    """Distance of token ``t`` (key ``A[r]``) to the query group ``Q`` ``[g, d]``: the minimum over it."""
    best = _INF
    for g in range(Q.shape[0]):
        v = query_distance(A, r, t, Q, g, qext, mode, msq, ext)
        if v < best:
            best = v
    return best


@njit(nogil=True, cache=True, inline="always")
def evaluate(A, r, t, Q, qext, mode, msq, ext, gsc, row, store_g) -> float:
    """`point_distance`; in MIPS mode with ``store_g`` also keep every query's ``<q_g, x>`` in
    ``gsc[row]`` (``row`` = the token's pool slot)."""
    if mode == 1:
        return -_group_dots(A, r, Q, gsc, row, store_g)
    return point_distance(A, r, t, Q, qext, mode, msq, ext)


@njit(nogil=True, cache=True, fastmath=FASTMATH)
def query_projections(Q, dirs, c, mips):
    """Projections ``[g, M]`` float64 of the queries ``Q`` ``[g, d]`` on ``dirs[:, :d]``; with ``mips`` of
    ``c q / |q|`` (a zero query projects to 0). See `icecache.indexes.dci_tree.DCITree.query_proj`."""
    G, d = Q.shape
    M = dirs.shape[0]
    out = np.empty((G, M), np.float64)
    for a in range(G):
        sc = 1.0
        if mips:
            nrm = 0.0
            for i in range(d):
                nrm += np.float64(Q[a, i]) * np.float64(Q[a, i])
            nrm = math.sqrt(nrm)
            sc = c / nrm if nrm > 0.0 else 0.0
        for j in range(M):
            v = 0.0
            for i in range(d):
                v += np.float64(Q[a, i]) * dirs[j, i]
            out[a, j] = v * sc
    return out


@njit(nogil=True, cache=True, inline="always")
def _choose(j, start, c, qp, run_key, lcur, rcur, cur, prio):
    """Offer the next element of simple index ``j``: the closer of the two cursor neighbours (ties left)."""
    have_l = lcur[j] >= 0
    have_r = rcur[j] < c
    if not have_l and not have_r:
        cur[j] = -1
        prio[j] = _INF
        return
    gl = abs(qp - np.float64(run_key[j, start + lcur[j]])) if have_l else _INF
    gr = abs(np.float64(run_key[j, start + rcur[j]]) - qp) if have_r else _INF
    if gr < gl:
        cur[j] = rcur[j]
        rcur[j] += 1
        prio[j] = gr
    else:
        cur[j] = lcur[j]
        lcur[j] -= 1
        prio[j] = gl


@njit(nogil=True, cache=True, inline="always")
def _takes_all(c, kk, m, num_to_visit, prop_to_visit, num_to_retrieve, prop_to_retrieve) -> bool:
    """True when a search of a ``c``-member cluster would end only with every member a candidate (k >= c,
    or both limits reach the whole cluster): then every member is scored, in run-0 order."""
    if kk >= c:
        return True
    visit_limit = max(num_to_visit * m, int(math.ceil(prop_to_visit * c * m)) if prop_to_visit >= 0 else -1)
    retrieve_limit = max(num_to_retrieve, int(math.ceil(prop_to_retrieve * c)) if prop_to_retrieve >= 0 else -1)
    return retrieve_limit >= c and visit_limit >= c * m


@njit(nogil=True, cache=True, fastmath=FASTMATH)
def search_cluster(
    cidx, Q, QP, qext, mode, msq, X, Xr, ext, run_key, run_id, cl_start, cl_size,
    L, m, kk, num_to_visit, prop_to_visit, num_to_retrieve, prop_to_retrieve,
    cnt, cnt_stamp, cand_stamp, eval_stamp, dist, stamp, desc_stamp, pool_ids, pool_n, gsc, store_g,
    cover, sub,
):
    """Prioritized DCI (docs/index.md, Prioritized search inside one cluster) over the members of cluster
    ``cidx``, for every query of the group; every newly completed candidate is appended to ``pool_ids`` with
    its exact distance in ``dist`` (same slot; once per descent). Returns the new pool length.

    The caller (`descend`) scores a cluster whose search would take every member itself (`_takes_all`), so
    this handles partial searches only. The one-simple-index interval is scored from ``Xr`` (the keys in
    run-0 slab order): streaming reads instead of one scattered row per token. Clusters are disjoint (every
    point is in exactly one), so that path needs no per-token dedupe across clusters; the prioritized walk
    dedupes with ``eval_stamp``.

    ``kk`` is the k of the search (the stop test needs ``min(kk, c)`` candidates). The limits are relative
    to the cluster size ``c``; a negative ``num_*``/``prop_*`` disables its half of the max (the caller
    has already resolved the case where both halves are disabled). Coverage rule (docs/index.md, Query
    descent): the search does not stop before its candidates' descendants (``sub``) sum to ``cover`` (0
    disables it).
    """
    start = cl_start[cidx]
    c = cl_size[cidx]
    if c == 0:
        return pool_n
    visit_limit = max(num_to_visit * m, int(math.ceil(prop_to_visit * c * m)) if prop_to_visit >= 0 else -1)
    retrieve_limit = max(num_to_retrieve, int(math.ceil(prop_to_retrieve * c)) if prop_to_retrieve >= 0 else -1)
    M = L * m
    kk_eff = kk if kk < c else c
    if M == 1:
        # One simple index: every visited point is a candidate at once, so after r rounds the candidates
        # are the r points taken by the two-cursor rule, a contiguous interval of the run. The walk stops
        # after T = max(min(k, c), min(visit_limit, retrieve_limit)) rounds (capped at c): take T points.
        T = min(visit_limit, retrieve_limit)
        if T < kk_eff:
            T = kk_eff
        if T > c:
            T = c
        G = Q.shape[0]
        ivl = np.empty((G, 2), np.int64)  # every query's interval [lo, hi) of run 0
        for g in range(G):
            covered = 0
            qp = QP[g, 0]
            lo = 0
            hi = c
            while lo < hi:
                mid = (lo + hi) >> 1
                if np.float64(run_key[0, start + mid]) < qp:
                    lo = mid + 1
                else:
                    hi = mid
            left = lo - 1
            right = lo
            taken = 0
            while taken < c and (taken < T or covered < cover):
                if right >= c or (left >= 0 and not (abs(np.float64(run_key[0, start + right]) - qp) < abs(qp - np.float64(run_key[0, start + left])))):
                    covered += sub[run_id[0, start + left]]
                    left -= 1
                else:
                    covered += sub[run_id[0, start + right]]
                    right += 1
                taken += 1
            ivl[g, 0] = left + 1
            ivl[g, 1] = right
        # Score the union of the intervals once, in run order.
        order = np.argsort(ivl[:, 0])
        reach = 0
        for oi in range(G):
            a = ivl[order[oi], 0]
            b = ivl[order[oi], 1]
            if a < reach:
                a = reach
            for i in range(a, b):
                t = run_id[0, start + i]
                pool_ids[pool_n] = t
                dist[pool_n] = evaluate(Xr, start + i, t, Q, qext, mode, msq, ext, gsc, pool_n, store_g)
                pool_n += 1
            if b > reach:
                reach = b
        return pool_n
    lcur = np.empty(M, np.int64)
    rcur = np.empty(M, np.int64)
    cur = np.empty(M, np.int64)
    prio = np.empty(M, np.float64)
    for g in range(Q.shape[0]):
        stamp[0] += 1
        s = stamp[0]
        for j in range(M):
            qp = QP[g, j]
            lo = 0
            hi = c
            while lo < hi:  # number of keys strictly below qp
                mid = (lo + hi) >> 1
                if np.float64(run_key[j, start + mid]) < qp:
                    lo = mid + 1
                else:
                    hi = mid
            lcur[j] = lo - 1
            rcur[j] = lo
            _choose(j, start, c, qp, run_key, lcur, rcur, cur, prio)
        ncand = 0
        covered = 0
        for r in range(c * m):
            for comp in range(L):
                h = -1
                best = _INF
                for jj in range(m):
                    j = comp * m + jj
                    if prio[j] < best:
                        best = prio[j]
                        h = j
                if h < 0:
                    continue
                t = run_id[h, start + cur[h]]
                if cnt_stamp[t] != s:
                    cnt_stamp[t] = s
                    for cc in range(L):
                        cnt[t, cc] = 0
                cnt[t, comp] += 1
                if cnt[t, comp] == m and cand_stamp[t] != s:
                    cand_stamp[t] = s
                    ncand += 1
                    covered += sub[t]
                    if eval_stamp[t] != desc_stamp:
                        eval_stamp[t] = desc_stamp
                        pool_ids[pool_n] = t
                        dist[pool_n] = evaluate(X, t, t, Q, qext, mode, msq, ext, gsc, pool_n, store_g)
                        pool_n += 1
                _choose(h, start, c, QP[g, h], run_key, lcur, rcur, cur, prio)
            if ncand >= kk_eff and covered >= cover and (r + 1 >= visit_limit or ncand >= retrieve_limit):
                break
    return pool_n


@njit(nogil=True, cache=True, fastmath=FASTMATH)
def descend(
    Q, QP, qext, mode, msq, X, Xr, ext, run_key, run_id, cl_start, cl_size, sub,
    top_level, stop_level, L, m, F, kk, cover, cumulative,
    num_to_visit, prop_to_visit, num_to_retrieve, prop_to_retrieve,
    cnt, cnt_stamp, cand_stamp, eval_stamp, dist, stamp, pool_ids, gsc, store_g, per_query_beam,
):
    """Field-of-view beam descent from the root down to ``stop_level`` (docs/index.md, Query descent; disjoint
    levels). Level ``top_level`` is the root's cluster; at each level the clusters of the expanded nodes
    are searched (k = ``F`` above ``stop_level``, ``kk`` at it), all candidates are pooled, sorted, and the
    prefix ``max(min(F, pool), smallest prefix whose descendants sum to >= cover)`` is expanded next. For a
    group of queries with ``per_query_beam`` every query ranks the pool by its own distance and the union of
    the prefixes is expanded (so one query cannot crowd out the others); otherwise one beam ranked by the
    group distance (the minimum over the group) is kept.

    Returns ``(lo, hi)``: ``pool_ids[lo:hi]`` are the evaluated tokens (all levels when ``cumulative``,
    else only those of ``stop_level``), with distances in ``dist[lo:hi]`` (and, with ``store_g``, every
    query's ``<q_g, x>`` in ``gsc[lo:hi]``).
    """
    stamp[0] += 1
    desc_stamp = stamp[0]
    expand = np.empty(1, np.int64)
    expand[0] = -1
    nexp = 1
    pool_n = 0
    seg0 = 0
    for lev in range(top_level, stop_level - 1, -1):
        seg0 = pool_n
        k_here = kk if lev == stop_level else F
        cover_here = cover if lev != stop_level else 0
        for e in range(nexp):
            cidx = expand[e] + 1
            c = cl_size[cidx]
            if _takes_all(c, k_here, m, num_to_visit, prop_to_visit, num_to_retrieve, prop_to_retrieve):
                # Every member scored: done here, not in `search_cluster` (a call with ~35 array arguments
                # costs more than scoring a small cluster).
                start = cl_start[cidx]
                for i in range(c):
                    t = run_id[0, start + i]
                    pool_ids[pool_n] = t
                    dist[pool_n] = evaluate(Xr, start + i, t, Q, qext, mode, msq, ext, gsc, pool_n, store_g)
                    pool_n += 1
                continue
            pool_n = search_cluster(
                cidx, Q, QP, qext, mode, msq, X, Xr, ext, run_key, run_id, cl_start, cl_size,
                L, m, k_here, num_to_visit, prop_to_visit, num_to_retrieve, prop_to_retrieve,
                cnt, cnt_stamp, cand_stamp, eval_stamp, dist, stamp, desc_stamp, pool_ids, pool_n, gsc, store_g,
                cover_here, sub,
            )
        if lev == stop_level:
            break
        n_seg = pool_n - seg0
        if n_seg == 0:
            break
        # Each query of the group keeps its own beam (its F best nodes, extended by the coverage rule);
        # the union is expanded. With one query this is exactly the spec's rule.
        G = Q.shape[0] if per_query_beam else 1
        keep_f = F if F < n_seg else n_seg
        chosen = np.zeros(n_seg, np.bool_)
        seg_d = np.empty(n_seg, np.float64)
        for g in range(G):
            for i in range(n_seg):
                t = pool_ids[seg0 + i]
                if G == 1:
                    seg_d[i] = dist[seg0 + i]
                elif store_g:
                    seg_d[i] = -gsc[seg0 + i, g]
                else:
                    seg_d[i] = query_distance(X, t, t, Q, g, qext, mode, msq, ext)
            order = np.argsort(seg_d, kind="mergesort")
            covered = 0
            for i in range(n_seg):
                if i >= keep_f and covered >= cover:
                    break
                chosen[order[i]] = True
                covered += sub[pool_ids[seg0 + order[i]]]
        expand = np.empty(n_seg, np.int64)
        nexp = 0
        for i in range(n_seg):
            if chosen[i]:
                expand[nexp] = pool_ids[seg0 + i]
                nexp += 1
    if cumulative:
        return 0, pool_n
    return seg0, pool_n


@njit(nogil=True, cache=True)
def _page_before(p, q, page_best) -> bool:
    """Page ``p`` ranks before page ``q``: higher score, ties by smaller id."""
    return page_best[p] > page_best[q] or (page_best[p] == page_best[q] and p < q)


@njit(nogil=True, cache=True)
def _sift_down(heap, i, k, page_best) -> None:
    """Restore the heap ``heap[:k]`` below ``i``: every parent ranks before its children (`_page_before`)."""
    while True:
        w = i
        a = 2 * i + 1
        b = a + 1
        if a < k and _page_before(heap[a], heap[w], page_best):
            w = a
        if b < k and _page_before(heap[b], heap[w], page_best):
            w = b
        if w == i:
            return
        heap[i], heap[w] = heap[w], heap[i]
        i = w


@njit(nogil=True, cache=True)
def heapify_pages(heap, k, page_best) -> None:
    """Make ``heap[:k]`` a heap whose root is the best page (`_page_before`), in ``O(k)``."""
    for start in range(k // 2 - 1, -1, -1):
        _sift_down(heap, start, k, page_best)


@njit(nogil=True, cache=True)
def pop_best_page(heap, k, page_best) -> int:
    """Remove and return the best page of the heap ``heap[:k]`` (``k`` >= 1); ``heap[:k-1]`` stays a heap."""
    p = heap[0]
    heap[0] = heap[k - 1]
    _sift_down(heap, 0, k - 1, page_best)
    return p


@njit(nogil=True, cache=True)
def rank_pages(
    Q, QP, X, Xr, run_key, run_id, cl_start, cl_size, sub, top_level, L, m, F, kk, cover,
    num_to_visit, prop_to_visit, num_to_retrieve, prop_to_retrieve,
    cnt, cnt_stamp, cand_stamp, eval_stamp, dist, stamp, pool_ids, gsc, per_query_beam,
    page_of, page_sizes, budget, mass, scale, page_best, page_stamp, page_list, out_pages, out_scores,
):
    """One cumulative MIPS descent for a GQA group ``Q`` ``[g, d]``, then page ranking. A page's score is
    (``mass`` False) the best ``max_g <q_g, k>`` among its scored tokens, or (``mass`` True) its estimated
    attention mass ``sum over scored tokens t, queries g of exp(scale (<q_g, k_t> - M_g))`` with ``M_g``
    the best scored ``<q_g, k>``. Pages are ranked by score (descending, ties by id), followed by the pages
    without a scored token (by id, score -inf), and the longest prefix with total size <= ``budget`` is
    written to ``out_pages``/``out_scores``. Returns its length."""
    dummy = np.zeros(1, np.float32)
    G = Q.shape[0]
    lo, hi = descend(
        Q, QP, dummy, 1, 0.0, X, Xr, dummy, run_key, run_id, cl_start, cl_size, sub,
        top_level, 0, L, m, F, kk, cover, True,
        num_to_visit, prop_to_visit, num_to_retrieve, prop_to_retrieve,
        cnt, cnt_stamp, cand_stamp, eval_stamp, dist, stamp, pool_ids, gsc, True, per_query_beam,
    )
    best_g = np.full(G, -_INF)
    if mass:
        for i in range(lo, hi):
            for g in range(G):
                if gsc[i, g] > best_g[g]:
                    best_g[g] = gsc[i, g]
    stamp[0] += 1
    s = stamp[0]
    npg = 0
    for i in range(lo, hi):
        t = pool_ids[i]
        p = page_of[t]
        if mass:
            sc = 0.0
            for g in range(G):
                sc += math.exp(scale * (gsc[i, g] - best_g[g]))
        else:
            sc = -dist[i]
        if page_stamp[p] != s:
            page_stamp[p] = s
            page_best[p] = sc
            page_list[npg] = p
            npg += 1
        elif mass:
            page_best[p] += sc
        elif sc > page_best[p]:
            page_best[p] = sc
    # Pages are taken best first until one does not fit, a handful of the ~100s scored: a heap of the scored
    # pages, popped one at a time (O(npg + taken log npg)), instead of sorting them all.
    heapify_pages(page_list, npg, page_best)
    total = 0
    k = 0
    left = npg
    while left > 0:
        p = page_list[0]
        sz = page_sizes[p]
        if total + sz > budget:
            return k
        pop_best_page(page_list, left, page_best)
        left -= 1
        total += sz
        out_pages[k] = p
        out_scores[k] = page_best[p]
        k += 1
    # Every scored page fits: the pages the descent did not reach follow, by id, with score -inf (this only
    # happens when the budget exceeds what the descent scored, e.g. a budget >= the indexed tokens).
    for p in range(page_sizes.shape[0]):
        sz = page_sizes[p]
        if sz <= 0 or page_stamp[p] == s:
            continue
        if total + sz > budget:
            break
        total += sz
        out_pages[k] = p
        out_scores[k] = -_INF
        k += 1
    return k
