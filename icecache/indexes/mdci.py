"""``mdci``: IceCache's reference pager. Semantic pages from a multi-level DCI tree (M-DCI) over the keys of
one (layer, KV head), ranked by a cumulative MIPS descent per GQA group.

Based on IceCache (arXiv 2604.10539) and its index back end M-DCI; the algorithm is described in
``docs/index.md`` and implemented by `icecache.indexes.dci.DCIIndex` (MIPS mode, with the pager's
`PageTable`). Pages: every cluster (the children of one tree node; the top level's tokens are the children
of a virtual root) is stored in pages of at most ``page_size`` tokens, contiguous in projection order.
Selection: one descent for the whole GQA group, token score ``max_g q_g . k``; a page's score is the best
score among its scored tokens; pages are taken best first under the budget rule.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import numpy as np
import torch

from icecache.core.errors import ConfigError
from icecache.core.pager import SemanticPager
from icecache.indexes.dci import DCIIndex, DCIParams, SearchConfig
from icecache.indexes.dci_decode_insert import insert_layer_stored, insert_one_stored, qualifies
from icecache.indexes.dci_layer import layer_compatible, rank_pages_layer
from icecache.indexes.page_scan import layer_rank_pages_exhaustive, rank_pages_exhaustive
from icecache.indexes.registry import register_pager, unknown_parameter_error
from icecache.kernels.library import native_kernels

#: how a select ranks the pages (see `MDCIPager`'s ``search``)
SEARCH_MODES = ("tree", "exhaustive")


@register_pager("mdci")
class MDCIPager(SemanticPager):
    """M-DCI semantic pager (IceCache). Defaults: the ``"wide"`` preset, IceCache's parameters (docs/index.md,
    Parameters and presets) with an exhaustive, 5x wider query; ``preset="icecache"`` gives the
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
    params : DCIParams or str, optional
        The index parameters, or the name of a preset (see `DCIParams.preset`); default ``"wide"``.
        ``"wide"`` differs from ``"icecache"`` in the query only: ``prop_to_retrieve`` 1.0 and the field of
        view ``min(max(7.5e-3 n, 60), 200)``. Measured at 8k real keys (``experiments/bench_index/README.md``): attention
        recall@256 0.892 vs 0.886 (SmolLM2) and 0.678 vs 0.641 (Gemma-3), three quarters of the way to the
        own-pages oracle, for 1.5x / 2.8x the select time; Gemma-3's needle at 8k and 16k and SmolLM2's
        needles found where ``"icecache"`` misses them.
    preset : {"wide", "icecache", "dci-knn"}, optional
        The same as ``params=<name>``: the spelling of ``IceCacheConfig.index_params`` and ``--index-params``
        (``mdci[preset=icecache]``). Give ``params`` or ``preset``, not both.
    search : {"tree", "exhaustive"}, optional
        How a select ranks the pages: the tree's descent (``"tree"``, default: reads a fraction of the keys), or
        every key scored and each page ranked by its best key (``"exhaustive"``,
        `icecache.indexes.page_scan`: the ranking the descent approximates, with no search miss, for one scan
        of all the keys; ``index="auto"``'s choice below its crossover). The pages are the same either way.
    **overrides
        Single knobs changed on top of ``params`` (`DCIParams.with_overrides`; ``None`` keeps the value; an
        unknown name raises `ConfigError` listing them all). The usual ones:

        num_comp_indices, num_simp_indices : int
            L composite indices of m simple indices (IceCache: 1 x 1; dci-knn: 2 x 7).
        p0, p1 : float
            Promotion probabilities of the level schedule (level 0 -> 1, and above): 0.03 and 0.2.
        field_of_view : int
            Query beam width F (nodes expanded per level). Default ``min(max(int(fov_scale * n), fov_min),
            fov_max)`` with ``n`` the indexed tokens ("wide": ``min(max(int(7.5e-3 n), 60), 200)``; "icecache":
            ``max(int(1.5e-3 n), 30)``, no cap).
        fov_scale, fov_min, fov_max : float, int, int
            The default field-of-view rule. The wide preset's cap of 200 keeps select time sublinear in n: at
            128k real keys 3.5x faster than exact scoring with 0.97 of the uncapped recall (which is 0.82x of
            exact's speed; ``experiments/bench_index/scaling_*``).
        prop_to_retrieve : float
            Query retrieve limit as a share of each searched cluster ("wide": 1.0; "icecache": 0.8). The other
            query limits have their `SearchConfig` names (``num_to_visit``, ``prop_to_visit``, ``num_to_retrieve``).
        construction_field_of_view : int
            Beam width of parent searches that do not use brute force (30).
        construction_prop_to_retrieve : float
            Retrieve limit of those parent searches (1.0: exhaustive inside each cluster); the other
            construction limits are ``construction_`` + their `SearchConfig` name.
        brute_force_threshold : int
            Exact parent search for inserted tokens when the level above has at most this many nodes (3000).
        bulk_brute_force_threshold : int
            The same for `build` and rekeys (20000; blocked BLAS, faster than per-token descents here).
        page_score : {"max", "mass"}
            Page ranking: the best scored token (``"max"``, IceCache) or the page's estimated attention mass
            over its scored tokens (``"mass"``); see `DCIParams`.
        score_scale : float
            Softmax temperature of ``"mass"`` (default ``1 / sqrt(head_dim)``).
        group_beam : {"shared", "per-query"}
            One beam for the GQA group ranked by ``max_g q.k`` (default) or one per query head; see `DCIParams`.
        page_split : {"projection", "2means"}
            Pages as contiguous runs of the projection order (``"projection"``, IceCache/MD) or semantic
            2-means groups inside each cluster (``"2means"``); see `DCIParams`.

        Also ``adopt_margin`` and ``rekey_headroom`` (see `DCIParams`).

    Notes
    -----
    The descent for a budget of B tokens asks each bottom cluster search for ``ceil(B / P)`` results and
    applies the coverage rule with B descendant tokens. `index_bytes` counts the tree, the sorted runs, the
    page table and a second copy of the keys kept in cluster (run-0) order, which the searches stream
    instead of gathering one scattered row per scored token (84 selects at 8k on SmolLM2: 35 -> 22 ms
    round robin, `experiments/bench_runtime/bench_runtime.md`); not the copy of the keys by token id that the
    construction uses (that is the KV itself).

    Examples
    --------
    These three pagers have the same parameters, so they select the same pages::

        MDCIPager(64, params=DCIParams.preset("icecache").with_overrides(field_of_view=30))
        MDCIPager(64, preset="icecache", field_of_view=30)
        make_pager("mdci", head_dim=64, preset="icecache", field_of_view=30)
    """

    def __init__(
        self,
        head_dim: int,
        page_size: int = 16,
        seed: int = 0,
        *,
        record_moves: bool = False,
        params: DCIParams | str | None = None,
        preset: str | None = None,
        layer_select: bool = True,
        search: str = "tree",
        **overrides: Any,
    ) -> None:
        unknown = [name for name in overrides if name not in DCIParams.override_names()]
        if unknown:
            raise unknown_parameter_error("mdci", unknown, ("record_moves", "params", "preset", "layer_select",
                                                            "search", *DCIParams.override_names()))
        if not isinstance(layer_select, bool):
            raise ConfigError(f"mdci: layer_select must be true or false, got {layer_select!r}")
        if search not in SEARCH_MODES:
            raise ConfigError(f"mdci: search must be one of {', '.join(SEARCH_MODES)}, got {search!r}")
        super().__init__(head_dim, page_size, seed, record_moves=record_moves)
        self.layer_select = layer_select
        self.search = search
        if params is not None and preset is not None:
            raise ConfigError(f"mdci: give params or preset, not both (got params={params!r}, preset={preset!r})")
        base = params if params is not None else preset if preset is not None else "wide"
        if isinstance(base, str):
            base = DCIParams.preset(base)
        elif not isinstance(base, DCIParams):
            raise ConfigError(f"mdci: params must be a DCIParams or a preset name, got {type(base).__name__}")
        self.params = base.with_overrides(**overrides)
        self.index = DCIIndex(head_dim, metric="mips", params=self.params, seed=seed, table=self.table)

    def _build(self, keys: torch.Tensor) -> None:
        self.index.build(keys.numpy())

    def _insert(self, keys: torch.Tensor, start: int) -> None:
        if start != len(self.index):  # the base class numbers positions; the index numbers ids: they agree
            raise RuntimeError(f"mdci: position {start} != index size {len(self.index)} (internal bug)")
        self.index.insert(keys.numpy(), check=False)  # `SemanticPager.insert` has checked or was told it may skip

    stores_inserts = True

    def insert_one_stored(self, key: np.ndarray, rows: np.ndarray, block_of: np.ndarray, new_k: np.ndarray,
                          new_v: np.ndarray) -> bool:
        """`SemanticPager.insert_one_stored`: the common decode insert (a level-0 leaf appended to a page with a
        host block) as one compiled call with the store write (`icecache.indexes.dci_decode_insert`); the tree,
        pages and store end as through `insert` + the store's replay."""
        tree = self.index.tree
        if self._n != tree.num_points:
            raise RuntimeError(f"mdci: position {self._n} != index size {tree.num_points} (internal bug)")
        if not qualifies(tree):
            return super().insert_one_stored(key, rows, block_of, new_k, new_v)
        stored = insert_one_stored(tree, key, rows, block_of, new_k, new_v)
        self._n += 1
        return stored

    @classmethod
    def insert_layer_stored(cls, pagers: Sequence[SemanticPager], keys: np.ndarray, rows: list[np.ndarray],
                            block_ofs: list[np.ndarray], new_k: np.ndarray, new_v: np.ndarray) -> list[bool]:
        """`insert_one_stored` for every pager of a layer row at once: ``keys`` ``[H, d]`` (finite, C-contiguous
        float32; unchecked), each pager's store ``rows[h]`` / ``block_ofs[h]`` and K/V ``new_k[h]`` / ``new_v[h]``
        (``[H, head_dim]``, the stores' raw dtype). The heads whose tree `qualifies` go through one call
        (`icecache.indexes.dci_decode_insert.insert_layer_stored`), the others one by one. Returns, per head,
        whether the store was written (False: replay the table's journal)."""
        heads = cast(list[MDCIPager], list(pagers))
        trees = [p.index.tree for p in heads]
        for pager, tree in zip(heads, trees):
            if pager._n != tree.num_points:
                raise RuntimeError(f"mdci: position {pager._n} != index size {tree.num_points} (internal bug)")
        fast = [h for h, tree in enumerate(trees) if qualifies(tree)]
        stored = [False] * len(heads)
        if len(fast) == len(heads):  # the usual case: no copies
            done = insert_layer_stored(trees, np.ascontiguousarray(keys), rows, block_ofs, np.ascontiguousarray(new_k),
                                       np.ascontiguousarray(new_v))
        elif fast:
            done = insert_layer_stored([trees[h] for h in fast], np.ascontiguousarray(keys[fast]), [rows[h] for h in fast],
                                       [block_ofs[h] for h in fast], new_k[fast], new_v[fast])
        if fast:
            for h, ok in zip(fast, done):
                stored[h] = ok
                heads[h]._n += 1
        for h in range(len(heads)):
            if h not in fast:
                # through the class: an instance's own (possibly wrapped, e.g. timed) method is not this call
                stored[h] = type(heads[h]).insert_one_stored(heads[h], keys[h], rows[h], block_ofs[h], new_k[h], new_v[h])
        return stored

    def _rank_pages(self, queries: torch.Tensor, budget: int) -> tuple[np.ndarray, np.ndarray]:
        if self.search == "exhaustive":
            tree = self.index.tree
            q = queries.detach().to(torch.float32).contiguous().numpy()
            return rank_pages_exhaustive(q, tree.vectors, tree.num_points, self.table.page_of_, self.table.id_capacity,
                                         budget, self.select_threads)
        tree = self.index.tree
        if native_kernels() is not None and layer_compatible([tree]):  # the layer path's kernel: the same floats
            return rank_pages_layer([tree], queries.numpy()[None], budget)[0]
        return self.index.rank_pages(queries.numpy(), budget)

    @classmethod
    def _select_layer(cls, pagers: Sequence[SemanticPager], queries: torch.Tensor,
                      budget: int) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]] | None:
        """`SemanticPager.select_layer_positions`: the page ranking of all heads in one compiled call
        (`icecache.indexes.dci_layer.rank_pages_layer`, on ``select_threads`` threads). None when one call cannot
        serve them (an empty pager, differing parameters): select them one by one."""
        pagers = cast(list[MDCIPager], list(pagers))
        trees = [p.index.tree for p in pagers]
        if all(p.search == "exhaustive" for p in pagers):
            if any(t.num_points == 0 for t in trees):
                return None
            ranked = layer_rank_pages_exhaustive(
                queries.numpy(), tuple(t.vectors for t in trees), np.array([t.num_points for t in trees]),
                tuple(p.table.page_of_ for p in pagers), np.array([p.table.id_capacity for p in pagers]), budget,
                pagers[0].select_threads)
        elif any(p.search == "exhaustive" for p in pagers) or not layer_compatible(trees):
            return None
        else:
            ranked = [page_ids for page_ids, _ in rank_pages_layer(trees, queries.numpy(), budget,
                                                                    pagers[0].select_threads)]
        out = []
        for pager, page_ids in zip(pagers, ranked):
            j, indptr, positions = pager.table.take_within_budget(page_ids, budget)
            out.append((page_ids[:j], indptr, positions))
        return out

    def index_bytes(self) -> int:
        return self.index.index_bytes()


__all__ = ["DCIParams", "MDCIPager", "SearchConfig"]
