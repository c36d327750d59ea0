"""``icecache bench index``: page-selection quality and speed of the pagers on real keys and queries.

Part A (quality, one 8k-token prompt). Real post-RoPE keys, values and queries of the embedded model on long
real text (`icecache.eval.capture`). The queries of the last ``--steps`` positions act as decode-step
queries against the keys before them: the pagers are built on the *middle* (everything but the ``--sink``
first and the ``--window`` most recent tokens) of the first step, and at every later step the token leaving
the window is inserted, as during decoding. For every non-dense layer and KV head (GQA group of query heads)
and budget, each method selects pages; we report hit rate, attention recall and output error
(`icecache.core.metrics`), build time per head and query time per decode step (all sparse layers and KV
heads). Methods: ``exact`` (oracle top tokens), ``sequential`` (Quest pages), ``mdci``, ``mdci-oracle`` (mdci's
pages ranked by their exact best token: page formation without search error) and ``kmeans`` (a
capacity-constrained k-means clustering of the keys into as many pages as mdci, each at most the page size,
pages ranked by their exact best token: a quality reference for semantic paging).

Part B (scaling). Keys of ``n`` = 8k .. 256k tokens per KV head: captures of consecutive 8k windows of long
real text concatenated, each window with RoPE positions continuing the previous one (attention inside a
window is unchanged by the offset, so the keys are those of one long context); queries = the last positions
of the last window. Plus a synthetic clustered set. ``mdci`` vs ``exact``: select time per GQA group, attention
recall, index bytes per token next to the KV bytes per token.

Results: a Markdown table on stdout; ``--out DIR`` writes CSV files, ``bench_index.md`` (with the command and
wall time) and ``bench_index.png``.
"""

from __future__ import annotations

import argparse
import json
import csv
import math
import os
import platform
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from icecache.core.metrics import attention_recall
from icecache.core.pager import SemanticPager, take_within_budget
from icecache.core.pages import PageTable
from icecache.indexes import make_pager

DEFAULT_SIZES = (8192, 16384, 32768, 65536, 131072, 262144)


# ---------------------------------------------------------------------------------------------- references
def oracle_rank(table: PageTable, scores: torch.Tensor, budget: int) -> np.ndarray:
    """Live pages of ``table`` ranked by their best token score (``scores`` ``[n]`` per position, higher is
    better; ties by page id), under the budget rule. Returns the selected positions (int64)."""
    n = scores.numel()
    page_of = torch.from_numpy(table.page_of_[:n])
    best = torch.full((table.id_capacity,), -math.inf, dtype=torch.float64)
    best.scatter_reduce_(0, page_of, scores.double(), reduce="amax")
    ids = table.page_ids()
    order = ids[np.lexsort((ids, -best[ids].numpy()))]
    j = take_within_budget(table.sizes(order), budget)
    _, pos = table.csr(order[:j])
    return pos


def kmeans_groups(x: torch.Tensor, k: int, cap: int, seed: int, iters: int = 10, balanced_iters: int = 3,
                  chunk_rows: int | None = None) -> list[np.ndarray]:
    """Capacity-constrained k-means: ``k`` groups of at most ``cap`` rows of ``x`` ``[n, d]`` (needs
    ``k * cap >= n``; L2 on raw keys; seeded).

    ``iters`` Lloyd steps from ``k`` seeded sample points, then ``balanced_iters`` rounds of a greedy capped
    assignment (point-centroid pairs among each point's 8 nearest centroids, taken in increasing distance
    while the centroid has room; leftovers go to the nearest centroid with room) followed by a centroid
    update. Empty groups are dropped, so at most ``k`` groups come back. Distances are computed
    ``chunk_rows`` points at a time (default: 64M distances, 256 MiB, per chunk), so 128k+ points fit.
    """
    n = x.shape[0]
    k = max(1, min(k, n))
    if k * cap < n:
        raise ValueError(f"k * cap = {k * cap} < n = {n}: cannot cap {n} points in {k} groups of {cap}")
    gen = torch.Generator().manual_seed(seed)
    c = x[torch.randperm(n, generator=gen)[:k]].clone()

    rows = chunk_rows or max(1, (1 << 26) // max(1, k))  # distance rows per chunk

    def chunks() -> list[slice]:
        return [slice(i, min(n, i + rows)) for i in range(0, n, rows)]

    def dist(c: torch.Tensor, sl: slice) -> torch.Tensor:
        return (c * c).sum(1)[None, :] - 2.0 * (x[sl] @ c.T)  # [rows, k], |x|^2 dropped

    def update(assign: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        sums = torch.zeros_like(c).index_add_(0, assign, x)
        cnt = torch.bincount(assign, minlength=k).to(x.dtype)
        ok = cnt > 0
        c = c.clone()
        c[ok] = sums[ok] / cnt[ok, None]
        return c

    for _ in range(iters):
        c = update(torch.cat([torch.argmin(dist(c, sl), dim=1) for sl in chunks()]), c)
    assign = torch.zeros(n, dtype=torch.int64)
    r = min(8, k)
    for _ in range(max(1, balanced_iters)):
        near = [torch.topk(dist(c, sl), r, dim=1, largest=False) for sl in chunks()]
        dv = torch.cat([t.values for t in near])
        di = torch.cat([t.indices for t in near])
        order = torch.argsort(dv.reshape(-1), stable=True).numpy()
        pts = np.repeat(np.arange(n), r)[order]
        cen = di.reshape(-1).numpy()[order]
        room = np.full(k, cap, np.int64)
        a = np.full(n, -1, np.int64)
        for p_, c_ in zip(pts.tolist(), cen.tolist()):
            if a[p_] < 0 and room[c_] > 0:
                a[p_] = c_
                room[c_] -= 1
        left = np.flatnonzero(a < 0)
        for i0 in range(0, len(left), rows):
            part = left[i0 : i0 + rows]
            Dl = ((c * c).sum(1)[None, :] - 2.0 * (x[torch.from_numpy(part)] @ c.T)).numpy()
            for i, p_ in enumerate(part.tolist()):
                for c_ in np.argsort(Dl[i], kind="stable").tolist():
                    if room[c_] > 0:
                        a[p_] = c_
                        room[c_] -= 1
                        break
        assign = torch.from_numpy(a)
        c = update(assign, c)
    order_t = torch.argsort(assign, stable=True)
    counts = torch.bincount(assign, minlength=k).tolist()
    groups, start = [], 0
    for cnt_i in counts:
        if cnt_i:
            groups.append(order_t[start : start + cnt_i].numpy())
        start += cnt_i
    return groups


class KMeansPages:
    """The k-means quality reference: pages = capacity-constrained k-means clusters of the keys (as many as
    asked for, each <= page size), ranked by their exact best token. An inserted key joins the page of its
    nearest centroid when that page has room, else opens a page of its own."""

    def __init__(self, page_size: int, seed: int = 0) -> None:
        self.page_size, self.seed = page_size, seed
        self.table = PageTable(page_size)
        self.keys = torch.zeros(0, 0)

    def build(self, keys: torch.Tensor, num_pages: int) -> None:
        """Cluster ``keys`` ``[n, d]`` into ``max(num_pages, ceil(n / P))`` capped groups (empty ones dropped)."""
        self.keys = keys.clone()
        k = max(num_pages, -(-keys.shape[0] // self.page_size))
        groups = kmeans_groups(keys, k, self.page_size, self.seed) if keys.shape[0] else []
        self.table.clear()
        self.table.new_pages(groups)
        self.page_ids = np.asarray(self.table.page_ids())
        self.centroids = torch.stack([keys[torch.from_numpy(g)].mean(0) for g in groups]) if groups else torch.zeros(0, keys.shape[1])

    def insert(self, key: torch.Tensor) -> None:
        pos = self.keys.shape[0]
        self.keys = torch.cat([self.keys, key[None]])
        if len(self.centroids):
            j = int(torch.argmin(((self.centroids - key) ** 2).sum(1)))
            page = int(self.page_ids[j])
            if self.table.size(page) < self.page_size:
                self.table.append(page, pos)
                return
        self.table.new_page([pos])

    def select(self, queries: torch.Tensor, budget: int) -> np.ndarray:
        return oracle_rank(self.table, (queries @ self.keys.T).amax(0), budget)


# ---------------------------------------------------------------------------------------------- part A
class StepMetrics:
    """The metrics of `icecache.core.metrics` for many selections of one decode step, sharing the softmax.

    ``q`` ``[g, d]``; ``ctx_k``/``ctx_v`` ``[n, d]`` all keys/values up to the query; ``mid`` ``[m, d]`` the
    middle keys (positions are relative to it). Same formulas as `hit_rate`, `attention_recall` and
    `output_error` (checked against them by ``tests/test_bench_index.py``)."""

    def __init__(self, q: torch.Tensor, ctx_k: torch.Tensor, ctx_v: torch.Tensor, mid: torch.Tensor, budgets: Sequence[int]) -> None:
        scale = 1.0 / math.sqrt(q.shape[-1])
        self.p = torch.softmax(scale * (q.double() @ ctx_k.double().T), dim=-1)  # [g, n]
        self.v = ctx_v.double()
        self.full = self.p @ self.v
        self.full_norm = float(self.full.norm())
        order = torch.sort(-(q.float() @ mid.float().T).amax(0), stable=True).indices
        self.top = {b: order[: min(b, order.numel())] for b in budgets}

    def hit_rate(self, selected: torch.Tensor, budget: int) -> float:
        top = self.top[budget]
        if top.numel() == 0:
            return 1.0
        return float(torch.isin(top, selected.to(torch.int64)).float().mean())

    def recall_and_error(self, kept: torch.Tensor) -> tuple[float, float]:
        kept = torch.unique(kept.to(torch.int64))
        ps = self.p[:, kept]
        mass = ps.sum(-1, keepdim=True)
        recall = float(mass.mean())
        if kept.numel() == 0:
            return recall, 1.0
        sparse = (ps / mass) @ self.v[kept]
        diff = float((sparse - self.full).norm())
        return recall, (diff / self.full_norm if self.full_norm > 0 else diff)


@dataclass
class HeadResult:
    rows: list[dict[str, Any]] = field(default_factory=list)  # per method, budget, step
    build_s: dict[str, float] = field(default_factory=dict)
    select_s: dict[tuple[str, int], list[float]] = field(default_factory=dict)
    num_pages: dict[str, int] = field(default_factory=dict)


def parse_params(spec: str) -> dict[str, Any]:
    """``"field_of_view=60,p0=0.05"`` -> ``{"field_of_view": 60, "p0": 0.05}`` (`icecache.core.config.parse_params`,
    as an argparse type)."""
    from icecache.core.config import parse_params as parse
    from icecache.core.errors import ConfigError

    try:
        return parse(spec)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


#: Part A sweep of each backend's main speed/quality knob (``--pareto``): name -> (pager, parameters).
PARETO_SWEEP: dict[str, tuple[str, dict[str, Any]]] = {
    **{f"mdci[fov={f}]": ("mdci", {"field_of_view": f}) for f in (10, 20, 60, 120)},
    **{f"ivf[probe={p}]": ("ivf", {"probe_factor": p}) for p in (1.0, 2.0, 4.0, 16.0)},
    **{f"hnsw[search={f}]": ("hnsw", {"search_factor": f}) for f in (2.0, 4.0)},
    **{f"hnsw[ef={e}]": ("hnsw", {"ef": e}) for e in (16, 32)},
    **{f"hnsw[ef={e}]": ("hnsw", {"ef": e, "search_factor": 2.0}) for e in (256,)},
    **{f"pq[bits={b}]": ("pq", {"bits": b}) for b in (4, 8)},
}


def parse_variant(spec: str, mdci_defaults: dict[str, Any]) -> tuple[str, tuple[str, dict[str, Any]]]:
    """``"NAME=PAGER:k=v,..."`` -> ``(NAME, (PAGER, params))``; ``"NAME:k=v"`` is an mdci variant ``mdci[NAME]``."""
    head, _, params = spec.partition(":")
    if "=" in head:
        name, pager = head.split("=", 1)
        return name, (pager, parse_params(params))
    return f"mdci[{head}]", ("mdci", {**mdci_defaults, **parse_params(params)})


def evaluate_head(
    K: torch.Tensor, V: torch.Tensor, Q: torch.Tensor, *, budgets: Sequence[int], page_size: int, sink: int,
    window: int, seed: int, variants: dict[str, tuple[str, dict[str, Any]]], with_kmeans: bool = True,
) -> HeadResult:
    """Run every method on one KV head. ``K``, ``V`` ``[T, d]``; ``Q`` ``[S, g, d]``: the group's queries
    at positions ``T - S .. T - 1``."""
    T, d = K.shape
    S = Q.shape[0]
    p0 = T - S
    mid_end = p0 + 1 - window  # middle = [sink, mid_end) at step 0
    res = HeadResult()
    mid0 = K[sink:mid_end]
    pagers: dict[str, Any] = {}
    for name, maker in [("exact", lambda: make_pager("exact", d, page_size, seed)),
                        ("sequential", lambda: make_pager("sequential", d, page_size, seed))] + [
            (vname, (lambda index=index, params=params: make_pager(index, d, page_size, seed, **params)))
            for vname, (index, params) in variants.items()]:
        pg = maker()
        t0 = time.perf_counter()
        pg.build(mid0)
        res.build_s[name] = time.perf_counter() - t0
        res.num_pages[name] = pg.num_pages
        pagers[name] = pg
    if with_kmeans:
        km = KMeansPages(page_size, seed)
        t0 = time.perf_counter()
        km.build(mid0, pagers["mdci"].num_pages)
        res.build_s["kmeans"] = time.perf_counter() - t0
        res.num_pages["kmeans"] = km.table.num_pages
    for j in range(S):
        p = p0 + j
        m_end = p + 1 - window
        if j > 0:
            new = K[m_end - 1]
            for pg in pagers.values():
                pg.insert(new[None])
            if with_kmeans:
                km.insert(new)
        q = Q[j]
        ctx_k, ctx_v = K[: p + 1], V[: p + 1]
        fixed = torch.cat([torch.arange(0, sink), torch.arange(m_end, p + 1)])
        mid = K[sink:m_end]
        mid_scores = (q @ mid.T).amax(0)
        metrics = StepMetrics(q, ctx_k, ctx_v, mid, budgets)
        selections: list[tuple[str, int, torch.Tensor, float]] = []
        for name, pg in pagers.items():
            for b in budgets:
                sel = pg.select(q, b)
                t0 = time.perf_counter()  # time a second, warm call (the first one pays for cold caches)
                pg.select(q, b)
                dt = time.perf_counter() - t0
                selections.append((name, b, sel.positions, dt))
                if name == "mdci":
                    pos = torch.from_numpy(oracle_rank(pg.table, mid_scores, b))
                    selections.append(("mdci-oracle", b, pos, float("nan")))
        if with_kmeans:
            for b in budgets:
                pos = torch.from_numpy(km.select(q, b))
                t0 = time.perf_counter()
                km.select(q, b)
                selections.append(("kmeans", b, pos, time.perf_counter() - t0))
        for name, b, pos, dt in selections:
            kept = torch.cat([fixed, pos.to(torch.int64) + sink])
            rec, err = metrics.recall_and_error(kept)
            res.rows.append({
                "method": name, "budget": b, "step": j, "tokens": int(pos.numel()),
                "hit_rate": metrics.hit_rate(pos, b), "attention_recall": rec, "output_error": err,
            })
            if not math.isnan(dt):
                res.select_s.setdefault((name, b), []).append(dt)
    return res


# ---------------------------------------------------------------------------------------------- part B
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


# ---------------------------------------------------------------------------------------------- output
def md_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def fmt(v: Any) -> str:
        if isinstance(v, float):
            if math.isnan(v):
                return "-"
            return f"{v:.4g}" if abs(v) < 1e4 else f"{v:.0f}"
        return str(v)

    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(fmt(v) for v in r) + " |" for r in rows]
    return "\n".join(lines)


def write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    if not rows:
        return
    keys = list(dict.fromkeys(k for r in rows for k in r))
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)


def _slope(ns: Sequence[float], ts: Sequence[float]) -> float:
    """Least-squares exponent a of t ~ n^a."""
    if len(ns) < 2:
        return float("nan")
    return float(np.polyfit(np.log(ns), np.log(ts), 1)[0])


# ---------------------------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="icecache bench index", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model name, .gguf file or directory (default: embedded SmolLM2-135M)")
    p.add_argument("--tokens", type=int, default=8192, help="prompt length of part A (default 8192)")
    p.add_argument("--steps", type=int, default=32, help="decode-step queries per head: the last N positions (default 32)")
    p.add_argument("--budgets", default="64,128,256", help="comma-separated token budgets (default 64,128,256)")
    p.add_argument("--page-size", type=int, default=16, help="page capacity P (default 16)")
    p.add_argument("--sink", type=int, default=4, help="sink tokens (default 4)")
    p.add_argument("--window", type=int, default=64, help="recent-window tokens (default 64)")
    p.add_argument("--dense-layers", default="0,1", help="layers with full attention, excluded (default 0,1)")
    p.add_argument("--layers", default=None, help="comma-separated layers of part A (default: every non-dense layer)")
    p.add_argument("--seed", type=int, default=0, help="seed of every pager and of k-means (default 0)")
    p.add_argument("--mdci", default="", type=parse_params, help="mdci parameters, e.g. 'field_of_view=60,p0=0.05'")
    p.add_argument("--pagers", default="mdci,ivf,hnsw,pq",
                   help="registered pagers compared in part A besides exact and sequential (default mdci,ivf,hnsw,pq)")
    p.add_argument("--pareto", action="store_true",
                   help="also sweep each backend's speed/quality knob and plot attention recall vs select time (pareto.*)")
    p.add_argument("--variant", action="append", default=[], metavar="NAME[=PAGER]:K=V,...",
                   help="an extra mdci configuration to compare in part A (repeatable), e.g. 'p0=0.1:p0=0.1'")
    p.add_argument("--no-kmeans", action="store_true", help="skip the k-means reference")
    p.add_argument("--sizes", default=",".join(str(s) for s in DEFAULT_SIZES), help="part B key counts (multiples of 8192)")
    p.add_argument("--scaling-layers", default="2,4", help="layers captured for part B (default 2,4)")
    p.add_argument("--scaling-queries", type=int, default=8, help="query positions per part-B point (default 8)")
    p.add_argument("--scaling-budgets", default="128", help="comma-separated budgets of part B (default 128)")
    p.add_argument("--scaling-variant", action="append", default=[], metavar="NAME:K=V,...",
                   help="an extra mdci configuration for part B (repeatable), e.g. 'F30:field_of_view=30'")
    p.add_argument("--scaling-kmeans", action="store_true",
                   help="part B, real keys: also the k-means page reference (as many pages as mdci; slow at 128k+)")
    p.add_argument("--no-scaling", action="store_true", help="skip part B")
    p.add_argument("--no-quality", action="store_true", help="skip part A")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: leave torch's default)")
    p.add_argument("--quick", action="store_true", help="a short run: 4096 tokens, 4 steps, 3 layers, sizes up to 32k")
    p.add_argument("--out", default=None, help="write CSV, Markdown and PNG results to this directory")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(list(argv) if argv is not None else None)
    from tqdm import tqdm

    from icecache.eval.capture import capture_kv, long_text, time_decode_steps
    from icecache.runtime.models import load_model

    t_start = time.perf_counter()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.tokens, args.steps = 4096, 4
        args.layers = args.layers or "2,15,29"
        args.sizes = "8192,16384,32768"
        args.scaling_layers = "2"
    budgets = [int(b) for b in args.budgets.split(",")]
    dense = {int(x) for x in args.dense_layers.split(",") if x}
    mdci_params = dict(args.mdci)
    variants: dict[str, tuple[str, dict[str, Any]]] = {"mdci": ("mdci", mdci_params)}
    for name in filter(None, (x.strip() for x in args.pagers.split(","))):
        if name not in ("mdci", "exact", "sequential"):
            variants[name] = (name, {})
    for v in args.variant:
        variants.update([parse_variant(v, mdci_params)])
    if args.pareto:
        variants.update(PARETO_SWEEP)
    model, tok = load_model(args.model)
    n_layers = model.config.num_hidden_layers
    n_kv = model.config.num_key_value_heads
    n_q = model.config.num_attention_heads
    rep = n_q // n_kv
    layers = [int(x) for x in args.layers.split(",")] if args.layers else [l for l in range(n_layers) if l not in dense]
    sizes = sorted(int(s) for s in args.sizes.split(",") if s)
    W = 8192
    need = max(args.tokens, max(sizes) if not args.no_scaling else 0)
    ids_all = long_text(tok, need)
    report: list[str] = []
    csv_out: dict[str, list[dict[str, Any]]] = {}
    summary_quality: dict[tuple[str, int], dict[str, float]] = {}
    scaling_rows: list[dict[str, Any]] = []
    targets: list[str] = []
    info = {}

    # ---------------------------------------------------------------- part A
    if not args.no_quality:
        ids = ids_all[:, : args.tokens]
        cap = capture_kv(model, ids, last_queries=args.steps, keep_cache=True)
        dec = time_decode_steps(model, cap.past_key_values, int(ids[0, -1]), num_steps=5)
        cap.past_key_values = None
        info["prefill_s"] = cap.seconds
        info["decode_step_ms"] = 1e3 * float(np.median(dec))
        all_rows: list[dict[str, Any]] = []
        builds: dict[str, list[float]] = {}
        selects: dict[tuple[str, int], list[float]] = {}  # per (method, budget): per-head mean select time
        pages: dict[str, list[int]] = {}
        heads = [(l, h) for l in layers for h in range(n_kv)]
        for l, h in tqdm(heads, desc="part A: layers x KV heads", unit="head", file=sys.stderr):
            K = cap.keys[l][h]
            V = cap.values[l][h]
            Q = cap.queries[l][h * rep : (h + 1) * rep].transpose(0, 1).contiguous()  # [S, g, d]
            r = evaluate_head(K, V, Q, budgets=budgets, page_size=args.page_size, sink=args.sink, window=args.window,
                              seed=args.seed, variants=variants, with_kmeans=not args.no_kmeans)
            for row in r.rows:
                row.update(layer=l, head=h)
                all_rows.append(row)
            for k, v in r.build_s.items():
                builds.setdefault(k, []).append(v)
            for k, v in r.select_s.items():
                selects.setdefault(k, []).append(float(np.median(v)))  # robust to load spikes
            for k, v in r.num_pages.items():
                pages.setdefault(k, []).append(v)
        del cap
        methods = list(dict.fromkeys(r["method"] for r in all_rows))
        # Per (method, budget, layer) means, and overall means (each layer weighs the same).
        per_layer: list[dict[str, Any]] = []
        for m in methods:
            for b in budgets:
                layer_means = {}
                for l in layers:
                    sel = [r for r in all_rows if r["method"] == m and r["budget"] == b and r["layer"] == l]
                    row = {"method": m, "budget": b, "layer": l}
                    for key in ("hit_rate", "attention_recall", "output_error", "tokens"):
                        row[key] = float(np.mean([r[key] for r in sel]))
                    per_layer.append(row)
                    layer_means[l] = row
                summary_quality[(m, b)] = {
                    key: float(np.mean([layer_means[l][key] for l in layers]))
                    for key in ("hit_rate", "attention_recall", "output_error", "tokens")
                }
        csv_out["quality_per_layer.csv"] = per_layer
        qrows = []
        for m in methods:
            for b in budgets:
                s = summary_quality[(m, b)]
                qrows.append({"method": m, "budget": b, **s})
        csv_out["quality_summary.csv"] = qrows
        report.append(f"### Part A: selection quality ({args.tokens} tokens, {len(layers)} sparse layers x {n_kv} KV heads, "
                      f"{args.steps} decode steps, page size {args.page_size}, sink {args.sink}, window {args.window})\n")
        report.append("Means over sparse layers (each layer weighs the same), KV heads and decode steps.\n")
        report.append(md_table(["method", "budget", "hit rate", "attention recall", "output error", "tokens used"],
                               [[r["method"], r["budget"], r["hit_rate"], r["attention_recall"], r["output_error"], r["tokens"]] for r in qrows]))
        # Per-layer recall at the middle budget.
        bmid = 128 if 128 in budgets else budgets[len(budgets) // 2]
        report.append(f"\nAttention recall per layer at budget {bmid}:\n")
        report.append(md_table(["layer"] + methods, [[l] + [next(r["attention_recall"] for r in per_layer if r["method"] == m and r["budget"] == bmid and r["layer"] == l) for m in methods] for l in layers]))
        # Timing.
        trows = []
        n_groups = len(heads)
        for m in builds.keys() | {k[0] for k in selects}:
            row = {"method": m, "build_ms_per_head": 1e3 * float(np.mean(builds[m])) if m in builds else float("nan"),
                   "pages_per_head": float(np.mean(pages[m])) if m in pages else float("nan")}
            for b in budgets:
                v = selects.get((m, b))
                row[f"select_ms_per_group@{b}"] = 1e3 * float(np.mean(v)) if v else float("nan")
                row[f"select_ms_per_step@{b}"] = 1e3 * float(np.mean(v)) * n_groups if v else float("nan")
            trows.append(row)
        trows.sort(key=lambda r: methods.index(r["method"]) if r["method"] in methods else 99)
        csv_out["timing.csv"] = trows
        report.append(f"\n### Part A: speed (this machine: {os.cpu_count()} CPUs, torch threads {torch.get_num_threads()})\n")
        report.append(f"Model prefill of {args.tokens} tokens (decoder forward, capture on): {info['prefill_s']:.2f} s; "
                      f"one full-attention decode step at that context: {info['decode_step_ms']:.1f} ms (median of 5).\n")
        hdr = ["method", "build ms/head", "pages/head"] + [f"select ms/group @{b}" for b in budgets] + [f"select ms/step @{b} ({n_groups} groups)" for b in budgets]
        report.append(md_table(hdr, [[r["method"], r["build_ms_per_head"], r["pages_per_head"]] + [r[f"select_ms_per_group@{b}"] for b in budgets] + [r[f"select_ms_per_step@{b}"] for b in budgets] for r in trows]))
        # Pareto view: attention recall vs select time per decode step, every method and variant.
        bp = 128 if 128 in budgets else budgets[len(budgets) // 2]
        prow = []
        for r in trows:
            m = r["method"]
            if (m, bp) not in summary_quality or math.isnan(r[f"select_ms_per_step@{bp}"]):
                continue
            prow.append({"method": m, "family": m.split("[")[0], "attention_recall": summary_quality[(m, bp)]["attention_recall"],
                         "hit_rate": summary_quality[(m, bp)]["hit_rate"], "select_ms_per_step": r[f"select_ms_per_step@{bp}"],
                         "build_ms_per_head": r["build_ms_per_head"], "pages_per_head": r["pages_per_head"],
                         "params": json.dumps(variants.get(m, (m, {}))[1])})
        front = _pareto_front([(p["select_ms_per_step"], p["attention_recall"]) for p in prow])
        for i, p in enumerate(prow):
            p["pareto_optimal"] = i in front
        csv_out["pareto.csv"] = prow
        report.append(f"\n### Pareto: attention recall @{bp} vs select time per decode step ({n_groups} GQA groups)\n")
        report.append(md_table(["method", "params", "recall", "hit rate", "select ms/step", "build ms/head", "pages/head", "Pareto-optimal"],
                               [[p["method"], p["params"], p["attention_recall"], p["hit_rate"], p["select_ms_per_step"],
                                 p["build_ms_per_head"], p["pages_per_head"], "yes" if p["pareto_optimal"] else ""]
                                for p in sorted(prow, key=lambda p: p["select_ms_per_step"])]))
        # Targets.
        if 128 in budgets and 64 in budgets and 256 in budgets:
            rm = lambda m, b: summary_quality[(m, b)]["attention_recall"]  # noqa: E731
            if ("sequential", 128) in summary_quality:
                d1 = rm("mdci", 128) - rm("sequential", 128)
                targets.append(f"- recall@128 mdci {rm('mdci', 128):.4f} >= sequential {rm('sequential', 128):.4f}: "
                               f"{'MET' if d1 >= 0 else 'MISSED'} (difference {d1:+.4f})")
            if ("kmeans", 128) in summary_quality:
                d2 = rm("mdci", 128) - rm("kmeans", 128)
                targets.append(f"- recall@128 mdci within 0.02 of k-means {rm('kmeans', 128):.4f}: "
                               f"{'MET' if d2 >= -0.02 else 'MISSED'} (difference {d2:+.4f})")
            if ("sequential", 256) in summary_quality:
                d3 = rm("mdci", 64) - rm("sequential", 256)
                targets.append(f"- recall@64 mdci {rm('mdci', 64):.4f} >= sequential@256 {rm('sequential', 256):.4f}: "
                               f"{'MET' if d3 >= 0 else 'MISSED'} (difference {d3:+.4f})")
        bt = 1e3 * float(np.mean(builds["mdci"])) * n_layers * n_kv
        targets.append(f"- build of all {n_layers}x{n_kv} heads ~ {bt / 1e3:.2f} s (mean per head x {n_layers * n_kv}, one thread) "
                       f"< prefill {info['prefill_s']:.2f} s: {'MET' if bt / 1e3 < info['prefill_s'] else 'MISSED'} (ratio {bt / 1e3 / info['prefill_s']:.3f})")
        for b in budgets:
            st = next(r[f"select_ms_per_step@{b}"] for r in trows if r["method"] == "mdci")
            targets.append(f"- mdci select per decode step @{b}: {st:.1f} ms vs full decode step {info['decode_step_ms']:.1f} ms: "
                           f"{'MET' if st < info['decode_step_ms'] else 'MISSED'} (ratio {st / info['decode_step_ms']:.3f})")

    # ---------------------------------------------------------------- part B
    if not args.no_scaling:
        s_layers = [int(x) for x in args.scaling_layers.split(",") if x]
        s_budgets = [int(b) for b in args.scaling_budgets.split(",") if b]
        s_variants: dict[str, dict[str, Any]] = {"mdci": mdci_params}
        for v in args.scaling_variant:
            name, _, spec = v.partition(":")
            s_variants[f"mdci[{name}]"] = {**mdci_params, **parse_params(spec)}
        nwin = max(sizes) // W
        keys_by_layer: dict[int, list[torch.Tensor]] = {l: [] for l in s_layers}
        q_by_window: list[dict[int, torch.Tensor]] = []
        cap_s = 0.0
        for w in tqdm(range(nwin), desc="part B: capturing 8k windows", unit="window", file=sys.stderr):
            cap = capture_kv(model, ids_all[:, w * W : (w + 1) * W], layers=s_layers, last_queries=args.scaling_queries, position_offset=w * W)
            cap_s += cap.seconds
            for l in s_layers:
                keys_by_layer[l].append(cap.keys[l])
            q_by_window.append({l: cap.queries[l] for l in s_layers})
        keys_cat = {l: torch.cat(v, dim=1) for l, v in keys_by_layer.items()}  # [H_kv, N, d]
        del keys_by_layer
        pts = [(n, l, h) for n in sizes for l in s_layers for h in range(n_kv)]
        for n, l, h in tqdm(pts, desc="part B: scaling points", unit="point", file=sys.stderr):
            w = n // W - 1
            Qw = q_by_window[w][l][h * rep : (h + 1) * rep].transpose(0, 1).contiguous()  # [Qn, g, d]
            positions = [n - args.scaling_queries + i for i in range(args.scaling_queries)]
            r = scaling_point(keys_cat[l][h, :n].contiguous(), Qw, positions=positions, budgets=s_budgets, page_size=args.page_size,
                              sink=args.sink, window=args.window, seed=args.seed, variants=s_variants,
                              with_kmeans=args.scaling_kmeans)
            r.update(data="real", layer=l, head=h)
            scaling_rows.append(r)
        for n in tqdm(sizes, desc="part B: synthetic", unit="size", file=sys.stderr):
            Ks, Qs = synthetic_clustered(n, 64, args.seed, args.scaling_queries)
            r = scaling_point(Ks, Qs, positions=None, budgets=s_budgets, page_size=args.page_size, sink=args.sink,
                              window=args.window, seed=args.seed, variants=s_variants)
            r.update(data="synthetic", layer=-1, head=-1)
            scaling_rows.append(r)
        csv_out["scaling.csv"] = scaling_rows
        bmid = 128 if 128 in s_budgets else s_budgets[0]
        kv_fp16 = 2 * 64 * 2
        agg_rows = []
        for data in ("real", "synthetic"):
            for n in sizes:
                rs = [r for r in scaling_rows if r["data"] == data and r["n"] == n]
                a = {k: float(np.mean([r[k] for r in rs])) for k in rs[0] if isinstance(rs[0][k], (int, float)) and k not in ("layer", "head")}
                a.update(data=data, n=n)
                agg_rows.append(a)
        report.append(f"\n### Part B: scaling (budget {bmid}; real = layers {s_layers} x {n_kv} KV heads, "
                      f"{args.scaling_queries} query positions each; synthetic = clustered Gaussian keys, d = 64)\n")
        report.append(f"Capturing {nwin} windows of {W} tokens took {cap_s:.1f} s. KV bytes per token per KV head: "
                      f"{kv_fp16} (fp16 K+V), {2 * kv_fp16} (fp32). `X-oracle` = X's pages ranked by their exact best token; "
                      f"`ratio` = recall / exact's recall; select times are medians per GQA group.\n")
        hdr = ["data", "n", "method", "build s", "select ms", "speed-up vs exact", "recall", "ratio", "oracle recall", "oracle ratio",
               "index B/token", "pages"]
        rows_md = []
        for a in agg_rows:
            ex_t, ex_r = a[f"exact_select_ms@{bmid}"], a[f"exact_recall@{bmid}"]
            rows_md.append([a["data"], int(a["n"]), "exact", a["exact_build_s"], ex_t, 1.0, ex_r, 1.0, float("nan"), float("nan"),
                            a["exact_index_bytes_per_token"], a["exact_pages"]])
            for v in s_variants:
                rows_md.append([a["data"], int(a["n"]), v, a[f"{v}_build_s"], a[f"{v}_select_ms@{bmid}"], ex_t / a[f"{v}_select_ms@{bmid}"],
                                a[f"{v}_recall@{bmid}"], a[f"{v}_recall@{bmid}"] / ex_r, a[f"{v}-oracle_recall@{bmid}"],
                                a[f"{v}-oracle_recall@{bmid}"] / ex_r, a[f"{v}_index_bytes_per_token"], a[f"{v}_pages"]])
            if f"kmeans_recall@{bmid}" in a:
                rows_md.append([a["data"], int(a["n"]), "kmeans", a["kmeans_build_s"], float("nan"), float("nan"),
                                a[f"kmeans_recall@{bmid}"], a[f"kmeans_recall@{bmid}"] / ex_r, float("nan"), float("nan"),
                                float("nan"), a["kmeans_pages"]])
        report.append(md_table(hdr, rows_md))
        for data in ("real", "synthetic"):
            rs = [a for a in agg_rows if a["data"] == data]
            se = _slope([a["n"] for a in rs], [a[f"exact_select_ms@{bmid}"] for a in rs])
            for v in s_variants:
                sm = _slope([a["n"] for a in rs], [a[f"{v}_select_ms@{bmid}"] for a in rs])
                report.append(f"\n{data}, {v}: growth exponent of select time (t ~ n^a, least squares): {sm:.2f} (exact {se:.2f}).")
                at = [a for a in rs if a["n"] == 131072]
                if at:
                    a = at[0]
                    sp = a[f"exact_select_ms@{bmid}"] / a[f"{v}_select_ms@{bmid}"]
                    rr = a[f"{v}_recall@{bmid}"] / a[f"exact_recall@{bmid}"]
                    ro = a[f"{v}_recall@{bmid}"] / a[f"{v}-oracle_recall@{bmid}"]
                    targets.append(f"- {data} 128k, {v}: {sp:.2f}x faster than exact ({'MET' if sp >= 3 else 'MISSED'} >= 3x); recall "
                                   f"{rr:.3f} of exact's ({'MET' if rr >= 0.95 else 'MISSED'} >= 0.95; {ro:.3f} of its own pages' oracle ranking); "
                                   f"select-time exponent {sm:.2f} vs exact {se:.2f}")
            at = [a for a in rs if a["n"] == 131072 and f"kmeans_recall@{bmid}" in a]
            if at:
                a = at[0]
                targets.append(f"- {data} 128k, k-means pages (reference, exact page ranking): recall "
                               f"{a[f'kmeans_recall@{bmid}'] / a[f'exact_recall@{bmid}']:.3f} of exact's")
        csv_out["scaling_summary.csv"] = agg_rows

    wall = time.perf_counter() - t_start
    cmd = "icecache bench index " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    head = [f"# Index benchmark\n", f"Command: `{cmd}`  ", f"Wall time: {wall:.0f} s  ",
            f"Machine: {platform.platform()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, torch {torch.__version__}  ",
            f"Model: {model.config._name_or_path or 'embedded SmolLM2-135M-Instruct'} ({n_layers} layers, {n_q} query / {n_kv} KV heads); "
            f"mdci parameters: {mdci_params or 'defaults (preset wide)'}" + (f"; variants: {', '.join(variants)}" if len(variants) > 1 else "") + "\n"]
    if targets:
        report.append("\n### Targets (issue 3)\n")
        report.extend(targets)
    text = "\n".join(head) + "\n" + "\n".join(report) + "\n"
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        for name, rows in csv_out.items():
            write_csv(out / name, rows)
        (out / "bench_index.md").write_text(text)
        _plot(out / "bench_index.png", summary_quality, budgets, scaling_rows, sizes,
              128 if 128 in args.scaling_budgets.split(",") else int(args.scaling_budgets.split(",")[0]))
        if "pareto.csv" in csv_out:
            _plot_pareto(out / "pareto.png", csv_out["pareto.csv"], 128 if 128 in budgets else budgets[len(budgets) // 2])
        print(f"wrote {out}/", file=sys.stderr)
    return 0


def _pareto_front(points: Sequence[tuple[float, float]]) -> set[int]:
    """Indices of the points no other point beats on both time (lower) and recall (higher)."""
    return {i for i, (t, r) in enumerate(points)
            if not any((t2 <= t and r2 >= r) and (t2 < t or r2 > r) for t2, r2 in points)}


def _plot_pareto(path: Path, rows: list[dict[str, Any]], budget: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5))
    for fam in dict.fromkeys(r["family"] for r in rows):
        rs = sorted((r for r in rows if r["family"] == fam), key=lambda r: r["select_ms_per_step"])
        ax.plot([r["select_ms_per_step"] for r in rs], [r["attention_recall"] for r in rs], marker="o", label=fam)
        for r in rs:
            tag = r["method"][len(fam):] or "default"
            ax.annotate(tag, (r["select_ms_per_step"], r["attention_recall"]), fontsize=6, xytext=(3, 3), textcoords="offset points")
    fr = sorted((r for r in rows if r["pareto_optimal"]), key=lambda r: r["select_ms_per_step"])
    ax.plot([r["select_ms_per_step"] for r in fr], [r["attention_recall"] for r in fr], "k--", lw=1, label="Pareto front")
    ax.set_xscale("log")
    ax.set_xlabel("select time per decode step, all sparse layers x KV heads (ms, log)")
    ax.set_ylabel(f"attention recall @ budget {budget}")
    ax.set_title("Pagers: quality vs query cost (captured SmolLM2 keys)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot(path: Path, summary: dict[tuple[str, int], dict[str, float]], budgets: Sequence[int],
          scaling_rows: list[dict[str, Any]], sizes: Sequence[int], bscale: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    ax = axes[0]
    methods = list(dict.fromkeys(m for m, _ in summary))
    for m in methods:
        ax.plot(budgets, [summary[(m, b)]["attention_recall"] for b in budgets], marker="o", label=m)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("budget (tokens)")
    ax.set_ylabel("attention recall (mean over sparse layers)")
    ax.set_title("Part A: quality")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    bmid = bscale
    for data, style in (("real", "-"), ("synthetic", "--")):
        rs = [r for r in scaling_rows if r["data"] == data]
        if not rs:
            continue
        ns = sorted({r["n"] for r in rs})
        for m in [k[: -len(f"_select_ms@{bmid}")] for k in rs[0] if k.endswith(f"_select_ms@{bmid}")]:
            t = [np.mean([r[f"{m}_select_ms@{bmid}"] for r in rs if r["n"] == n]) for n in ns]
            rec = [np.mean([r[f"{m}_recall@{bmid}"] for r in rs if r["n"] == n]) for n in ns]
            axes[1].plot(ns, t, style, marker="o", label=f"{m} ({data})")
            axes[2].plot(ns, rec, style, marker="o", label=f"{m} ({data})")
    for ax, title, ylabel in ((axes[1], "Part B: select time per GQA group", "ms"), (axes[2], f"Part B: attention recall @{bmid}", "recall")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("keys per KV head")
        ax.set_title(title)
        ax.set_ylabel(ylabel)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    if scaling_rows:
        axes[1].set_yscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
