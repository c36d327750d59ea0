"""``mdci``: IceCache's reference pager. Semantic pages from a multi-level DCI tree (M-DCI) over the keys of
one (layer, KV head), ranked by a cumulative MIPS descent per GQA group.

Based on IceCache (arXiv 2604.10539) and its index back end M-DCI; the algorithm is specified in
``DCI_SPEC.md`` and implemented by `icecache.indexes.dci.DCIIndex` (MIPS mode, with the pager's
`PageTable`). Pages: every cluster (the children of one tree node; the top level's tokens are the children
of a virtual root) is stored in pages of at most ``page_size`` tokens, contiguous in projection order.
Selection: one descent for the whole GQA group, token score ``max_g q_g . k``; a page's score is the best
score among its scored tokens; pages are taken best first under the budget rule.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import torch

from icecache.core.errors import ConfigError
from icecache.core.pager import SemanticPager
from icecache.indexes.dci import DCIIndex, DCIParams, SearchConfig
from icecache.indexes.registry import register_pager


@register_pager("mdci")
class MDCIPager(SemanticPager):
    """M-DCI semantic pager (IceCache). Defaults: the ``"wide"`` preset, IceCache's parameters (DCI_SPEC.md
    section 5, "IceCache -> MD") with an exhaustive, 5x wider query; ``preset="icecache"`` gives the
    published ones exactly.

    Parameters
    ----------
    head_dim : int
        Key/query width d.
    page_size : int
        Page capacity P in tokens.
    seed : int
        Seed of the random projection directions (levels are deterministic).
    record_moves : bool
        Journal page layout changes in ``self.table`` for a host store.
    preset : {"wide", "icecache", "dci-knn"}
        Starting point of the parameters below (see `DCIParams.preset`); explicit arguments override it.
        ``"wide"`` (default) differs from ``"icecache"`` in the query only: ``prop_to_retrieve`` 1.0 and the
        field of view ``min(max(7.5e-3 n, 60), 200)``. Measured at 8k real keys (``experiments/bench_index/README.md``): attention
        recall@256 0.892 vs 0.886 (SmolLM2) and 0.678 vs 0.641 (Gemma-3), three quarters of the way to the
        own-pages oracle, for 1.5x / 2.8x the select time; Gemma-3's needle at 8k and 16k and SmolLM2's
        needles found where ``"icecache"`` misses them.
    num_comp_indices, num_simp_indices : int, optional
        L composite indices of m simple indices (IceCache: 1 x 1; dci-knn: 2 x 7).
    p0, p1 : float, optional
        Promotion probabilities of the level schedule (level 0 -> 1, and above): 0.03 and 0.2.
    field_of_view : int, optional
        Query beam width F (nodes expanded per level). Default ``min(max(int(fov_scale * n), fov_min),
        fov_max)`` with ``n`` the indexed tokens ("wide": ``min(max(int(7.5e-3 n), 60), 200)``; "icecache":
        ``max(int(1.5e-3 n), 30)``, no cap).
    fov_scale, fov_min, fov_max : float, int, int, optional
        The default field-of-view rule. The wide preset's cap of 200 keeps select time sublinear in n: at
        128k real keys 3.5x faster than exact scoring with 0.97 of the uncapped recall (which is 0.82x of
        exact's speed; ``experiments/bench_index/scaling_*``).
    prop_to_retrieve : float, optional
        Query retrieve limit as a share of each searched cluster ("wide": 1.0; "icecache": 0.8).
    construction_field_of_view : int, optional
        Beam width of parent searches that do not use brute force (30).
    construction_prop_to_retrieve : float, optional
        Retrieve limit of those parent searches (1.0: exhaustive inside each cluster).
    brute_force_threshold : int, optional
        Exact parent search for inserted tokens when the level above has at most this many nodes (3000).
    bulk_brute_force_threshold : int, optional
        The same for `build` and rekeys (20000; blocked BLAS, faster than per-token descents here).
    page_score : {"max", "mass"}, optional
        Page ranking: the best scored token (``"max"``, IceCache) or the page's estimated attention mass
        over its scored tokens (``"mass"``); see `DCIParams`.
    score_scale : float, optional
        Softmax temperature of ``"mass"`` (default ``1 / sqrt(head_dim)``).
    group_beam : {"shared", "per-query"}, optional
        One beam for the GQA group ranked by ``max_g q.k`` (default) or one per query head; see `DCIParams`.
    page_split : {"projection", "2means"}, optional
        Pages as contiguous runs of the projection order (``"projection"``, IceCache/MD) or semantic
        2-means groups inside each cluster (``"2means"``); see `DCIParams`.

    Notes
    -----
    The descent for a budget of B tokens asks each bottom cluster search for ``ceil(B / P)`` results and
    applies the coverage rule with B descendant tokens. `index_bytes` counts the tree, the sorted runs, the
    page table and a second copy of the keys kept in cluster (run-0) order, which the searches stream
    instead of gathering one scattered row per scored token (84 selects at 8k on SmolLM2: 35 -> 22 ms
    round robin, `experiments/bench_runtime/bench_runtime.md`); not the copy of the keys by token id that the
    construction uses (that is the KV itself).
    """

    def __init__(
        self,
        head_dim: int,
        page_size: int = 16,
        seed: int = 0,
        *,
        record_moves: bool = False,
        preset: str = "wide",
        num_comp_indices: int | None = None,
        num_simp_indices: int | None = None,
        p0: float | None = None,
        p1: float | None = None,
        field_of_view: int | None = None,
        fov_scale: float | None = None,
        fov_min: int | None = None,
        fov_max: int | None = None,
        prop_to_retrieve: float | None = None,
        construction_field_of_view: int | None = None,
        construction_prop_to_retrieve: float | None = None,
        brute_force_threshold: int | None = None,
        bulk_brute_force_threshold: int | None = None,
        page_score: str | None = None,
        score_scale: float | None = None,
        page_split: str | None = None,
        group_beam: str | None = None,
    ) -> None:
        super().__init__(head_dim, page_size, seed, record_moves=record_moves)
        params = DCIParams.preset(preset)
        top: dict[str, Any] = {
            k: v
            for k, v in dict(
                num_comp_indices=num_comp_indices, num_simp_indices=num_simp_indices, p0=p0, p1=p1,
                fov_scale=fov_scale, fov_min=fov_min, fov_max=fov_max, brute_force_threshold=brute_force_threshold,
                bulk_brute_force_threshold=bulk_brute_force_threshold,
                page_score=page_score, score_scale=score_scale, page_split=page_split,
                group_beam=group_beam,
            ).items()
            if v is not None
        }
        query: dict[str, Any] = {k: v for k, v in dict(field_of_view=field_of_view, prop_to_retrieve=prop_to_retrieve).items() if v is not None}
        cons: dict[str, Any] = {
            k: v
            for k, v in dict(field_of_view=construction_field_of_view, prop_to_retrieve=construction_prop_to_retrieve).items()
            if v is not None
        }
        try:
            params = replace(params, query=replace(params.query, **query), construction=replace(params.construction, **cons), **top)
        except TypeError as exc:  # pragma: no cover - all names above are fields
            raise ConfigError(str(exc)) from None
        self.params = params
        self.index = DCIIndex(head_dim, metric="mips", params=params, seed=seed, table=self.table)

    def _build(self, keys: torch.Tensor) -> None:
        self.index.build(keys.numpy())

    def _insert(self, keys: torch.Tensor, start: int) -> None:
        if start != len(self.index):  # the base class numbers positions; the index numbers ids: they agree
            raise RuntimeError(f"mdci: position {start} != index size {len(self.index)} (internal bug)")
        self.index.insert(keys.numpy())

    def _rank_pages(self, queries: torch.Tensor, budget: int) -> tuple[np.ndarray, np.ndarray]:
        return self.index.rank_pages(queries.numpy(), budget)

    def index_bytes(self) -> int:
        return self.index.index_bytes()


__all__ = ["MDCIPager", "DCIParams", "SearchConfig"]
