"""Part A of the index benchmark: selection quality and speed of every pager on one captured prompt.

The queries of the last ``steps`` positions act as decode-step queries against the keys before them: the pagers
are built on the *middle* of the first step, and at every later step the token leaving the window is inserted,
as during decoding (`evaluate_head`). `PARETO_SWEEP` lists each backend's main speed/quality knob.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from icecache.indexes import make_pager
from icecache.measure.bench_index.references import KMeansPages, oracle_rank

__all__ = ["StepMetrics", "HeadResult", "PARETO_SWEEP", "evaluate_head"]


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


#: Part A sweep of each backend's main speed/quality knob (``--pareto``): name -> (pager, parameters).
PARETO_SWEEP: dict[str, tuple[str, dict[str, Any]]] = {
    **{f"mdci[fov={f}]": ("mdci", {"field_of_view": f}) for f in (10, 20, 60, 120)},
    **{f"ivf[probe={p}]": ("ivf", {"probe_factor": p}) for p in (1.0, 2.0, 4.0, 16.0)},
    **{f"hnsw[search={f}]": ("hnsw", {"search_factor": f}) for f in (2.0, 4.0)},
    **{f"hnsw[ef={e}]": ("hnsw", {"ef": e}) for e in (16, 32)},
    **{f"hnsw[ef={e}]": ("hnsw", {"ef": e, "search_factor": 2.0}) for e in (256,)},
    **{f"pq[bits={b}]": ("pq", {"bits": b}) for b in (4, 8)},
}


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
