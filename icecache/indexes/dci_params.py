"""Parameters of the DCI index (`icecache.indexes.dci.DCIIndex`): the stopping rule of one kind of search
(`SearchConfig`) and every knob of the index (`DCIParams`), with the named presets and the flat keyword names
that pagers and the command line use to override single knobs (`DCIParams.with_overrides`).
The algorithm and every knob: ``docs/index.md`` (Parameters and presets).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from typing import Any, ClassVar, Literal

import numpy as np

from icecache.core.errors import ConfigError

Metric = Literal["euclidean", "mips"]


@dataclass(frozen=True)
class SearchConfig:
    """Stopping rule and beam width of one kind of search (query or construction); docs/index.md, Prioritized
    search inside one cluster and Query descent.

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
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise ConfigError(f"{name} must be an int (-1 disables it), got {value!r}")
        for name in ("prop_to_visit", "prop_to_retrieve"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                raise ConfigError(f"{name} must be a finite number (-1 disables it), got {value!r}")

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
    """Every knob of the index, with IceCache's published values as defaults (docs/index.md, Parameters and presets).

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
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ConfigError(f"{name} must be an int >= 1, got {value!r}")
        for name in ("p0", "p1"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not 0.0 < value < 1.0:
                raise ConfigError(f"{name} must be a probability in (0, 1), got {value!r}")
        if self.construction.field_of_view is None:
            raise ConfigError("construction.field_of_view must be an int >= 1")
        for name in ("brute_force_threshold", "bulk_brute_force_threshold"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
                raise ConfigError(f"{name} must be an int >= 0, got {value!r}")
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

    #: names of the presets (`preset`)
    PRESETS: ClassVar[tuple[str, ...]] = ("icecache", "wide", "dci-knn")

    @property
    def num_directions(self) -> int:
        """M = L * m, the number of random directions."""
        return self.num_comp_indices * self.num_simp_indices

    @classmethod
    def preset(cls, name: str) -> DCIParams:
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

    @classmethod
    def override_names(cls) -> tuple[str, ...]:
        """The flat names `with_overrides` takes: every field except the two `SearchConfig` ones, then the
        query config's fields by their own names (``field_of_view``, ``prop_to_retrieve``, ...), then the
        construction config's fields prefixed ``construction_``."""
        top = tuple(param.name for param in fields(cls) if param.name not in _SEARCH_FIELDS)
        return top + tuple(_FLAT_SEARCH_NAMES)

    def with_overrides(self, **overrides: Any) -> DCIParams:
        """A validated copy with the knobs named in `override_names` changed; a ``None`` value keeps the current
        value (so every override has a "not given" spelling, as on the command line). An unknown name raises
        `ConfigError` listing the accepted names.

        ``DCIParams.preset("icecache").with_overrides(field_of_view=30, page_score="mass")`` sets
        ``query.field_of_view`` and ``page_score``.
        """
        known = self.override_names()
        unknown = [name for name in overrides if name not in known]
        if unknown:
            raise ConfigError(f"DCIParams has no parameter {', '.join(map(repr, unknown))}; its parameters: {', '.join(known)}")
        top: dict[str, Any] = {}
        search: dict[str, dict[str, Any]] = {name: {} for name in _SEARCH_FIELDS}
        for name, value in overrides.items():
            if value is None:
                continue
            if name in _FLAT_SEARCH_NAMES:
                config, config_field = _FLAT_SEARCH_NAMES[name]
                search[config][config_field] = value
            else:
                top[name] = value
        return replace(
            self, query=replace(self.query, **search["query"]), construction=replace(self.construction, **search["construction"]), **top
        )


_SEARCH_FIELDS = ("construction", "query")  # the DCIParams fields that are a SearchConfig
_SEARCH_CONFIG_NAMES = tuple(config_field.name for config_field in fields(SearchConfig))
#: flat override name -> (DCIParams field, SearchConfig field)
_FLAT_SEARCH_NAMES: dict[str, tuple[str, str]] = {
    **{name: ("query", name) for name in _SEARCH_CONFIG_NAMES},
    **{f"construction_{name}": ("construction", name) for name in _SEARCH_CONFIG_NAMES},
}


__all__ = ["DCIParams", "Metric", "SearchConfig"]

