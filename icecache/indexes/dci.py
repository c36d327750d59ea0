"""Dynamic Continuous Indexing: the prioritized single-level search and the multi-level (disjoint-levels)
tree of M-DCI, in Euclidean or MIPS mode, optionally keeping *semantic pages* in a `PageTable`.

This is the index behind the ``mdci`` pager (`icecache.indexes.mdci`), usable on its own::

    idx = DCIIndex(64, metric="mips", seed=0)
    idx.build(keys)                    # float [n, 64]; ids 0..n-1
    idx.insert(more_keys)              # ids continue n, n+1, ...
    ids, dists = idx.query(q, k=10)    # q [64] or a group [g, 64]; dists ascending

The algorithm follows ``DCI_SPEC.md`` (section numbers below refer to it):

* section 1, prioritized DCI: ``M = L * m`` random unit directions from ``numpy.random.Generator(seed)``
  (``L`` = ``num_comp_indices`` composite indices of ``m`` = ``num_simp_indices`` simple indices), the
  members of each cluster kept as ``M`` runs sorted by projection, the prioritized walk with the visit and
  retrieve limits, exact distances for the candidates;
* sections 2-3, the IF/MD variant: every point lives on exactly one level; the level comes from MD's
  deterministic schedule (promotion probabilities ``p0`` for level 0 -> 1 and ``p1`` above); the cluster of
  a node holds the points of the level below whose parent it is (the top level is the cluster of a virtual
  root); a point's parent is the nearest node of the level above (exact brute force when that level has
  <= ``brute_force_threshold`` nodes, else the descent with the construction config); queries run the
  field-of-view beam descent with the coverage rule, *cumulatively* (every node scored on the way down is a
  result candidate);
* section 3, insertion: a new point gets the next level of the schedule and a parent by the construction
  rule; a point promoted to level t > 0 adopts every level-(t-1) node that is strictly closer to it than
  to its current parent (exact scan, margin ``adopt_margin``); when the schedule opens a new top level,
  the new point becomes the only top node and adopts all old top nodes;
* section 4, MIPS: keys are lifted to ``[k, sqrt(msq - |k|^2)]`` (scaled form; ``msq`` >= every squared
  key norm) and queries to ``[c q / |q|, 0]`` with ``c = sqrt(msq)`` (MD uses norm 1; see `_query_proj`
  for why we do not); the query->key distance is ``-<q, k>``; the key->key distance
  (parent choice) is ``msq - <a, b> - sqrt((msq - |a|^2)(msq - |b|^2))``, clamped at 0. When a key longer
  than ``sqrt(msq)`` arrives, ``msq`` becomes ``rekey_headroom`` x its squared norm and the whole structure
  is rebuilt with the same levels (a *rekey*; rare, since every rekey raises ``msq`` by >= 10 % by default),
  so no NaN can appear and every invariant below holds again exactly after it.

Query groups (GQA): a query ``[g, d]`` is one descent; a point's distance is the minimum over the group
(MIPS: ``-max_g <q_g, k>``); every query walks each searched cluster separately (candidates = union); the
beam is ranked by that group distance (``group_beam="shared"``) or kept per query (``"per-query"``).

Pages (section 3, only when a `PageTable` is given): the members of one cluster are stored in pages of at
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
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from icecache.core.errors import ConfigError, InputError, InputTypeError
from icecache.core.pages import PageTable
from icecache.indexes import _dci_kernels as K

Metric = Literal["euclidean", "mips"]


# ---------------------------------------------------------------------------------------------- configs
@dataclass(frozen=True)
class SearchConfig:
    """Stopping rule and beam width of one kind of search (query or construction), DCI_SPEC.md section 1-2.

    Parameters
    ----------
    field_of_view : int or None
        Beam width F: nodes kept at each non-bottom level and expanded into the level below (exceeded only
        to satisfy the coverage rule). ``None`` (query config only) means ``max(int(fov_scale * n), fov_min)``
        with ``n`` the number of indexed points at query time (IceCache's rule).
    num_to_visit, prop_to_visit : int, float
        Visit limit of one cluster search of ``c`` points, in rounds: ``max(num_to_visit * m,
        ceil(prop_to_visit * c * m))``. ``-1`` disables a half; both ``< 0`` means ``prop_to_visit = 1``.
    num_to_retrieve, prop_to_retrieve : int, float
        Retrieve limit (distinct candidates whose exact distance was computed): ``max(num_to_retrieve,
        ceil(prop_to_retrieve * c))``. ``-1`` disables a half; both ``< 0`` means ``prop_to_retrieve`` =
        0.002 (construction) or 0.05 (query), as in the dci-knn wrappers. Proportions are clipped to <= 1.
    """

    field_of_view: int | None = None
    num_to_visit: int = -1
    prop_to_visit: float = 1.0
    num_to_retrieve: int = -1
    prop_to_retrieve: float = 0.8

    def __post_init__(self) -> None:
        if self.field_of_view is not None and (not isinstance(self.field_of_view, (int, np.integer)) or self.field_of_view < 1):
            raise ConfigError(f"field_of_view must be an int >= 1 or None, got {self.field_of_view!r}")
        for name in ("num_to_visit", "num_to_retrieve"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise ConfigError(f"{name} must be an int (-1 disables it), got {v!r}")
        for name in ("prop_to_visit", "prop_to_retrieve"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
                raise ConfigError(f"{name} must be a finite number (-1 disables it), got {v!r}")

    def limits(self, kind: Literal["query", "construction"]) -> tuple[int, float, int, float]:
        """``(num_to_visit, prop_to_visit, num_to_retrieve, prop_to_retrieve)`` after the -1 conventions."""
        ntv, ptv, ntr, ptr = int(self.num_to_visit), float(self.prop_to_visit), int(self.num_to_retrieve), float(self.prop_to_retrieve)
        if ntv < 0 and ptv < 0:
            ptv = 1.0
        if ntr < 0 and ptr < 0:
            ptr = 0.002 if kind == "construction" else 0.05
        return ntv, min(ptv, 1.0), ntr, min(ptr, 1.0)


@dataclass(frozen=True)
class DCIParams:
    """Every knob of the index, with IceCache's values (DCI_SPEC.md section 5, "IceCache -> MD") as defaults.

    Parameters
    ----------
    num_comp_indices : int
        L, composite indices (a point becomes a candidate once seen in all m simple indices of one of them).
    num_simp_indices : int
        m, simple indices (random directions) per composite index.
    p0, p1 : float
        Promotion probabilities of the deterministic level schedule: level 0 -> 1 and every level above.
        Level sizes follow ``|L1| ~ p0 |L0|``, ``|L(l+1)| ~ p1 |L(l)|``; the top level holds <= ceil(1/p).
    construction : SearchConfig
        Parent search (k = 1) when the level above has more than ``brute_force_threshold`` nodes.
    query : SearchConfig
        Query descent. ``field_of_view=None`` uses ``min(max(int(fov_scale * n), fov_min), fov_max)``.
    fov_scale, fov_min, fov_max : float, int, int or None
        The query field-of-view rule when ``query.field_of_view`` is None (``fov_max`` None: no cap).
    brute_force_threshold : int
        Exact parent search when the level above has at most this many nodes (MD: 3000), else the descent
        with the construction config. Used for single inserts.
    bulk_brute_force_threshold : int
        The same threshold for bulk construction (`build`, rekeys), where blocked BLAS brute force over all
        points of a level is several times faster than one descent per point up to about this size (measured:
        126k keys, 3.8k level-1 nodes: 1.3 s vs 11 s) and gives exact parents. Set it equal to
        ``brute_force_threshold`` for MD's behaviour.
    adopt_margin : float
        A promoted node adopts a node of the level below only if it is closer than the current parent by more
        than this (squared-distance units in MIPS mode, distance units in Euclidean mode).
    page_score : {"max", "mass"}
        Page ranking (pagers only). ``"max"`` (IceCache, the spec): a page scores its best scored token,
        ``max_g <q_g, k>``. ``"mass"``: its estimated attention mass, ``sum_t sum_g exp(score_scale *
        (<q_g, k_t> - M_g))`` over its scored tokens, ``M_g`` = the best scored ``<q_g, k>`` (a page with many
        relevant tokens beats a page with one).
    score_scale : float or None
        Softmax temperature of ``"mass"`` (default ``1 / sqrt(d)``, the attention scaling).
    page_split : {"projection", "2means"}
        How a cluster is cut into pages (pagers only). ``"projection"`` (MD, the spec): contiguous runs of the
        projection order (bulk: ceil(c/P) near-equal pages; a full page splits at ``used // 2``; a new token
        joins the page of its run-0 neighbour). ``"2means"``: semantic pages: bulk load cuts a cluster into
        the same ceil(c/P) near-equal groups by recursive balanced 2-means on the raw keys; a new token joins
        the page of its cluster with the nearest centroid; a full page splits into two balanced 2-means
        halves.
    group_beam : {"shared", "per-query"}
        Beam of a query group (GQA): one beam of F nodes ranked by the group distance (``"shared"``, the
        default: one descent per group, token score ``max_g <q_g, k>``), or every query keeps its own F best
        nodes per level and the union is expanded (``"per-query"``, closer to MD's one descent per head; up to
        g times more work, measured -0.002 attention recall@128 for ``"shared"`` on real keys at 8k and
        1.5x less select time at 8k and 128k).
    rekey_headroom : float
        On a rekey (a key longer than ``sqrt(msq)`` arrives) ``msq`` becomes this factor times the new largest
        squared norm, so the next rekey needs a key >= ``sqrt(headroom)`` times longer (>= 1.0).
    """

    num_comp_indices: int = 1
    num_simp_indices: int = 1
    p0: float = 0.03
    p1: float = 0.2
    construction: SearchConfig = field(default_factory=lambda: SearchConfig(field_of_view=30, prop_to_retrieve=1.0))
    query: SearchConfig = field(default_factory=lambda: SearchConfig(field_of_view=None, prop_to_retrieve=0.8))
    fov_scale: float = 1.5e-3
    fov_min: int = 30
    fov_max: int | None = None
    brute_force_threshold: int = 3000
    bulk_brute_force_threshold: int = 20000
    adopt_margin: float = 1e-8
    rekey_headroom: float = 1.1
    page_score: Literal["max", "mass"] = "max"
    score_scale: float | None = None
    page_split: Literal["projection", "2means"] = "projection"
    group_beam: Literal["shared", "per-query"] = "shared"

    def __post_init__(self) -> None:
        for name in ("num_comp_indices", "num_simp_indices", "fov_min"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ConfigError(f"{name} must be an int >= 1, got {v!r}")
        for name in ("p0", "p1"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not 0.0 < v < 1.0:
                raise ConfigError(f"{name} must be a probability in (0, 1), got {v!r}")
        if self.construction.field_of_view is None:
            raise ConfigError("construction.field_of_view must be an int >= 1")
        for name in ("brute_force_threshold", "bulk_brute_force_threshold"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
                raise ConfigError(f"{name} must be an int >= 0, got {v!r}")
        if not self.fov_scale >= 0.0:
            raise ConfigError(f"fov_scale must be >= 0, got {self.fov_scale!r}")
        if self.fov_max is not None and (isinstance(self.fov_max, bool) or not isinstance(self.fov_max, (int, np.integer))
                                         or self.fov_max < self.fov_min):
            raise ConfigError(f"fov_max must be None or an int >= fov_min ({self.fov_min}), got {self.fov_max!r}")
        if not self.adopt_margin >= 0.0:
            raise ConfigError(f"adopt_margin must be >= 0, got {self.adopt_margin!r}")
        if not self.rekey_headroom >= 1.0:
            raise ConfigError(f"rekey_headroom must be >= 1, got {self.rekey_headroom!r}")
        if self.group_beam not in ("per-query", "shared"):
            raise ConfigError(f"group_beam must be 'per-query' or 'shared', got {self.group_beam!r}")
        if self.page_split not in ("projection", "2means"):
            raise ConfigError(f"page_split must be 'projection' or '2means', got {self.page_split!r}")
        if self.page_score not in ("max", "mass"):
            raise ConfigError(f"page_score must be 'max' or 'mass', got {self.page_score!r}")
        if self.score_scale is not None and not self.score_scale > 0.0:
            raise ConfigError(f"score_scale must be > 0 or None, got {self.score_scale!r}")

    @property
    def num_directions(self) -> int:
        return self.num_comp_indices * self.num_simp_indices

    @classmethod
    def preset(cls, name: str) -> "DCIParams":
        """``"icecache"`` (the defaults: MD as IceCache calls it), ``"wide"`` (IceCache's tree with a wider,
        exhaustive query: every token of a visited cluster scored, ``prop_to_retrieve`` 1.0, and the field of
        view ``min(max(7.5e-3 n, 60), 200)``, 5x IceCache's up to 27k tokens, capped so the select time grows
        sublinearly beyond; the `MDCIPager` default, chosen from measurements: see
        ``experiments/bench_index/README.md``) or ``"dci-knn"`` (the dci-knn wrapper defaults: L = 2, m = 7,
        construction F = 10 with prop_to_retrieve 0.002 and no brute force, query F = 100 with
        prop_to_retrieve 0.05; levels still from the MD schedule, disjoint)."""
        if name == "icecache":
            return cls()
        if name == "wide":
            return cls(query=SearchConfig(field_of_view=None, prop_to_retrieve=1.0), fov_scale=7.5e-3, fov_min=60, fov_max=200)
        if name == "dci-knn":
            return cls(
                num_comp_indices=2,
                num_simp_indices=7,
                construction=SearchConfig(field_of_view=10, prop_to_retrieve=0.002),
                query=SearchConfig(field_of_view=100, prop_to_retrieve=0.05),
                brute_force_threshold=0,
                bulk_brute_force_threshold=0,
            )
        raise ConfigError(f"unknown DCI preset {name!r}; known presets: 'icecache', 'wide', 'dci-knn'")


# ---------------------------------------------------------------------------------------------- scratch
_tls = threading.local()


class _Scratch:
    """Per-thread query buffers (stamp-tagged, never cleared); grown on demand."""

    def __init__(self, cap: int, L: int, page_cap: int, G: int) -> None:
        self.cap, self.L, self.page_cap, self.G = cap, L, page_cap, G
        self.cnt = np.zeros((cap, L), np.int32)
        self.gsc = np.zeros((cap, G), np.float64)
        self.cnt_stamp = np.full(cap, -1, np.int64)
        self.cand_stamp = np.full(cap, -1, np.int64)
        self.eval_stamp = np.full(cap, -1, np.int64)
        self.dist = np.zeros(cap, np.float64)
        self.pool = np.zeros(cap, np.int64)
        self.stamp = np.zeros(1, np.int64)
        self.page_best = np.zeros(page_cap, np.float64)
        self.page_stamp = np.full(page_cap, -1, np.int64)
        self.page_list = np.zeros(page_cap, np.int64)
        self.out_pages = np.zeros(page_cap, np.int64)
        self.out_scores = np.zeros(page_cap, np.float64)


def _scratch(n: int, L: int, num_page_ids: int = 0, G: int = 1) -> _Scratch:
    s: _Scratch | None = getattr(_tls, "scratch", None)
    if s is None or s.cap < n or s.L < L or s.page_cap < num_page_ids or s.G < G:
        cap = max(n, 1024) if s is None else max(n, s.cap if s.cap >= n else 2 * s.cap)
        page_cap = max(num_page_ids, 256) if s is None else max(num_page_ids, s.page_cap if s.page_cap >= num_page_ids else 2 * s.page_cap)
        stamp = 0 if s is None else int(s.stamp[0])
        s = _Scratch(cap, max(L, 1 if s is None else s.L), page_cap, max(G, 1 if s is None else s.G))
        s.stamp[0] = stamp
        _tls.scratch = s
    return s


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


# ---------------------------------------------------------------------------------------------- index
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

    Ids are ``0..len-1`` in insertion order. Memory: see `index_bytes`.
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
        self.dim = int(dim)
        self.metric: Metric = metric
        self.params = params if params is not None else DCIParams()
        if not isinstance(self.params, DCIParams):
            raise ConfigError(f"params must be a DCIParams, got {type(self.params).__name__}")
        self.seed = int(seed)
        self.single_level = bool(single_level)
        self.table = table
        self._mips = metric == "mips"
        self._mode_q = 1 if self._mips else 0  # query -> point distance
        self._mode_kk = 2 if self._mips else 0  # point -> point distance (parents)
        M = self.params.num_directions
        dp = self.dim + (1 if self._mips else 0)
        rng = np.random.Generator(np.random.PCG64(self.seed))
        dirs = rng.standard_normal((M, dp))
        dirs /= np.linalg.norm(dirs, axis=1, keepdims=True)
        self._dirs = dirs  # [M, dp] float64 unit rows
        self.num_rekeys = 0
        self._reset()

    # ------------------------------------------------------------------ state
    def _reset(self) -> None:
        M = self.params.num_directions
        self._n = 0
        self._cap = 0
        self._X = np.zeros((0, self.dim), np.float32)
        self._ext = np.zeros(0, np.float32)
        self._proj = np.zeros((0, M), np.float32)
        self._level = np.zeros(0, np.int32)
        self._parent = np.zeros(0, np.int64)
        self._pdist = np.zeros(0, np.float64)
        self._sub = np.zeros(0, np.int64)
        self._cl_start = np.zeros(1, np.int64)
        self._cl_size = np.zeros(1, np.int64)
        self._cl_cap = np.zeros(1, np.int64)
        self._run_key = np.zeros((M, 0), np.float32)
        self._run_id = np.zeros((M, 0), np.int32)
        self._Xr = np.zeros((0, self.dim), np.float32)  # keys in run-0 slab order (see _dci_kernels)
        self._slab_used = 0
        self._msq = 0.0
        self._members: list[np.ndarray] = []  # per level: ids (ascending), growable
        self._members_n: list[int] = []
        self._sched_counts = np.zeros(64, np.int64)  # [63] = number of levels
        self._sched_next = np.zeros(1, np.int64)

    def __len__(self) -> int:
        return self._n

    @property
    def num_levels(self) -> int:
        return len(self._members_n)

    @property
    def msq(self) -> float:
        """MIPS: the squared norm c^2 the keys are lifted with (>= every squared key norm); 0 in Euclidean mode."""
        return self._msq

    def level_sizes(self) -> list[int]:
        """Points per level, bottom (0) first."""
        return list(self._members_n)

    def _grow(self, n: int) -> None:
        if n <= self._cap:
            return
        cap = max(n, 2 * self._cap, 64)

        def grow(a: np.ndarray, fill: float | int, extra: int = 0) -> np.ndarray:
            out = np.full((cap + extra,) + a.shape[1:], fill, a.dtype)
            out[: len(a)] = a
            return out

        self._X = grow(self._X, 0.0)
        self._ext = grow(self._ext, 0.0)
        self._proj = grow(self._proj, 0.0)
        self._level = grow(self._level, -1)
        self._parent = grow(self._parent, -1)
        self._pdist = grow(self._pdist, np.inf)
        self._sub = grow(self._sub, 0)
        self._cl_start = grow(self._cl_start, 0, 1)
        self._cl_size = grow(self._cl_size, 0, 1)
        self._cl_cap = grow(self._cl_cap, 0, 1)
        self._cap = cap

    def _slab_alloc(self, caps: np.ndarray) -> np.ndarray:
        """Reserve blocks of the given capacities at the end of the run slab; returns their starts. When the
        slab is full and more than half of it is garbage left by relocated clusters, it is compacted first."""
        caps = np.asarray(caps, np.int64)
        need = self._slab_used + int(caps.sum())
        if need > self._run_key.shape[1]:
            live = int(self._cl_cap[: self._n + 1].sum())
            if self._slab_used > 2 * live + 256:
                self._compact()
                need = self._slab_used + int(caps.sum())
        starts = self._slab_used + np.cumsum(caps) - caps
        if need > self._run_key.shape[1]:
            cap = max(need, 2 * self._run_key.shape[1], 256)
            M = self._run_key.shape[0]
            rk = np.zeros((M, cap), np.float32)
            ri = np.full((M, cap), -1, np.int32)
            xr = np.zeros((cap, self.dim), np.float32)
            rk[:, : self._slab_used] = self._run_key[:, : self._slab_used]
            ri[:, : self._slab_used] = self._run_id[:, : self._slab_used]
            xr[: self._slab_used] = self._Xr[: self._slab_used]
            self._run_key, self._run_id, self._Xr = rk, ri, xr
        self._slab_used = need
        return starts

    def _compact(self) -> None:
        """Move every cluster block to the front of the slab, in cluster order (drops relocation garbage)."""
        cids = np.flatnonzero(self._cl_cap[: self._n + 1] > 0)
        caps = self._cl_cap[cids]
        new_starts = np.cumsum(caps) - caps
        sizes = self._cl_size[cids]
        src = np.repeat(self._cl_start[cids], sizes) + (np.arange(int(sizes.sum())) - np.repeat(np.cumsum(sizes) - sizes, sizes))
        dst = np.repeat(new_starts, sizes) + (np.arange(int(sizes.sum())) - np.repeat(np.cumsum(sizes) - sizes, sizes))
        rk = self._run_key[:, src]
        ri = self._run_id[:, src]
        xr = self._Xr[src]
        self._run_key[:, dst] = rk
        self._run_id[:, dst] = ri
        self._Xr[dst] = xr
        self._cl_start[cids] = new_starts
        self._slab_used = int(caps.sum())

    def _add_member(self, level: int, t: int) -> None:
        while len(self._members) <= level:
            self._members.append(np.zeros(16, np.int64))
            self._members_n.append(0)
        n = self._members_n[level]
        if n == len(self._members[level]):
            a = np.zeros(2 * n, np.int64)
            a[:n] = self._members[level]
            self._members[level] = a
        self._members[level][n] = t
        self._members_n[level] = n + 1

    def members(self, level: int) -> np.ndarray:
        """Ids on ``level`` (ascending), int64."""
        return self._members[level][: self._members_n[level]]

    # ------------------------------------------------------------------ transforms
    def _lift(self, ids: np.ndarray) -> None:
        """Recompute ``ext`` and projections of ``ids`` from the stored vectors and ``msq``."""
        x = self._X[ids].astype(np.float64)
        p = x @ self._dirs[:, : self.dim].T
        if self._mips:
            e = np.sqrt(np.maximum(self._msq - np.einsum("ij,ij->i", x, x), 0.0))
            self._ext[ids] = e
            p += e[:, None] * self._dirs[None, :, self.dim]
        self._proj[ids] = p.astype(np.float32)

    def _query_proj(self, Q: np.ndarray) -> np.ndarray:
        """Query projections ``[g, M]`` float64. MIPS: of ``c q / |q|`` with ``c = sqrt(msq)`` (a zero query
        projects to 0). MD projects ``q / |q|`` (norm 1) against keys of norm c, which leaves the nearest
        neighbour unchanged but makes the prioritized walk's order unrelated to ``<q, k>`` (DCI_SPEC.md
        section 6); at norm c the walk is a true L2 walk towards ``[c q / |q|, 0]`` in the lifted space."""
        return K.query_projections(np.ascontiguousarray(Q, np.float32), self._dirs, math.sqrt(self._msq), self._mips)

    def point_distance(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """Point-to-point distance used for parents, elementwise over id arrays ``a``, ``b`` (float64):
        Euclidean distance, or the MIPS key-key distance (clamped >= 0)."""
        xa = self._X[a].astype(np.float64)
        xb = self._X[b].astype(np.float64)
        if self._mips:
            v = self._msq - (xa * xb).sum(-1) - self._ext[a].astype(np.float64) * self._ext[b].astype(np.float64)
            return np.maximum(v, 0.0)
        return np.sqrt(((xa - xb) ** 2).sum(-1))

    def _brute_parents(self, nodes: np.ndarray, up: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Exact nearest node of ``up`` for every id in ``nodes`` (BLAS, blocked); ties -> first in ``up``."""
        V = self._X[up].astype(np.float64)
        if self._mips:
            ev = self._ext[up].astype(np.float64)
        else:
            vsq = (V * V).sum(1)
        parents = np.empty(len(nodes), np.int64)
        dists = np.empty(len(nodes), np.float64)
        block = max(1, 4_000_000 // max(len(up), 1))
        for a in range(0, len(nodes), block):
            ids = nodes[a : a + block]
            Xb = self._X[ids].astype(np.float64)
            if self._mips:
                s = Xb @ V.T + self._ext[ids].astype(np.float64)[:, None] * ev[None, :]
                j = np.argmax(s, axis=1)
                dists[a : a + len(ids)] = np.maximum(self._msq - s[np.arange(len(ids)), j], 0.0)
            else:
                s = vsq[None, :] - 2.0 * (Xb @ V.T)
                j = np.argmin(s, axis=1)
                dists[a : a + len(ids)] = np.sqrt(np.maximum(s[np.arange(len(ids)), j] + (Xb * Xb).sum(1), 0.0))
            parents[a : a + len(ids)] = up[j]
        return parents, dists

    def _search_parents(self, nodes: np.ndarray, level: int, bulk: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """Parents (nearest node on ``level + 1``) by the construction rule: brute force or descent."""
        up = self.members(level + 1)
        limit = self.params.bulk_brute_force_threshold if bulk else self.params.brute_force_threshold
        if len(up) <= limit:
            return self._brute_parents(nodes, up)
        cfg = self.params.construction
        ntv, ptv, ntr, ptr = cfg.limits("construction")
        s = _scratch(self._cap, self.params.num_comp_indices)
        out_p = np.empty(len(nodes), np.int64)
        out_d = np.empty(len(nodes), np.float64)
        K.assign_parents(
            np.ascontiguousarray(nodes, np.int64), self._X, self._Xr, self._ext, self._proj, self._mode_kk, float(self._msq),
            self._run_key, self._run_id, self._cl_start, self._cl_size, self._sub,
            self.num_levels - 1, level + 1, self.params.num_comp_indices, self.params.num_simp_indices, int(cfg.field_of_view),
            ntv, ptv, ntr, ptr, s.cnt, s.cnt_stamp, s.cand_stamp, s.eval_stamp, s.dist, s.stamp, s.pool, s.gsc, out_p, out_d,
        )
        if (out_p < 0).any():  # cannot happen: every level's top-down search reaches some node of level + 1
            raise RuntimeError("DCI parent search found no node on the level above (internal bug)")
        return out_p, out_d

    # ------------------------------------------------------------------ bulk construction
    def build(self, data: Any) -> None:
        """Index ``data`` ``[n, d]`` (float; n may be 0) from scratch; ids ``0..n-1``. Clears the page table."""
        x = _as_data(data, self.dim, "data")
        self._reset()
        if self.table is not None:
            self.table.clear()
        n = x.shape[0]
        if n == 0:
            return
        self._grow(n)
        self._X[:n] = x
        self._n = n
        if self.single_level:
            levels = np.zeros(n, np.int32)
        else:
            levels = np.empty(n, np.int64)
            new_top = np.empty(n, np.bool_)
            K.md_schedule(n, self._sched_counts, self._sched_next, float(self.params.p0), float(self.params.p1),
                          _cap_of(self.params.p0), _cap_of(self.params.p1), levels, new_top)
        self._level[:n] = levels
        if self._mips:
            self._msq = float((x.astype(np.float64) ** 2).sum(1).max())
        for lev in range(int(levels.max()) + 1):
            ids = np.flatnonzero(levels == lev).astype(np.int64)
            self._members.append(np.concatenate([ids, np.zeros(max(16, len(ids)), np.int64)]))
            self._members_n.append(len(ids))
        self._construct()

    def _construct(self) -> None:
        """Build parents, cluster runs, subtree counts (and pages) for the current points and levels."""
        n = self._n
        ids = np.arange(n, dtype=np.int64)
        self._lift(ids)
        self._parent[:n] = -1
        self._pdist[:n] = np.inf
        self._sub[:n] = 0
        self._cl_start[: n + 1] = 0
        self._cl_size[: n + 1] = 0
        self._cl_cap[: n + 1] = 0
        self._slab_used = 0
        top = self.num_levels - 1
        self._make_clusters(np.array([-1], np.int64), self.members(top), np.full(self._members_n[top], -1, np.int64))
        for lev in range(top - 1, -1, -1):
            nodes = self.members(lev)
            par, _ = self._search_parents(nodes, lev, bulk=True)
            self._parent[nodes] = par
            # Direct formula (not the BLAS expansion) so adoption compares like with like.
            self._pdist[nodes] = self.point_distance(nodes, par)
            self._make_clusters(self.members(lev + 1), nodes, par)
        for lev in range(top):
            nodes = self.members(lev)
            if len(nodes):
                w = np.bincount(self._parent[nodes], weights=1 + self._sub[nodes], minlength=n)
                self._sub[:n] += w[:n].astype(np.int64)
        if self.table is not None:
            self._bulk_pages()

    def _make_clusters(self, owners: np.ndarray, children: np.ndarray, parents: np.ndarray) -> None:
        """Allocate the clusters of ``owners`` (node ids, -1 = root) and fill them with ``children``
        (whose parents are ``parents``), every run sorted by (projection, id)."""
        cid_owner = owners + 1
        counts = np.bincount(parents + 1, minlength=self._n + 1)[cid_owner] if len(children) else np.zeros(len(owners), np.int64)
        caps = counts + counts // 4 + 2
        starts = self._slab_alloc(caps)
        self._cl_start[cid_owner] = starts
        self._cl_size[cid_owner] = counts
        self._cl_cap[cid_owner] = caps
        if len(children) == 0:
            return
        cid = parents + 1
        for j in range(self._proj.shape[1]):
            order = np.lexsort((children, self._proj[children, j], cid))
            ch, cc = children[order], cid[order]
            rank = np.arange(len(ch)) - np.searchsorted(cc, cc, side="left")
            pos = self._cl_start[cc] + rank
            self._run_key[j, pos] = self._proj[ch, j]
            self._run_id[j, pos] = ch
            if j == 0:
                self._Xr[pos] = self._X[ch]

    def _cluster_run0(self, cid: int) -> np.ndarray:
        s, c = int(self._cl_start[cid]), int(self._cl_size[cid])
        return self._run_id[0, s : s + c].astype(np.int64)

    def _even_groups(self, seg: np.ndarray) -> list[np.ndarray]:
        """Cut a cluster (ids in run-0 order) into ceil(c / P) groups whose sizes differ by <= 1: contiguous
        in run-0 order (``page_split="projection"``) or by recursive balanced 2-means (``"2means"``)."""
        assert self.table is not None
        c = len(seg)
        k = -(-c // self.table.page_size)
        if self.params.page_split == "2means" and k > 1:
            seg = np.ascontiguousarray(seg, np.int64).copy()
            K.kway_order(self._X, seg, k, _SPLIT_ITERS)
        b = (np.arange(k + 1) * c) // k
        return [seg[b[i] : b[i + 1]] for i in range(k)]

    def _bulk_pages(self) -> None:
        assert self.table is not None
        groups: list[np.ndarray] = []
        for cid in np.flatnonzero(self._cl_size[: self._n + 1] > 0):
            groups.extend(self._even_groups(self._cluster_run0(int(cid))))
        if self.table.num_positions == 0:
            self.table.new_pages(groups)
        else:
            self._repage(groups)

    def _repage(self, groups: list[np.ndarray]) -> None:
        """Make the table hold exactly ``groups`` (pages that already match one are kept), by moves."""
        tb = self.table
        assert tb is not None
        for g in groups:
            p = int(tb.page_of_[g[0]])
            if p >= 0 and int(tb.sizes_[p]) == len(g) and bool((tb.page_of_[g] == p).all()):
                continue
            q = tb.new_page()
            for pos in g:
                if tb.page_of_[pos] >= 0:
                    tb.move(int(pos), q)
                else:
                    tb.append(q, int(pos))

    # ------------------------------------------------------------------ insertion
    def insert(self, data: Any) -> None:
        """Add ``data`` ``[m, d]``; ids continue ``len .. len + m - 1``. Each point gets the next level of the
        schedule and is inserted as described in the module docstring."""
        x = _as_data(data, self.dim, "data")
        m = x.shape[0]
        if m == 0:
            return
        if self.single_level:
            levels = np.zeros(m, np.int64)
            new_top = np.zeros(m, np.bool_)
            if self._n == 0:
                new_top[0] = True
        else:
            levels = np.empty(m, np.int64)
            new_top = np.empty(m, np.bool_)
            K.md_schedule(m, self._sched_counts, self._sched_next, float(self.params.p0), float(self.params.p1),
                          _cap_of(self.params.p0), _cap_of(self.params.p1), levels, new_top)
        sq = (x.astype(np.float64) ** 2).sum(1)
        for i in range(m):
            self._insert_one(x[i], float(sq[i]), int(levels[i]), bool(new_top[i]))

    def _insert_one(self, v: np.ndarray, sq: float, t: int, new_top: bool) -> None:
        if self._mips and sq > self._msq:
            if self._n == 0:
                self._msq = sq
            else:  # rekey: lift everything again with more headroom and rebuild the structure
                self._msq = sq * self.params.rekey_headroom
                self.num_rekeys += 1
                self._construct()
        x = self._n
        self._grow(x + 1)
        self._X[x] = v
        self._n = x + 1
        self._level[x] = t
        self._parent[x] = -1
        self._pdist[x] = np.inf
        self._sub[x] = 0
        self._cl_start[x + 1] = 0
        self._cl_size[x + 1] = 0
        self._cl_cap[x + 1] = 0
        self._lift(np.array([x]))
        if new_top:
            # The new point is the only node of a new top level and adopts every old top node.
            old = self._cluster_run0(0)
            self._cl_start[x + 1], self._cl_size[x + 1], self._cl_cap[x + 1] = self._cl_start[0], self._cl_size[0], self._cl_cap[0]
            if len(old):
                self._parent[old] = x
                self._pdist[old] = self.point_distance(old, np.full(len(old), x))
            self._sub[x] = x  # every earlier point is below it
            self._cl_start[0] = self._slab_alloc(np.array([4]))[0]
            self._cl_size[0] = 0
            self._cl_cap[0] = 4
            self._add_member(t, x)
            self._cluster_add(0, x)  # the old root pages now belong to x's cluster unchanged
            return
        top = self.num_levels - 1
        if t == top:
            par = -1
        else:
            p, d = self._parent_of_one(x, t)
            par = p
            self._pdist[x] = d
        self._parent[x] = par
        self._cluster_add(par + 1, x)
        self._path_add(par, 1)
        self._add_member(t, x)
        if t > 0:
            self._adopt(x, t)

    def _parent_of_one(self, x: int, t: int) -> tuple[int, float]:
        up = self.members(t + 1)
        if len(up) <= self.params.brute_force_threshold:
            p, d = K.brute_nearest_one(x, up, self._X, self._ext, self._mode_kk, float(self._msq))
            return int(p), float(d)
        p_arr, d_arr = self._search_parents(np.array([x], np.int64), t)
        return int(p_arr[0]), float(d_arr[0])

    def _path_add(self, node: int, delta: int) -> None:
        while node >= 0:
            self._sub[node] += delta
            node = int(self._parent[node])

    def _cluster_add(self, cid: int, x: int) -> None:
        size = int(self._cl_size[cid])
        if size == self._cl_cap[cid]:
            self._relocate(cid, 2 * size + 4)
        start = int(self._cl_start[cid])
        semantic = self.table is not None and self.params.page_split == "2means" and size > 0
        if semantic:
            before = self._run_id[0, start : start + size].astype(np.int64)
        pos = int(K.cluster_insert(self._run_key, self._run_id, self._Xr, start, size, self._proj[x], x, self._X[x]))
        self._cl_size[cid] = size + 1
        if self.table is None:
            return
        tb = self.table
        if size == 0:
            tb.new_page([x])
            return
        if tb.page_size == 1:  # nothing to split: every token is a page of its own
            tb.new_page([x])
            return
        if semantic:
            p = int(K.nearest_page(x, before, tb.page_of_, self._X))
            if tb.sizes_[p] >= tb.page_size:
                q = self._split_page(p, -1)
                both = np.concatenate([tb.members[p, : tb.sizes_[p]], tb.members[q, : tb.sizes_[q]]])
                p = int(K.nearest_page(x, both, tb.page_of_, self._X))
            tb.append(p, x)
            return
        nb = int(self._run_id[0, start + pos - 1]) if pos > 0 else int(self._run_id[0, start + 1])
        p = int(tb.page_of_[nb])
        if tb.sizes_[p] < tb.page_size:
            tb.append(p, x)
            return
        new = self._split_page(p, -1)
        holder = new if tb.page_of_[nb] == new else p
        tb.append(holder, x)
        # a half may now fit together with a small run-0 neighbour (one left behind by an adoption)
        self._merge_small_page(p)
        self._merge_small_page(new)

    def _split_page(self, p: int, keep_with: int) -> int:
        """Split page ``p`` at used // 2 in run-0 order (upper half to a new page); returns the page that
        now holds ``keep_with`` (the new page when ``keep_with`` is -1)."""
        tb = self.table
        assert tb is not None
        ids = tb.members[p, : tb.sizes_[p]].copy()
        if self.params.page_split == "2means":
            K.kway_order(self._X, ids, 2, _SPLIT_ITERS)  # halves of a balanced 2-means split
            upper = ids[len(ids) // 2 :]
        else:
            order = np.lexsort((ids, self._proj[ids, 0]))
            upper = ids[order[len(ids) // 2 :]]
        q = tb.split(p, move_slots=tb.slot_of_[upper])
        return q if keep_with == -1 or keep_with in set(upper.tolist()) else p

    def _relocate(self, cid: int, cap: int) -> None:
        old, size = int(self._cl_start[cid]), int(self._cl_size[cid])
        new = int(self._slab_alloc(np.array([cap]))[0])
        self._run_key[:, new : new + size] = self._run_key[:, old : old + size]
        self._run_id[:, new : new + size] = self._run_id[:, old : old + size]
        self._Xr[new : new + size] = self._Xr[old : old + size]
        self._cl_start[cid] = new
        self._cl_cap[cid] = cap

    def _adopt(self, x: int, t: int) -> None:
        """Promoted node ``x`` (level t > 0) takes every level-(t-1) node strictly closer to it than to
        its parent (exact scan)."""
        ys = self.members(t - 1)
        if len(ys) == 0:
            return
        stolen = ys[K.adopt_scan(x, ys, self._X, self._ext, self._pdist, self._mode_kk, float(self._msq), float(self.params.adopt_margin))]
        if len(stolen) == 0:
            return
        d_new = self.point_distance(stolen, np.full(len(stolen), x))
        moved = 0
        shrunk = np.unique(self.table.page_of_[stolen]) if self.table is not None else None  # pages that lose points
        for y in stolen:
            y = int(y)
            op = int(self._parent[y])
            cid = op + 1
            K.cluster_remove(self._run_key, self._run_id, self._Xr, int(self._cl_start[cid]), int(self._cl_size[cid]), y)
            self._cl_size[cid] -= 1
            self._path_add(op, -(1 + int(self._sub[y])))
            moved += 1 + int(self._sub[y])
        self._parent[stolen] = x
        self._pdist[stolen] = d_new
        cid = x + 1
        cap = len(stolen) + len(stolen) // 4 + 2
        if cap > self._cl_cap[cid]:
            self._cl_start[cid] = self._slab_alloc(np.array([cap]))[0]
            self._cl_cap[cid] = cap
        self._cl_size[cid] = 0
        self._fill_cluster(cid, stolen)
        self._path_add(x, moved)
        if self.table is not None:
            tb = self.table
            for g in self._even_groups(self._cluster_run0(cid)):
                q = tb.new_page()
                for pos in g:
                    tb.move(int(pos), q)
            if self.params.page_split == "projection":
                for p in shrunk:
                    self._merge_small_page(int(p))

    def _merge_small_page(self, p: int) -> None:
        """After points left page ``p`` (an adoption) or ``p`` was split: while ``p`` and a run-0 neighbour page
        of its cluster fit in one page and one of them holds fewer than ``P // 2`` points, move the smaller into
        the larger (contiguity in run-0 order is kept). Without this, adoptions leave ever more small pages
        behind: keys of width 16, page 8, grown one at a time from 1k to 20k gave page fill 0.56 (0.71 with
        merging) against 0.89 when built at once, so 1.6x the pages to rank, load and hold."""
        tb = self.table
        assert tb is not None
        P = tb.page_size
        while 0 <= p < len(tb.sizes_) and tb.sizes_[p] > 0:
            cid = int(self._parent[int(tb.members[p, 0])]) + 1
            seg = self._cluster_run0(cid)
            at = np.flatnonzero(tb.page_of_[seg] == p)
            nbrs = [int(tb.page_of_[seg[i]]) for i in (at[0] - 1, at[-1] + 1) if 0 <= i < len(seg)]
            sp = int(tb.sizes_[p])
            fit = [q for q in nbrs if sp + int(tb.sizes_[q]) <= P and min(sp, int(tb.sizes_[q])) < P // 2]
            if not fit:
                return
            q = min(fit, key=lambda r: int(tb.sizes_[r]))
            src, dst = (p, q) if sp <= int(tb.sizes_[q]) else (q, p)
            for pos in tb.members[src, : tb.sizes_[src]].copy()[::-1]:
                tb.move(int(pos), dst)  # the emptied page is freed
            p = dst

    def _fill_cluster(self, cid: int, members: np.ndarray) -> None:
        """Write ``members`` as the (empty, large enough) cluster ``cid``'s sorted runs."""
        start = int(self._cl_start[cid])
        for j in range(self._proj.shape[1]):
            order = np.lexsort((members, self._proj[members, j]))
            self._run_key[j, start : start + len(members)] = self._proj[members[order], j]
            self._run_id[j, start : start + len(members)] = members[order]
            if j == 0:
                self._Xr[start : start + len(members)] = self._X[members[order]]
        self._cl_size[cid] = len(members)

    # ------------------------------------------------------------------ queries
    def field_of_view(self) -> int:
        """The query beam width F for the current size."""
        f = self.params.query.field_of_view
        if f is None:
            f = max(int(self.params.fov_scale * self._n), self.params.fov_min)
            if self.params.fov_max is not None:
                f = min(f, self.params.fov_max)
        return int(f)

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
        if self._n == 0 or k == 0:
            return np.zeros(0, np.int64), np.zeros(0, np.float64)
        cfg = config if config is not None else self.params.query
        F = cfg.field_of_view if cfg.field_of_view is not None else self.field_of_view()
        ntv, ptv, ntr, ptr = cfg.limits("query")
        s = _scratch(self._cap, self.params.num_comp_indices)
        lo, hi = K.descend(
            Q, self._query_proj(Q), np.zeros(Q.shape[0], np.float32), self._mode_q, float(self._msq), self._X, self._Xr, self._ext,
            self._run_key, self._run_id, self._cl_start, self._cl_size, self._sub,
            self.num_levels - 1, 0, self.params.num_comp_indices, self.params.num_simp_indices, int(F), int(k),
            int(k) if k > 1 else 0, True, ntv, ptv, ntr, ptr,
            s.cnt, s.cnt_stamp, s.cand_stamp, s.eval_stamp, s.dist, s.stamp, s.pool, s.gsc, False,
            self.params.group_beam == "per-query",
        )
        ids = s.pool[lo:hi].copy()
        d = s.dist[lo:hi].copy()
        order = np.lexsort((ids, d))[: min(k, len(ids))]
        return ids[order], d[order]

    def rank_pages(self, Q: np.ndarray, budget: int) -> tuple[np.ndarray, np.ndarray]:
        """Pages for the GQA group ``Q`` ``[g, d]`` (float32), best first (score = best ``max_g q.k`` among
        the scored tokens of the page), as many as fit in ``budget`` tokens. MIPS index with a table only.

        Returns ``(page_ids int64 [j], scores float32 [j])``.
        """
        tb = self.table
        if tb is None or not self._mips:
            raise RuntimeError("rank_pages needs a MIPS index with a page table")
        Q = np.ascontiguousarray(Q, np.float32)
        P = tb.page_size
        kk = max(1, -(-budget // P))
        s = _scratch(self._cap, self.params.num_comp_indices, tb.id_capacity, Q.shape[0])
        ntv, ptv, ntr, ptr = self.params.query.limits("query")
        scale = self.params.score_scale if self.params.score_scale is not None else 1.0 / math.sqrt(self.dim)
        j = K.rank_pages(
            Q, self._query_proj(Q), self._X, self._Xr, self._run_key, self._run_id, self._cl_start, self._cl_size, self._sub,
            self.num_levels - 1, self.params.num_comp_indices, self.params.num_simp_indices, self.field_of_view(), kk,
            int(budget), ntv, ptv, ntr, ptr,
            s.cnt, s.cnt_stamp, s.cand_stamp, s.eval_stamp, s.dist, s.stamp, s.pool, s.gsc,
            self.params.group_beam == "per-query", tb.page_of_, tb.sizes_, int(budget), self.params.page_score == "mass", float(scale), s.page_best, s.page_stamp, s.page_list, s.out_pages, s.out_scores,
        )
        return s.out_pages[:j].copy(), s.out_scores[:j].astype(np.float32)

    # ------------------------------------------------------------------ introspection
    def levels(self) -> np.ndarray:
        """Level of every point ``[n]`` int32."""
        return self._level[: self._n].copy()

    def parents(self) -> np.ndarray:
        """Parent id of every point ``[n]`` int64 (-1 = the virtual root, i.e. a top-level point)."""
        return self._parent[: self._n].copy()

    def cluster(self, node: int, run: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """Members of ``node``'s cluster (-1 = root) in the order of simple index ``run``:
        ``(ids int64 [c], projections float32 [c])``."""
        cid = node + 1
        s, c = int(self._cl_start[cid]), int(self._cl_size[cid])
        return self._run_id[run, s : s + c].astype(np.int64), self._run_key[run, s : s + c].copy()

    def subtree_sizes(self) -> np.ndarray:
        """Number of descendants of every point ``[n]`` int64."""
        return self._sub[: self._n].copy()

    def projections(self) -> np.ndarray:
        """Stored projections ``[n, M]`` float32 (MIPS: of the lifted keys)."""
        return self._proj[: self._n].copy()

    def directions(self) -> np.ndarray:
        """The random unit directions ``[M, d]`` (``[M, d + 1]`` in MIPS mode), float64."""
        return self._dirs.copy()

    def data(self) -> np.ndarray:
        """The stored vectors ``[n, d]`` float32."""
        return self._X[: self._n].copy()

    def index_bytes(self) -> int:
        """Bytes of the index structures for the current points (directions, projections, sorted runs
        including their spare capacity, the run-ordered copy of the keys the searches stream, tree arrays,
        page table); not counting the stored vectors by id (the keys themselves) nor the per-thread query
        scratch."""
        n = self._n
        M = self.params.num_directions
        b = self._dirs.nbytes + n * M * 4  # projections
        b += self._slab_used * M * (4 + 4)  # run keys + ids
        b += self._slab_used * self.dim * 4  # keys in run-0 order
        b += (n + 1) * 3 * 8  # cluster start/size/capacity
        b += n * (4 + 8 + 8 + 8)  # level, parent, parent distance, descendants
        if self._mips:
            b += n * 4  # ext
        if self.table is not None:
            tb = self.table
            b += tb.id_capacity * (tb.page_size + 1) * 8 + n * 2 * 8
        return int(b)

    def check(self) -> None:
        """Raise AssertionError if a structural invariant is broken (DCI_SPEC.md section 7.4, 7.11; O(n log n))."""
        n = self._n
        M = self.params.num_directions
        if n == 0:
            assert self.num_levels == 0 and (self.table is None or self.table.num_positions == 0)
            return
        lev = self._level[:n]
        par = self._parent[:n]
        top = self.num_levels - 1
        assert sum(self._members_n) == n
        for l in range(self.num_levels):
            assert np.array_equal(np.sort(self.members(l)), np.flatnonzero(lev == l)), f"member list of level {l}"
        is_top = lev == top
        assert (par[is_top] == -1).all() and (par[~is_top] >= 0).all(), "only top-level points hang off the root"
        nt = ~is_top
        assert (lev[par[nt]] == lev[nt] + 1).all(), "a parent is not on the next level up"
        # Stored projections equal recomputed ones.
        if self._mips:
            x = self._X[:n].astype(np.float64)
            e = np.sqrt(np.maximum(self._msq - (x * x).sum(1), 0.0))
            assert ((x * x).sum(1) <= self._msq * (1 + 1e-12)).all(), "a key is longer than sqrt(msq)"
            assert np.allclose(self._ext[:n], e, rtol=1e-5, atol=1e-5 * math.sqrt(max(self._msq, 1e-30)))
            x = np.concatenate([x, e[:, None]], 1)
        else:
            x = self._X[:n].astype(np.float64)
        proj = x @ self._dirs.T
        tol = 1e-6 * (1.0 + np.abs(x).max())
        assert np.allclose(self._proj[:n], proj, rtol=1e-6, atol=tol), "stored projections differ from recomputed ones"
        # Clusters: each run sorted by (key, id) and a permutation of the node's children.
        seen = np.zeros(n, np.int64)
        for cid in np.flatnonzero(self._cl_size[: n + 1] > 0):
            node = int(cid) - 1
            kids0 = None
            for j in range(M):
                ids, keys = self.cluster(node, j)
                assert (keys[:-1] <= keys[1:]).all(), f"run {j} of cluster {node} is not sorted"
                tie = keys[:-1] == keys[1:]
                assert (ids[:-1][tie] < ids[1:][tie]).all(), f"run {j} of cluster {node}: ties not ordered by id"
                assert np.array_equal(keys, self._proj[ids, j]), "run keys differ from projections"
                if j == 0:
                    s0 = int(self._cl_start[cid])
                    assert np.array_equal(self._Xr[s0 : s0 + len(ids)], self._X[ids]), f"run-ordered keys of cluster {node} are stale"
                srt = np.sort(ids)
                if kids0 is None:
                    kids0 = srt
                else:
                    assert np.array_equal(srt, kids0), "runs of a cluster are not permutations of each other"
            assert (par[kids0] == node).all(), f"cluster {node} holds a point with another parent"
            assert self._cl_size[cid] <= self._cl_cap[cid]
            seen[kids0] += 1
        assert (seen == 1).all(), "every point is in exactly one cluster"
        assert (self._cl_size[1 : n + 1][lev == 0] == 0).all(), "level-0 points own no cluster"
        # Descendant counts.
        sub = np.zeros(n, np.int64)
        for l in range(top):
            ids = self.members(l)
            np.add.at(sub, par[ids], 1 + sub[ids])
        assert np.array_equal(sub, self._sub[:n]), "descendant counts are stale"
        assert int(sub[self.members(top)].sum()) + self._members_n[top] == n
        if self.table is not None:
            self._check_pages()

    def _check_pages(self) -> None:
        tb = self.table
        assert tb is not None
        n = self._n
        tb.check()
        assert tb.num_positions == n and (tb.page_of_[:n] >= 0).all(), "every point is in a page"
        for cid in np.flatnonzero(self._cl_size[: n + 1] > 0):
            ids, keys = self.cluster(int(cid) - 1, 0)
            pg = tb.page_of_[ids]
            # Pages hold only this cluster's points (and, for projection pages, are contiguous in run-0 order).
            if self.params.page_split == "projection":
                change = np.flatnonzero(pg[1:] != pg[:-1])
                seq = np.concatenate([pg[:1], pg[change + 1]])
                assert len(np.unique(seq)) == len(seq), f"a page of cluster {int(cid) - 1} is not contiguous in run-0 order"
                # no two neighbouring pages that fit in one while one is under half full (`_merge_small_page`)
                sz = tb.sizes_[seq]
                small = (np.minimum(sz[1:], sz[:-1]) < tb.page_size // 2) & (sz[1:] + sz[:-1] <= tb.page_size)
                assert not small.any(), f"cluster {int(cid) - 1} has two neighbouring pages that fit in one, one under half full"
            else:
                seq = np.unique(pg)
            assert int(tb.sizes_[seq].sum()) == len(ids), f"a page of cluster {int(cid) - 1} holds foreign points"


_SPLIT_ITERS = 4  # 2-means steps per bisection of page_split="2means"


def _cap_of(p: float) -> int:
    """ceil(1 / p), robust to rounding (ceil(1/0.2) = 5, ceil(1/0.03) = 34)."""
    return int(math.ceil(1.0 / p - 1e-9))


class PrioritizedDCI(DCIIndex):
    """Single-level prioritized DCI (DCI_SPEC.md section 1): every point in one cluster, searched by the
    prioritized walk with the visit and retrieve limits. Same API as `DCIIndex`.

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
