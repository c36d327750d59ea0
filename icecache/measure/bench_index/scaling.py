"""Part B of the index benchmark: select time and attention recall of mdci vs exact as the keys per head grow.

Keys of ``n`` = 8k .. 256k tokens per KV head: captures of consecutive 8k windows of long real text
concatenated, each window with RoPE positions continuing the previous one (attention inside a window is
unchanged by the offset, so the keys are those of one long context); queries = the last positions of the
last window. Plus a synthetic clustered set (`synthetic_clustered`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from icecache.core.metrics import attention_recall
from icecache.core.pager import SemanticPager
from icecache.indexes import make_pager
from icecache.measure.bench_index.references import KMeansPages, oracle_rank

__all__ = ["synthetic_clustered", "scaling_point", "slope"]


def synthetic_clustered(n: int, d: int, seed: int, num_queries: int, g: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """Clustered keys ``[n, d]`` (n / 128 Gaussian clusters, varying norms) and query groups
    ``[num_queries, g, d]``: each group aims at one random cluster (its heads differ by noise)."""
    gen = torch.Generator().manual_seed(seed)
    k = max(1, n // 128)
    centers = torch.randn(k, d, generator=gen)
    assign = torch.randint(0, k, (n,), generator=gen)
    keys = (centers[assign] + 0.5 * torch.randn(n, d, generator=gen)) * (0.5 + torch.rand(n, 1, generator=gen))
    pick = torch.randint(0, k, (num_queries,), generator=gen)
    queries = 1.5 * centers[pick][:, None, :] + 0.3 * torch.randn(num_queries, g, d, generator=gen)
    return keys, queries


def scaling_point(
    keys: torch.Tensor, queries: torch.Tensor, *, positions: Sequence[int] | None, budgets: Sequence[int],
    page_size: int, sink: int, window: int, seed: int, variants: dict[str, dict[str, Any]], repeats: int = 3,
    with_kmeans: bool = False,
) -> dict[str, Any]:
    """One (n, head) point: build ``exact`` and every mdci variant on the middle, time selects (median over
    the query positions of the mean of ``repeats`` calls), measure attention recall; ``<variant>-oracle`` ranks
    that variant's pages by their exact best token (page granularity without search error). A variant's
    parameters may hold ``page_size`` (its own page capacity). ``with_kmeans`` adds ``kmeans``: k-means pages
    (as many as ``mdci``'s, each at most ``page_size``) ranked by their exact best token, recall only.

    ``keys`` ``[n, d]``; ``queries`` ``[Qn, g, d]``. Real data passes ``positions`` (the query positions, the
    last ``Qn`` of the keys): the middle is ``[sink, n - window - Qn)`` and every query also keeps the sink and
    the tokens after the middle up to itself. Synthetic data passes None: every key is middle, nothing fixed."""
    n, d = keys.shape
    Qn = queries.shape[0]
    lo, hi = (sink, n - window - Qn) if positions is not None else (0, n)
    mid = keys[lo:hi]
    out: dict[str, Any] = {"n": n, "middle": hi - lo}
    pagers: dict[str, SemanticPager] = {}
    for name, (kind, kw) in {"exact": ("exact", {}), **{v: ("mdci", p) for v, p in variants.items()}}.items():
        kw = dict(kw)
        pg = make_pager(kind, d, int(kw.pop("page_size", page_size)), seed, **kw)
        t0 = time.perf_counter()
        pg.build(mid)
        out[f"{name}_build_s"] = time.perf_counter() - t0
        out[f"{name}_index_bytes_per_token"] = pg.index_bytes() / max(1, hi - lo)
        out[f"{name}_pages"] = pg.num_pages
        pagers[name] = pg

    def recall(q: torch.Tensor, i: int, sel: torch.Tensor) -> float:
        if positions is None:
            return attention_recall(q, keys, sel)
        pos = int(positions[i])
        fixed = torch.cat([torch.arange(0, sink), torch.arange(hi, pos + 1)])
        return attention_recall(q, keys[: pos + 1], torch.cat([fixed, sel + lo]))

    km = None
    if with_kmeans:
        km = KMeansPages(page_size, seed)
        t0 = time.perf_counter()
        km.build(mid, pagers["mdci"].num_pages if "mdci" in pagers else 0)
        out["kmeans_build_s"] = time.perf_counter() - t0
        out["kmeans_pages"] = km.table.num_pages
    for b in budgets:
        if km is not None:
            out[f"kmeans_recall@{b}"] = float(np.mean([recall(queries[i], i, torch.from_numpy(km.select(queries[i], b)))
                                                       for i in range(Qn)]))
        for name, pg in pagers.items():
            times, recs = [], []
            for i in range(Qn):
                q = queries[i]
                pg.select(q, b)  # warm
                t0 = time.perf_counter()
                for _ in range(repeats):
                    sel = pg.select(q, b)
                times.append((time.perf_counter() - t0) / repeats)
                recs.append(recall(q, i, sel.positions))
            out[f"{name}_select_ms@{b}"] = 1e3 * float(np.median(times))
            out[f"{name}_recall@{b}"] = float(np.mean(recs))
            if name != "exact":
                out[f"{name}-oracle_recall@{b}"] = float(np.mean([
                    recall(queries[i], i, torch.from_numpy(oracle_rank(pg.table, (queries[i] @ mid.T).amax(0), b))) for i in range(Qn)]))
    return out


def slope(ns: Sequence[float], ts: Sequence[float]) -> float:
    """Least-squares exponent a of t ~ n^a."""
    if len(ns) < 2:
        return float("nan")
    return float(np.polyfit(np.log(ns), np.log(ts), 1)[0])
