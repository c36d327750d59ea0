"""Page hit rate and bytes per step: selection traces, their summaries, and a parametric model fitted to them.

The timing engine does not decide how many pages a step copies; this module does (docs/simulator_anchors.md, Hit rate is an input).

*Trace format* (what the runtime records with ``IceCacheConfig(trace=True)``), one JSON object per line,
one line per (decode step, layer, KV head)::

    {"step": 3, "layer": 5, "kv_head": 1, "pages": [17, 4, 9], "tokens": 41, "new_pages": 1, "bytes": 8192}

``new_pages`` counts the selected pages that were not resident at the previous step (they are copied),
``bytes`` the bytes copied for them. An optional first line ``{"meta": {...}}`` carries the configuration
(``budget``, ``page_size``, ``context``, ``variant``, ``model``, ...); without it, pass ``meta=`` to `read_trace`.

*Quantities* (all per (layer, KV head) and step, averaged):

- ``page_hit_rate``: fraction of selected pages already resident from the previous step (not copied). This is
  the residency hit rate that sets the bytes moved; it is not the top-B hit rate of docs/method.md, Definitions.
- ``fill``: tokens per selected page / page_size (semantic pages are not always full).
- ``budget_use``: selected tokens / budget (whole pages stop short of the budget).

`ParametricHitModel` fits ``logit(q) = c0 + c1 ln B + c2 ln P + c3 ln n`` for each quantity and variant by
ridge-regularised least squares over trace summaries; `PriorHitModel` is the no-trace fallback (every selected
page copied every step: an upper bound on bytes).
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from icecache.core.errors import ConfigError, InputError
from icecache.core.report import json_objects
from icecache.sim.predictors import ExtrapolationError, ExtrapolationWarning, check_policy

RECORD_FIELDS: tuple[str, ...] = ("step", "layer", "kv_head", "pages", "tokens", "new_pages", "bytes")
QUANTITIES: tuple[str, ...] = ("page_hit_rate", "fill", "budget_use")


@dataclass(frozen=True)
class HitStats:
    """Per (layer, KV head) and step averages that set the pages and bytes a decode step moves."""

    page_hit_rate: float
    fill: float
    budget_use: float
    source: str

    def __post_init__(self) -> None:
        for name in QUANTITIES:
            v = getattr(self, name)
            if not (0.0 <= v <= 1.0):
                raise ConfigError(f"HitStats.{name} must be in [0, 1], got {v}")
        if self.fill == 0.0 or self.budget_use == 0.0:
            raise ConfigError("HitStats.fill and budget_use must be > 0")


class HitModel(Protocol):
    """Anything that predicts `HitStats` for a configuration."""

    def predict(self, variant: str, budget: int, page_size: int, context: int, notes: list[str] | None = None) -> HitStats: ...


@dataclass(frozen=True)
class PriorHitModel:
    """No trace: every selected page is new every step, pages are full and the budget is used (upper bound)."""

    page_hit_rate: float = 0.0
    fill: float = 1.0
    budget_use: float = 1.0

    def predict(self, variant: str, budget: int, page_size: int, context: int, notes: list[str] | None = None) -> HitStats:
        if notes is not None and "hit: prior (no trace)" not in notes:
            notes.append("hit: prior (no trace)")
        return HitStats(self.page_hit_rate, self.fill, self.budget_use, "prior: no trace (upper bound on bytes)")


# ------------------------------------------------------------------------------------------------ traces
@dataclass
class Trace:
    """A selection trace: configuration ``meta`` and the per (step, layer, KV head) records."""

    meta: dict[str, Any]
    records: list[dict[str, Any]]

    def steps(self) -> list[int]:
        return sorted({int(r["step"]) for r in self.records})

    def layers(self) -> list[int]:
        return sorted({int(r["layer"]) for r in self.records})


def check_record(rec: dict[str, Any], where: str = "") -> dict[str, Any]:
    """Validate one trace record (fields present, counts non-negative, new_pages <= len(pages))."""
    missing = [f for f in RECORD_FIELDS if f not in rec]
    if missing:
        raise InputError(f"trace record {where}lacks {missing}: {rec}")
    for f in ("step", "layer", "kv_head", "tokens", "new_pages", "bytes"):
        if isinstance(rec[f], bool) or not isinstance(rec[f], (int, np.integer)) or rec[f] < 0:
            raise InputError(f"trace record {where}field {f} must be an int >= 0, got {rec[f]!r}")
    if not isinstance(rec["pages"], list):
        raise InputError(f"trace record {where}field pages must be a list, got {type(rec['pages']).__name__}")
    if rec["new_pages"] > len(rec["pages"]):
        raise InputError(f"trace record {where}has new_pages {rec['new_pages']} > {len(rec['pages'])} pages")
    return rec


def is_trace_path(path: str | Path) -> bool:
    """Whether ``path`` names a selection trace: JSON lines, plain (``.jsonl``) or gzipped (``.jsonl.gz``)."""
    return str(path).endswith((".jsonl", ".jsonl.gz"))


def open_trace(path: str | Path):
    """Open a trace file for reading text, gzipped or not."""
    p = Path(path)
    return gzip.open(p, "rt") if p.suffix == ".gz" else p.open()


def read_trace(path: str | Path, meta: dict[str, Any] | None = None) -> Trace:
    """Read a JSON-lines trace (``.jsonl`` or ``.jsonl.gz`` (optional ``{"meta": ...}`` first line; ``meta`` overrides/fills it)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"no trace file at {p}")
    records: list[dict[str, Any]] = []
    head: dict[str, Any] = {}
    try:
        with open_trace(p) as fh:
            lines = list(fh)
    except (OSError, EOFError, UnicodeDecodeError) as exc:
        raise InputError(f"cannot read the trace {p} ({exc})") from None
    for line_no, obj in json_objects(lines, f"trace {p.name}"):
        if line_no == 1 and "meta" in obj and len(obj) == 1:
            head = dict(obj["meta"])
            continue
        records.append(check_record(obj, f"{p.name}:{line_no} "))
    head.update(meta or {})
    return Trace(meta=head, records=records)


def write_trace(path: str | Path, trace: Trace) -> Path:
    """Write ``trace`` as JSON lines with a meta first line."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with p.open("w") as fh:
        fh.write(json.dumps({"meta": trace.meta}) + "\n")
        for r in trace.records:
            fh.write(json.dumps(r) + "\n")
    return p


def _meta_int(trace: Trace, key: str) -> int:
    if key not in trace.meta:
        raise ConfigError(f"trace meta lacks {key!r} (have {sorted(trace.meta)}); add a meta line or pass meta=")
    return int(trace.meta[key])


@dataclass(frozen=True)
class TraceSummary:
    """Averages of one trace (one configuration)."""

    variant: str
    budget: int
    page_size: int
    context: int
    steps: int
    layers: int
    kv_heads: int
    page_hit_rate: float
    fill: float
    budget_use: float
    mean_bytes_per_step: float
    mean_pages_per_head: float


def summarize_trace(trace: Trace, skip_first_step: bool = True) -> TraceSummary:
    """Average a trace. The first recorded step is skipped for the hit rate (nothing is resident before it)."""
    if not trace.records:
        raise ConfigError("empty trace")
    budget, page_size, context = _meta_int(trace, "budget"), _meta_int(trace, "page_size"), _meta_int(trace, "context")
    steps = trace.steps()
    later = [r for r in trace.records if not skip_first_step or r["step"] != steps[0]] or trace.records
    pages = sum(len(r["pages"]) for r in later)
    new = sum(int(r["new_pages"]) for r in later)
    tokens = sum(int(r["tokens"]) for r in trace.records)
    all_pages = sum(len(r["pages"]) for r in trace.records)
    n_heads = len(trace.records)
    step_bytes: dict[int, int] = {}
    for r in later:
        step_bytes[r["step"]] = step_bytes.get(r["step"], 0) + int(r["bytes"])
    eff_page = int(trace.meta.get("pager_page_size", page_size))  # token-pages (exact pager) report 1
    return TraceSummary(
        variant=str(trace.meta.get("variant", "icecache")),
        budget=budget,
        page_size=page_size,
        context=context,
        steps=len(steps),
        layers=len(trace.layers()),
        kv_heads=len({r["kv_head"] for r in trace.records}),
        page_hit_rate=1.0 - new / pages if pages else 0.0,
        fill=min(tokens / (all_pages * eff_page), 1.0) if all_pages else 1.0,
        budget_use=min(tokens / (n_heads * budget), 1.0) if budget else 1.0,
        mean_bytes_per_step=float(np.mean(list(step_bytes.values()))) if step_bytes else 0.0,
        mean_pages_per_head=all_pages / n_heads,
    )


@dataclass(frozen=True)
class LayerLoad:
    """What one decode step loads for one layer (summed over KV heads) according to a trace."""

    bytes: int
    new_pages: int
    pages: int
    tokens_per_head: float
    heads_with_new: int | None = None
    """(row, KV head) records of the layer that copied anything (the runtime gathers once for each)."""


def trace_step_loads(trace: Trace) -> dict[int, dict[int, LayerLoad]]:
    """``{step: {layer: LayerLoad}}`` for trace replay."""
    acc: dict[int, dict[int, list[float]]] = {}
    for r in trace.records:
        a = acc.setdefault(int(r["step"]), {}).setdefault(int(r["layer"]), [0, 0, 0, 0.0, 0, 0])
        a[0] += int(r["bytes"])
        a[1] += int(r["new_pages"])
        a[2] += len(r["pages"])
        a[3] += int(r["tokens"])
        a[4] += 1
        a[5] += int(r["bytes"]) > 0
    return {
        s: {layer: LayerLoad(int(a[0]), int(a[1]), int(a[2]), a[3] / a[4], int(a[5])) for layer, a in layers.items()}
        for s, layers in acc.items()
    }


def synthetic_trace(
    *,
    steps: int,
    layers: Sequence[int],
    kv_heads: int,
    budget: int,
    page_size: int,
    context: int,
    page_hit_rate: float,
    fill: float = 1.0,
    head_dim: int = 64,
    dtype_bytes: int = 4,
    variant: str = "icecache",
    seed: int = 0,
) -> Trace:
    """A trace with known statistics (for tests): each step keeps ``round(h k)`` of the previous ``k`` pages.

    Pages hold ``round(fill * page_size)`` tokens; ``k`` is the most pages that fit the budget.
    """
    if not (0 <= page_hit_rate <= 1) or not (0 < fill <= 1):
        raise ConfigError("page_hit_rate must be in [0, 1] and fill in (0, 1]")
    rng = np.random.default_rng(seed)
    per_page = max(1, round(fill * page_size))
    k = max(1, budget // per_page)
    universe = max(k + 1, context // per_page)
    page_bytes = 2 * page_size * head_dim * dtype_bytes
    records = []
    for layer in layers:
        for h in range(kv_heads):
            prev: np.ndarray | None = None
            for s in range(steps):
                if prev is None:
                    cur = rng.choice(universe, size=k, replace=False)
                    new = k
                else:
                    keep = int(round(page_hit_rate * k))
                    kept = rng.choice(prev, size=keep, replace=False)
                    pool = np.setdiff1d(np.arange(universe), prev)
                    fresh = rng.choice(pool, size=k - keep, replace=False)
                    cur = np.concatenate([kept, fresh])
                    new = k - keep
                records.append(
                    dict(step=s, layer=int(layer), kv_head=h, pages=[int(p) for p in cur], tokens=k * per_page,
                         new_pages=int(new), bytes=int(new * page_bytes))
                )
                prev = cur
    meta = dict(budget=budget, page_size=page_size, context=context, variant=variant, synthetic=True, seed=seed)
    return Trace(meta=meta, records=records)


# ------------------------------------------------------------------------------------------- parametric
def _logit(p: np.ndarray) -> np.ndarray:
    p = np.clip(p, 1e-3, 1 - 1e-3)
    return np.log(p / (1 - p))


def _features(budget: float, page_size: float, context: float) -> np.ndarray:
    return np.array([1.0, math.log(budget), math.log(page_size), math.log(context)])


@dataclass(frozen=True)
class ParametricHitModel:
    """``logit(q) = c . [1, ln B, ln P, ln n]`` per variant and quantity, fitted to trace summaries.

    Attributes
    ----------
    coefs : dict
        ``{variant: {quantity: (c0, c1, c2, c3)}}``.
    ranges : dict
        ``{variant: {"budget": (lo, hi), "page_size": (lo, hi), "context": (lo, hi)}}`` of the fitted traces.
    n_traces : dict
        Traces per variant.
    extrapolation : str
        Policy outside the fitted ranges.
    """

    coefs: dict[str, dict[str, tuple[float, ...]]]
    ranges: dict[str, dict[str, tuple[float, float]]]
    n_traces: dict[str, int]
    extrapolation: str = "warn"
    fallback: dict[str, str] = field(default_factory=lambda: {"icecache-r": "icecache"})

    @classmethod
    def fit(cls, summaries: Iterable[TraceSummary], ridge: float = 1e-2, extrapolation: str = "warn") -> ParametricHitModel:
        """Fit per variant; the slopes are shrunk towards 0 (``ridge``), so one trace gives constants."""
        check_policy(extrapolation)
        by_variant: dict[str, list[TraceSummary]] = {}
        for s in summaries:
            by_variant.setdefault(s.variant, []).append(s)
        if not by_variant:
            raise ConfigError("no trace summaries to fit")
        coefs: dict[str, dict[str, tuple[float, ...]]] = {}
        ranges: dict[str, dict[str, tuple[float, float]]] = {}
        for v, ss in by_variant.items():
            X = np.stack([_features(s.budget, s.page_size, s.context) for s in ss])
            pen = np.sqrt(ridge) * np.diag([0.0, 1.0, 1.0, 1.0])
            coefs[v] = {}
            for q in QUANTITIES:
                y = _logit(np.array([getattr(s, q) for s in ss]))
                A = np.vstack([X, pen])
                b = np.concatenate([y, np.zeros(4)])
                c, *_ = np.linalg.lstsq(A, b, rcond=None)
                coefs[v][q] = tuple(float(x) for x in c)
            ranges[v] = {
                k: (float(min(getattr(s, k) for s in ss)), float(max(getattr(s, k) for s in ss)))
                for k in ("budget", "page_size", "context")
            }
        return cls(coefs=coefs, ranges=ranges, n_traces={v: len(ss) for v, ss in by_variant.items()}, extrapolation=extrapolation)

    def predict(self, variant: str, budget: int, page_size: int, context: int, notes: list[str] | None = None) -> HitStats:
        v = variant if variant in self.coefs else self.fallback.get(variant, variant)
        if v not in self.coefs:
            raise ConfigError(f"hit model has no traces for variant {variant!r} (has {sorted(self.coefs)})")
        if v != variant and notes is not None:
            notes.append(f"hit: {variant} uses the {v} traces")
        bad = [
            f"hit: {k}={x:g} outside traced [{lo:g}, {hi:g}]"
            for k, x in (("budget", budget), ("page_size", page_size), ("context", context))
            for lo, hi in [self.ranges[v][k]]
            if x < lo or x > hi
        ]
        if bad:
            if notes is not None:
                notes.extend(b for b in bad if b not in notes)
            if self.extrapolation == "refuse":
                raise ExtrapolationError("; ".join(bad))
            if self.extrapolation == "warn":
                import warnings

                warnings.warn("; ".join(bad), ExtrapolationWarning, stacklevel=2)
        x = _features(max(budget, 1), page_size, max(context, 2))
        vals = {q: float(1 / (1 + math.exp(-float(np.dot(self.coefs[v][q], x))))) for q in QUANTITIES}
        return HitStats(vals["page_hit_rate"], vals["fill"], vals["budget_use"], f"parametric fit to {self.n_traces[v]} {v} traces")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any], extrapolation: str | None = None) -> ParametricHitModel:
        return cls(
            coefs={v: {q: tuple(c) for q, c in qs.items()} for v, qs in d["coefs"].items()},
            ranges={v: {k: tuple(r) for k, r in rs.items()} for v, rs in d["ranges"].items()},  # type: ignore[misc]
            n_traces={k: int(v) for k, v in d["n_traces"].items()},
            extrapolation=extrapolation or d.get("extrapolation", "warn"),
            fallback=dict(d.get("fallback", {"icecache-r": "icecache"})),
        )

    def save(self, path: str | Path) -> Path:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        return p

    @classmethod
    def load(cls, path: str | Path, extrapolation: str | None = None) -> ParametricHitModel:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"no hit model at {p}")
        try:
            return cls.from_dict(json.loads(p.read_text()), extrapolation)
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError, ValueError) as exc:
            if isinstance(exc, ConfigError):
                raise
            raise ConfigError(f"{p} is not a fitted hit model ({exc!r})") from None


def load_hit_model(paths: Sequence[str | Path], extrapolation: str = "warn") -> HitModel:
    """A hit model from files: a fitted model (``.json``) or trace files (``.jsonl[.gz]``, fitted here)."""
    paths = [Path(p) for p in paths]
    if not paths:
        return PriorHitModel()
    if len(paths) == 1 and paths[0].suffix == ".json":
        return ParametricHitModel.load(paths[0], extrapolation)
    return ParametricHitModel.fit([summarize_trace(read_trace(p)) for p in paths], extrapolation=extrapolation)
