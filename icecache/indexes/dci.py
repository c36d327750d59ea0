"""Dynamic Continuous Indexing: the prioritized single-level search and the multi-level (disjoint-levels)
tree of M-DCI, in Euclidean or MIPS mode, optionally keeping *semantic pages* in a `PageTable`.

This is the index behind the ``mdci`` pager (`icecache.indexes.mdci`), usable on its own::

    idx = DCIIndex(64, metric="mips", seed=0)
    idx.build(keys)                    # float [n, 64]; ids 0..n-1
    idx.insert(more_keys)              # ids continue n, n+1, ...
    ids, dists = idx.query(q, k=10)    # q [64] or a group [g, 64]; dists ascending

The algorithm is described in ``docs/index.md`` (the section names below are its headings):

* "Prioritized search inside one cluster": ``M = L * m`` random unit directions from
  ``numpy.random.Generator(seed)`` (``L`` = ``num_comp_indices`` composite indices of ``m`` =
  ``num_simp_indices`` simple indices), the members of each cluster kept as ``M`` runs sorted by projection,
  the prioritized walk with the visit and retrieve limits, exact distances for the candidates;
* "Levels, clusters and the promotion schedule", "Bulk construction", "Query descent and field of view": every
  point lives on exactly one level; the level comes from MD's deterministic schedule (promotion probabilities
  ``p0`` for level 0 -> 1 and ``p1`` above); the cluster of a node holds the points of the level below whose
  parent it is (the top level is the cluster of a virtual root); a point's parent is the nearest node of the
  level above (exact brute force when that level has <= ``brute_force_threshold`` nodes, else the descent with
  the construction config); queries run the field-of-view beam descent with the coverage rule, *cumulatively*
  (every node scored on the way down is a result candidate);
* "Incremental insert": a new point gets the next level of the schedule and a parent by the construction
  rule; a point promoted to level t > 0 adopts every level-(t-1) node that is strictly closer to it than
  to its current parent (exact scan, margin ``adopt_margin``); when the schedule opens a new top level,
  the new point becomes the only top node and adopts all old top nodes;
* "MIPS to L2 transform": keys are lifted to ``[k, sqrt(msq - |k|^2)]`` (scaled form; ``msq`` >= every squared
  key norm) and queries to ``[c q / |q|, 0]`` with ``c = sqrt(msq)`` (MD uses norm 1; see `DCITree.query_proj`
  for why we do not); the query->key distance is ``-<q, k>``; the key->key distance
  (parent choice) is ``msq - <a, b> - sqrt((msq - |a|^2)(msq - |b|^2))``, clamped at 0. When a key longer
  than ``sqrt(msq)`` arrives, ``msq`` becomes ``rekey_headroom`` x its squared norm and the whole structure
  is rebuilt with the same levels (a *rekey*; rare, since every rekey raises ``msq`` by >= 10 % by default),
  so no NaN can appear and every invariant below holds again exactly after it.

Query groups (GQA): a query ``[g, d]`` is one descent; a point's distance is the minimum over the group
(MIPS: ``-max_g <q_g, k>``); every query walks each searched cluster separately (candidates = union); the
beam is ranked by that group distance (``group_beam="shared"``) or kept per query (``"per-query"``).

Pages ("Pages and splits", only when a `PageTable` is given): the members of one cluster are stored in pages of at
most ``P`` tokens; with ``page_split="projection"`` (MD) they are contiguous in the run-0 order (projection
on the first direction, ties by id): bulk load splits a cluster of ``c`` members into ``ceil(c / P)`` pages
of near-equal size, inserting into a full page first splits it at ``used // 2`` in that order; with
``"2means"`` the same page counts and sizes come from balanced 2-means bisection and a new point joins the
nearest page centroid. Adopted points move into fresh pages of their new cluster; with ``"projection"``, a
page they left, and both halves of a split, merge with a run-0 neighbour page when the two fit in one and one
is under half full (so no two neighbouring pages could be one page while one is under half); a rekey re-pages every
cluster (pages whose members do not change are kept). Every token is in exactly one page. All page layout
changes go through `PageTable` methods, so its move journal is complete. `rank_pages` ranks pages by their
best scored token (or estimated attention mass, ``page_score="mass"``); pages without a scored token follow
when the budget is larger than what the descent scored.

Deviations from MD, deliberate and tested: the level schedule continues across `build` and every `insert`
(MD restarts it per inserted batch); a batch is inserted one point at a time (MD builds and merges a batch
tree); the coverage rule counts descendant points (MD counts pages); a small page merges with a run-0
neighbour only when the two fit in one page (MD also borrows from a neighbour below ``P / 2``); MIPS queries
are projected at norm ``sqrt(msq)``; a GQA group is one descent (MD runs one query per head and unions the
pages).

Thread safety: one index is used by one thread at a time; different indexes may run in parallel threads
(kernels release the GIL; per-thread scratch). Results never depend on the thread count.
Layout: this module is the facade (`DCIIndex`, `PrioritizedDCI`) over one state object and three jobs:
`icecache.indexes.dci_params` (`DCIParams`, `SearchConfig`, presets), `icecache.indexes.dci_tree` (`DCITree`:
the arrays, their upkeep, introspection and invariants), `icecache.indexes.dci_build` (bulk construction),
`icecache.indexes.dci_search` (queries and page ranking) and `icecache.indexes.dci_update` (insertion, adoption,
page splits and merges); the compiled kernels are in `icecache.indexes._dci_kernels` (searches) and `icecache.indexes._dci_edit_kernels` (edits).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from icecache.core.errors import ConfigError, InputError, InputTypeError
from icecache.core.pages import PageTable
from icecache.indexes import dci_build, dci_search, dci_update
from icecache.indexes.dci_params import DCIParams, Metric, SearchConfig
from icecache.indexes.dci_tree import DCITree


def _as_data(x: Any, d: int, name: str) -> np.ndarray:
    """float32 C-contiguous ``[n, d]`` copy-free view of a numpy array or CPU tensor; checks finiteness."""
    if hasattr(x, "detach") and hasattr(x, "numpy"):
        x = x.detach().cpu().numpy()
    if not isinstance(x, np.ndarray):
        raise InputTypeError(f"{name} must be a numpy array or torch tensor, got {type(x).__name__}")
    if not np.issubdtype(x.dtype, np.floating):
        raise InputTypeError(f"{name} must hold floats, got dtype {x.dtype}")
    if x.ndim != 2 or x.shape[1] != d:
        raise InputError(f"{name} must have shape [n, {d}], got {list(x.shape)}")
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.size and not np.isfinite(x).all():
        raise InputError(f"{name} holds NaN or inf values (or values beyond float32 range)")
    return x


class DCIIndex:
    """Multi-level prioritized DCI with disjoint levels (the M-DCI variant IceCache uses).

    Parameters
    ----------
    dim : int
        Vector width d.
    metric : {"euclidean", "mips"}
        ``"euclidean"``: nearest by L2 distance. ``"mips"``: largest inner product, via the section-4
        transform; the reported distance is ``-<q, x>``.
    params : DCIParams, optional
        Algorithm parameters (default: IceCache's).
    seed : int
        Seed of the random directions (``numpy.random.Generator(PCG64(seed))``); levels are deterministic.
    table : PageTable, optional
        Keep semantic pages of the clusters in this table (its page size is P).
    single_level : bool
        Put every point on one level (a flat prioritized DCI; the multi-level knobs are unused).

    Ids are ``0..len-1`` in insertion order. Memory: see `index_bytes`. The state lives in ``self.tree``
    (a `DCITree`); read it through the methods below.
    """

    def __init__(
        self,
        dim: int,
        metric: Metric = "euclidean",
        params: DCIParams | None = None,
        seed: int = 0,
        *,
        table: PageTable | None = None,
        single_level: bool = False,
    ) -> None:
        if isinstance(dim, bool) or not isinstance(dim, (int, np.integer)) or dim < 1:
            raise InputError(f"dim must be an int >= 1, got {dim!r}")
        if metric not in ("euclidean", "mips"):
            raise ConfigError(f"metric must be 'euclidean' or 'mips', got {metric!r}")
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise InputError(f"seed must be an int >= 0, got {seed!r}")
        params = params if params is not None else DCIParams()
        if not isinstance(params, DCIParams):
            raise ConfigError(f"params must be a DCIParams, got {type(params).__name__}")
        self.tree = DCITree(int(dim), metric, params, int(seed), table, bool(single_level))

    # ------------------------------------------------------------------ settings
    @property
    def dim(self) -> int:
        return self.tree.dim

    @property
    def metric(self) -> Metric:
        return self.tree.metric

    @property
    def params(self) -> DCIParams:
        return self.tree.params

    @property
    def seed(self) -> int:
        return self.tree.seed

    @property
    def single_level(self) -> bool:
        return self.tree.single_level

    @property
    def table(self) -> PageTable | None:
        return self.tree.table

    # ------------------------------------------------------------------ the three jobs
    def build(self, data: Any) -> None:
        """Index ``data`` ``[n, d]`` (float; n may be 0) from scratch; ids ``0..n-1``. Clears the page table."""
        dci_build.build(self.tree, _as_data(data, self.dim, "data"))

    def insert(self, data: Any, *, check: bool = True) -> None:
        """Add ``data`` ``[m, d]``; ids continue ``len .. len + m - 1``. Each point gets the next level of the
        schedule and is inserted as described in the module docstring. ``check=False`` skips validation: only
        for a finite, C-contiguous float32 numpy array of the right shape (a pager's checked insert)."""
        dci_update.insert(self.tree, _as_data(data, self.dim, "data") if check else data)

    def query(self, q: Any, k: int, *, config: SearchConfig | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The ``min(k, n)`` nearest points of ``q`` ``[d]`` (or a group ``[g, d]``: distance = min over it).

        Returns ``(ids int64 [min(k, n)], dists float64)`` sorted by distance ascending (ties by id).
        Distances: Euclidean ``|x - q|``; MIPS ``-<q, x>``. ``config`` overrides ``params.query``.
        """
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 0:
            raise InputError(f"k must be an int >= 0, got {k!r}")
        if hasattr(q, "ndim") and q.ndim == 1:
            q = q.reshape(1, -1)
        Q = _as_data(q, self.dim, "q")
        if Q.shape[0] == 0:
            raise InputError("q must not be empty")
        if len(self) == 0 or k == 0:
            return np.zeros(0, np.int64), np.zeros(0, np.float64)
        return dci_search.query(self.tree, Q, k, config if config is not None else self.params.query)

    def rank_pages(self, Q: np.ndarray, budget: int) -> tuple[np.ndarray, np.ndarray]:
        """Pages for the GQA group ``Q`` ``[g, d]`` (float32), best first (score = best ``max_g q.k`` among
        the scored tokens of the page), as many as fit in ``budget`` tokens. MIPS index with a table only.

        Returns ``(page_ids int64 [j], scores float32 [j])``.
        """
        return dci_search.rank_pages(self.tree, Q, budget)

    def field_of_view(self) -> int:
        """The query beam width F for the current size."""
        return dci_search.field_of_view(self.tree)

    # ------------------------------------------------------------------ introspection
    def __len__(self) -> int:
        return self.tree.num_points

    @property
    def num_levels(self) -> int:
        return self.tree.num_levels

    @property
    def num_rekeys(self) -> int:
        """MIPS: how many times a longer key made the whole structure be rebuilt."""
        return self.tree.num_rekeys

    @property
    def msq(self) -> float:
        """MIPS: the squared norm c^2 the keys are lifted with (>= every squared key norm); 0 in Euclidean mode."""
        return self.tree.msq

    def level_sizes(self) -> list[int]:
        """Points per level, bottom (0) first."""
        return list(self.tree.level_counts)

    def members(self, level: int) -> np.ndarray:
        """Ids on ``level`` (ascending), int64."""
        return self.tree.members(level)

    def levels(self) -> np.ndarray:
        """Level of every point ``[n]`` int32."""
        return self.tree.level_of[: len(self)].copy()

    def parents(self) -> np.ndarray:
        """Parent id of every point ``[n]`` int64 (-1 = the virtual root, i.e. a top-level point)."""
        return self.tree.parent_of[: len(self)].copy()

    def cluster(self, node: int, run: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """Members of ``node``'s cluster (-1 = root) in the order of simple index ``run``:
        ``(ids int64 [c], projections float32 [c])``."""
        return self.tree.cluster(node, run)

    def subtree_sizes(self) -> np.ndarray:
        """Number of descendants of every point ``[n]`` int64."""
        return self.tree.num_descendants[: len(self)].copy()

    def projections(self) -> np.ndarray:
        """Stored projections ``[n, M]`` float32 (MIPS: of the lifted keys)."""
        return self.tree.proj[: len(self)].copy()

    def directions(self) -> np.ndarray:
        """The random unit directions ``[M, d]`` (``[M, d + 1]`` in MIPS mode), float64."""
        return self.tree.dirs.copy()

    def data(self) -> np.ndarray:
        """The stored vectors ``[n, d]`` float32."""
        return self.tree.vectors[: len(self)].copy()

    def point_distance(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """Point-to-point distance used for parents, elementwise over id arrays ``a``, ``b`` (float64):
        Euclidean distance, or the MIPS key-key distance (clamped >= 0)."""
        return self.tree.point_distance(a, b)

    def index_bytes(self) -> int:
        """Bytes of the index structures for the current points (directions, projections, sorted runs
        including their spare capacity, the run-ordered copy of the keys the searches stream, tree arrays,
        page table); not counting the stored vectors by id (the keys themselves) nor the per-thread query
        scratch."""
        return self.tree.index_bytes()

    def check(self) -> None:
        """Raise AssertionError if a structural invariant is broken (docs/index.md, Invariants 4 and 11; O(n log n))."""
        self.tree.check()


class PrioritizedDCI(DCIIndex):
    """Single-level prioritized DCI (docs/index.md, Prioritized search inside one cluster): every point in one
    cluster, searched by the prioritized walk with the visit and retrieve limits. Same API as `DCIIndex`.

    Parameters
    ----------
    dim : int
        Vector width d.
    metric : {"euclidean", "mips"}
        Distance (``|x - q|``) or maximum inner product (distance reported as ``-<q, x>``).
    num_comp_indices, num_simp_indices : int
        L composite indices of m simple indices (dci-knn: 2 and 7).
    query : SearchConfig, optional
        Default stopping rule of `query` (default ``SearchConfig()``: prop_to_retrieve 0.8, visit limit off).
    seed : int
        Seed of the random directions.
    """

    def __init__(
        self,
        dim: int,
        metric: Metric = "euclidean",
        num_comp_indices: int = 2,
        num_simp_indices: int = 7,
        query: SearchConfig | None = None,
        seed: int = 0,
    ) -> None:
        params = DCIParams(num_comp_indices=num_comp_indices, num_simp_indices=num_simp_indices, query=query or SearchConfig())
        super().__init__(dim, metric, params, seed, single_level=True)


__all__ = ["DCIIndex", "DCIParams", "DCITree", "Metric", "PrioritizedDCI", "SearchConfig"]
