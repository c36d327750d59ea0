"""Cost predictors: closed forms, fitted predictors, calibration profiles, and the two cost models.

Three layers, bottom up (SIM_ANCHORS.md sections 0.3 and 2):

1. **Closed forms** (pure functions): a transfer costs ``calls * alpha + bytes / bandwidth``; identical jobs
   on a pool of T threads finish after ``ceil(J / T) * t``; a flow line of identical items after
   ``sum + (L - 1) * max``.
2. **Fitted predictors** (`Predictor`): a small formula (constant, affine, quadratic, power law) whose
   parameters were fitted to timings measured on one machine. Each keeps the range it was measured over;
   asked outside it, it refuses, warns, or stays silent, as the caller chooses (``extrapolation=``).
   A `CalibrationProfile` holds the predictors of one machine with the raw samples, the machine and the
   library versions they were measured with (Vidur issues #60/#72: a profile is only valid for the stack it
   was measured on), written by ``python -m icecache.sim calibrate``.
3. **Cost models**: `MeasuredCosts` answers every stage time of the simulator from a profile (the machine
   itself is the "device": the CPU runtime); `GpuCosts` answers device and link times from a
   `HardwareProfile`'s constants and host-side times (index queries, gather) from a measured profile scaled
   by the host's speed. Both expose the same methods, all pure: no I/O, no clock, no global state.

Units: seconds (``_s``), bytes, bytes per second (``_Bps``), tokens.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import platform
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Literal, Sequence

import numpy as np

from icecache.core.errors import ConfigError

Extrapolation = Literal["refuse", "warn", "allow"]
EXTRAPOLATION_POLICIES: tuple[str, ...] = ("refuse", "warn", "allow")
PROFILE_SCHEMA = 1
#: Device writes of the window ring per sparse layer and step in the runtime (`IceCacheLayer._decode_append`:
#: K, V and the validity mask).
RING_WRITES = 3
#: Scatter operations per sparse layer and step in the runtime (`BulkLoader.load`: ``index_copy_`` of K and of
#: V, and the validity-mask write, which happens even when nothing was copied).
SCATTER_OPS = 3


class ExtrapolationError(ConfigError):
    """A predictor was asked about a point outside the range it was measured over (policy ``refuse``)."""


class ExtrapolationWarning(UserWarning):
    """A predictor was asked about a point outside the range it was measured over (policy ``warn``)."""


class ProfileMismatchWarning(UserWarning):
    """A calibration profile was measured with other library versions or pager code than the running ones."""


def check_policy(policy: str) -> str:
    """Validate an extrapolation policy name."""
    if policy not in EXTRAPOLATION_POLICIES:
        raise ConfigError(f"extrapolation must be one of {EXTRAPOLATION_POLICIES}, got {policy!r}")
    return policy


# ---------------------------------------------------------------------------------------------- closed forms
def transfer_time_s(nbytes: float, calls: int, alpha_s: float, bandwidth_Bps: float) -> float:
    """Time of ``calls`` transfers moving ``nbytes`` in total: ``calls * alpha + nbytes / bandwidth``.

    Parameters
    ----------
    nbytes : float
        Bytes moved in total (>= 0).
    calls : int
        Number of separate transfer calls (each pays the fixed cost ``alpha_s``); 0 when nothing moves.
    alpha_s : float
        Fixed cost of one call, seconds.
    bandwidth_Bps : float
        Sustained bandwidth, bytes per second (> 0).
    """
    if nbytes < 0 or calls < 0:
        raise ConfigError(f"transfer needs nbytes >= 0 and calls >= 0, got {nbytes}, {calls}")
    if bandwidth_Bps <= 0:
        raise ConfigError(f"bandwidth must be > 0, got {bandwidth_Bps}")
    if calls == 0:
        return 0.0
    return calls * alpha_s + nbytes / bandwidth_Bps


def pool_makespan_s(job_s: float, jobs: int, threads: int) -> float:
    """Makespan of ``jobs`` identical jobs of ``job_s`` seconds on ``threads`` threads: ``ceil(J/T) * t``."""
    if jobs < 0 or threads < 1 or job_s < 0:
        raise ConfigError(f"pool needs jobs >= 0, threads >= 1, job_s >= 0; got {jobs}, {threads}, {job_s}")
    return math.ceil(jobs / threads) * job_s


def lpt_makespan_s(job_times_s: Sequence[float], threads: int) -> float:
    """Makespan of unequal jobs on ``threads`` threads with the longest-processing-time-first rule."""
    if threads < 1:
        raise ConfigError(f"threads must be >= 1, got {threads}")
    loads = [0.0] * threads
    for t in sorted(job_times_s, reverse=True):
        i = loads.index(min(loads))
        loads[i] += t
    return max(loads) if loads else 0.0


def flowline_makespan_s(stage_times_s: Sequence[Sequence[float]]) -> float:
    """Finish time of items flowing in order through single-server stages in series.

    ``stage_times_s[i][j]`` is item i's time at stage j. Recurrence ``C[i][j] = max(C[i-1][j], C[i][j-1]) +
    t[i][j]``; for identical items it equals ``sum(t) + (L - 1) * max(t)``.
    """
    prev: list[float] | None = None
    for row in stage_times_s:
        cur: list[float] = []
        for j, t in enumerate(row):
            ready = max(prev[j] if prev is not None else 0.0, cur[j - 1] if j else 0.0)
            cur.append(ready + t)
        prev = cur
    return prev[-1] if prev else 0.0


# ---------------------------------------------------------------------------------------------- predictors
FORMS: tuple[str, ...] = ("constant", "affine", "quadratic", "power", "pwpower")


@dataclass(frozen=True)
class Predictor:
    """A fitted timing formula over named features, with the range it was measured over.

    Forms (``x_i`` the features, ``p`` the parameters):

    - ``constant``: ``t = p0``
    - ``affine``: ``t = p0 + sum_i p_{i+1} x_i`` (non-negative least squares on relative error)
    - ``quadratic`` (one feature): ``t = p0 + p1 x + p2 x^2``
    - ``power``: ``t = p0 + p1 * prod_i x_i ** p_{i+2}`` (least squares on relative error)
    - ``pwpower``: ``log t`` piecewise linear in ``log x_0`` through knots at the measured values of ``x_0``,
      plus ``sum_{i>=1} e_i log x_i``; beyond the end knots the end segments continue (a local power law).
      ``params = (K, log-knots[K], log-values[K], e[1:])``; least squares in log space. It follows a measured
      curve that one power law cannot (an index whose query cost is flat, then grows).

    Attributes
    ----------
    name : str
        What is timed (``"select/mdci"``, ``"gather"``, ...).
    form : str
        One of `FORMS`.
    features : tuple of str
        Feature names, in the order `predict` takes them.
    params : tuple of float
        Fitted parameters (seconds and seconds per feature unit).
    lo, hi : tuple of float
        Smallest and largest measured value of each feature.
    fit_mape : float
        Mean absolute percentage error over the samples it was fitted to (a fraction).
    n_points : int
        Number of (feature, median time) points fitted.
    """

    name: str
    form: str
    features: tuple[str, ...]
    params: tuple[float, ...]
    lo: tuple[float, ...]
    hi: tuple[float, ...]
    fit_mape: float = 0.0
    n_points: int = 0

    def __post_init__(self) -> None:
        if self.form not in FORMS:
            raise ConfigError(f"predictor {self.name!r}: unknown form {self.form!r}; known: {FORMS}")
        if not (len(self.lo) == len(self.hi) == len(self.features)):
            raise ConfigError(f"predictor {self.name!r}: lo/hi must have one entry per feature")

    # -- evaluation
    def out_of_range(self, x: Sequence[float]) -> list[str]:
        """Descriptions of the features of ``x`` that lie outside the measured range (empty when inside)."""
        bad = []
        for f, v, lo, hi in zip(self.features, x, self.lo, self.hi):
            if v < lo * (1 - 1e-9) or v > hi * (1 + 1e-9):
                bad.append(f"{self.name}: {f}={v:g} outside measured [{lo:g}, {hi:g}]")
        return bad

    def formula(self, x: Sequence[float]) -> float:
        """The formula at ``x``, no range check."""
        p = self.params
        if self.form == "constant":
            return p[0]
        if self.form == "affine":
            return p[0] + sum(pi * xi for pi, xi in zip(p[1:], x))
        if self.form == "quadratic":
            return p[0] + p[1] * x[0] + p[2] * x[0] ** 2
        if self.form == "pwpower":
            k = int(p[0])
            knots, vals, exps = p[1 : 1 + k], p[1 + k : 1 + 2 * k], p[1 + 2 * k :]
            w = _hat_row(math.log(max(float(x[0]), 1e-12)), knots)
            z = sum(wi * vi for wi, vi in zip(w, vals)) + sum(e * math.log(max(float(xi), 1e-12)) for e, xi in zip(exps, x[1:]))
            return math.exp(z)
        prod = 1.0
        for xi, e in zip(x, p[2:]):
            prod *= max(float(xi), 1e-12) ** e
        return p[0] + p[1] * prod

    def predict(self, x: Sequence[float], extrapolation: Extrapolation = "warn", notes: list[str] | None = None) -> float:
        """Predicted seconds at ``x``; outside the measured range apply ``extrapolation``.

        Parameters
        ----------
        x : sequence of float
            One value per feature, in `features` order.
        extrapolation : {"refuse", "warn", "allow"}
            ``refuse`` raises `ExtrapolationError`, ``warn`` emits an `ExtrapolationWarning`, ``allow`` is
            silent. In every case the out-of-range descriptions are appended to ``notes`` when given.
        notes : list of str, optional
            Collects out-of-range descriptions (the simulator reports them per configuration).
        """
        if len(x) != len(self.features):
            raise ConfigError(f"predictor {self.name!r} takes {self.features}, got {len(x)} values")
        bad = self.out_of_range(x)
        if bad:
            if notes is not None:
                notes.extend(bad)
            if extrapolation == "refuse":
                raise ExtrapolationError("; ".join(bad) + " (pass extrapolation='warn' or 'allow' to go on)")
            if extrapolation == "warn":
                warnings.warn("; ".join(bad), ExtrapolationWarning, stacklevel=2)
        return max(self.formula(x), 0.0)

    # -- serialisation
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Predictor":
        return cls(
            name=d["name"], form=d["form"], features=tuple(d["features"]), params=tuple(float(v) for v in d["params"]),
            lo=tuple(float(v) for v in d["lo"]), hi=tuple(float(v) for v in d["hi"]),
            fit_mape=float(d.get("fit_mape", 0.0)), n_points=int(d.get("n_points", 0)),
        )


def _hat_row(u: float, knots: Sequence[float]) -> list[float]:
    """Weights of piecewise-linear interpolation at ``u`` over ``knots`` (end segments extended)."""
    k = len(knots)
    w = [0.0] * k
    if k == 1:
        w[0] = 1.0
        return w
    j = 0
    while j < k - 2 and u > knots[j + 1]:
        j += 1
    t = (u - knots[j]) / (knots[j + 1] - knots[j])
    w[j], w[j + 1] = 1.0 - t, t
    return w


def _mape(pred: np.ndarray, y: np.ndarray) -> float:
    return float(np.mean(np.abs(pred - y) / np.abs(y)))


def fit_predictor(name: str, form: str, features: Sequence[str], X: Any, y: Any) -> Predictor:
    """Fit a `Predictor` of ``form`` to points ``X`` ``[m, k]`` (features) and ``y`` ``[m]`` (seconds).

    Affine and quadratic forms use non-negative least squares on relative residuals (so small and large
    timings weigh alike); the power form uses bounded nonlinear least squares on relative residuals.
    """
    from scipy.optimize import least_squares, nnls

    X = np.asarray(X, dtype=float).reshape(len(y), -1) if len(y) else np.zeros((0, len(features)))
    y = np.asarray(y, dtype=float)
    if len(y) == 0 or np.any(~np.isfinite(y)) or np.any(y <= 0):
        raise ConfigError(f"predictor {name!r}: need at least one positive, finite timing to fit")
    if X.shape[1] != len(features):
        raise ConfigError(f"predictor {name!r}: X has {X.shape[1]} columns for features {tuple(features)}")
    lo = tuple(float(v) for v in X.min(axis=0)) if X.shape[1] else ()
    hi = tuple(float(v) for v in X.max(axis=0)) if X.shape[1] else ()
    w = 1.0 / y
    if form == "constant":
        params: tuple[float, ...] = (float(np.median(y)),)
    elif form in ("affine", "quadratic"):
        if form == "quadratic":
            if X.shape[1] != 1:
                raise ConfigError(f"predictor {name!r}: the quadratic form takes one feature")
            A = np.column_stack([np.ones(len(y)), X[:, 0], X[:, 0] ** 2])
        else:
            A = np.column_stack([np.ones(len(y)), X])
        scale = np.maximum(np.abs(A).max(axis=0), 1e-30)  # column scaling keeps NNLS well conditioned
        sol, _ = nnls((A / scale) * w[:, None], y * w)
        params = tuple(float(v) for v in sol / scale)
    elif form == "power":
        k = X.shape[1]
        Xs = np.maximum(X, 1e-12)

        def resid(p: np.ndarray) -> np.ndarray:
            return (p[0] + p[1] * np.prod(Xs ** p[2:], axis=1) - y) * w

        p0 = 0.5 * float(y.min())
        # initial exponents from a log-linear fit of the excess over p0
        A = np.column_stack([np.ones(len(y)), np.log(Xs)])
        coef, *_ = np.linalg.lstsq(A, np.log(np.maximum(y - p0, 1e-3 * y)), rcond=None)
        init = np.concatenate([[p0, math.exp(coef[0])], np.clip(coef[1:], -0.9, 2.9)])
        lb = np.concatenate([[0.0, 0.0], np.full(k, -1.0)])
        ub = np.concatenate([[np.inf, np.inf], np.full(k, 3.0)])
        init = np.clip(init, lb + 1e-12, np.where(np.isfinite(ub), ub - 1e-12, init + 1.0))
        sol = least_squares(resid, init, bounds=(lb, ub), x_scale="jac", max_nfev=4000)
        params = tuple(float(v) for v in sol.x)
    elif form == "pwpower":
        knots = sorted({math.log(v) for v in X[:, 0]})
        A = np.array([_hat_row(math.log(r[0]), knots) + [math.log(v) for v in r[1:]] for r in X])
        coef, *_ = np.linalg.lstsq(A, np.log(y), rcond=None)
        params = (float(len(knots)), *knots, *(float(c) for c in coef))
    else:
        raise ConfigError(f"predictor {name!r}: unknown form {form!r}; known: {FORMS}")
    pred = Predictor(name=name, form=form, features=tuple(features), params=params, lo=lo, hi=hi)
    fitted = np.array([max(pred.formula(row), 0.0) for row in X]) if len(X) else np.array([params[0]])
    return dataclasses.replace(pred, fit_mape=_mape(fitted, y), n_points=int(len(y)))


# ---------------------------------------------------------------------------------------------- profiles
def software_versions() -> dict[str, str]:
    """Versions of the libraries a timing depends on (stored with every profile)."""
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for dist in ("torch", "transformers", "numpy", "scipy", "simpy", "numba"):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            out[dist] = "absent"
    return out


def pager_code_hashes(names: Iterable[str]) -> dict[str, str]:
    """SHA-256 (first 16 hex digits) of the source file of each registered pager (changed code = new profile)."""
    import inspect

    from icecache.indexes.registry import get_pager_class

    out = {}
    for n in names:
        try:
            src = Path(inspect.getfile(get_pager_class(n))).read_bytes()
            out[n] = hashlib.sha256(src).hexdigest()[:16]
        except Exception:  # a pager without a source file (built dynamically) cannot be hashed
            out[n] = "unknown"
    return out


@dataclass
class CalibrationProfile:
    """Everything measured on one machine: fitted predictors, raw samples, machine and versions.

    Attributes
    ----------
    machine : dict
        CPU model, core count, OS, host name (identifies where it was measured).
    versions : dict
        `software_versions` at measurement time.
    pager_hashes : dict
        `pager_code_hashes` of the measured pagers.
    created : str
        ISO time of the measurement.
    predictors : dict of str to Predictor
        Keyed by predictor name (see `MeasuredCosts` for the names it uses).
    meta : dict
        Measurement settings: model name and shape, dtype bytes, queries per select (group size), head dim,
        threads measured, pool efficiencies, pager list, wall time, notes.
    samples : dict
        Raw samples per component (lists of dicts with the features and ``seconds`` lists).
    """

    machine: dict[str, Any]
    versions: dict[str, str]
    pager_hashes: dict[str, str]
    created: str
    predictors: dict[str, Predictor]
    meta: dict[str, Any] = field(default_factory=dict)
    samples: dict[str, Any] = field(default_factory=dict)
    schema: int = PROFILE_SCHEMA

    def predictor(self, name: str) -> Predictor:
        try:
            return self.predictors[name]
        except KeyError:
            raise ConfigError(
                f"calibration profile has no predictor {name!r} (has: {', '.join(sorted(self.predictors))}); "
                "re-run `python -m icecache.sim calibrate`"
            ) from None

    @property
    def pagers(self) -> list[str]:
        """Pagers with a measured select cost."""
        return sorted(k.split("/", 1)[1] for k in self.predictors if k.startswith("select/"))

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": self.schema,
            "created": self.created,
            "machine": self.machine,
            "versions": self.versions,
            "pager_hashes": self.pager_hashes,
            "meta": self.meta,
            "predictors": {k: v.to_dict() for k, v in sorted(self.predictors.items())},
            "samples": self.samples,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "CalibrationProfile":
        if d.get("schema") != PROFILE_SCHEMA:
            raise ConfigError(f"calibration profile schema {d.get('schema')!r} is not {PROFILE_SCHEMA}; re-run calibrate")
        return cls(
            machine=dict(d["machine"]), versions=dict(d["versions"]), pager_hashes=dict(d.get("pager_hashes", {})),
            created=str(d["created"]), predictors={k: Predictor.from_dict(v) for k, v in d["predictors"].items()},
            meta=dict(d.get("meta", {})), samples=dict(d.get("samples", {})),
        )

    def save(self, path: str | Path) -> Path:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_suffix(p.suffix + ".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=1, sort_keys=False) + "\n")
        tmp.replace(p)
        return p

    @classmethod
    def load(cls, path: str | Path, *, strict: bool = False) -> "CalibrationProfile":
        """Read a profile; compare its versions and pager code with the running ones.

        A mismatch warns (`ProfileMismatchWarning`), or raises `ConfigError` when ``strict``.
        """
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"no calibration profile at {p}; run `python -m icecache.sim calibrate --out {p}`")
        prof = cls.from_dict(json.loads(p.read_text()))
        problems = prof.mismatches()
        if problems:
            msg = f"calibration profile {p} was measured on another stack: " + "; ".join(problems)
            if strict:
                raise ConfigError(msg)
            warnings.warn(msg, ProfileMismatchWarning, stacklevel=2)
        return prof

    def mismatches(self) -> list[str]:
        """Differences between the profile's torch/transformers/numpy versions and pager code and the running ones."""
        now = software_versions()
        out = [
            f"{k} {self.versions.get(k)} then, {now.get(k)} now"
            for k in ("torch", "transformers", "numpy")
            if self.versions.get(k) != now.get(k)
        ]
        try:
            from icecache.indexes.registry import available_pagers

            known = set(available_pagers())
            hashes = pager_code_hashes([n for n in self.pager_hashes if n in known])
            out += [f"pager {n} code changed" for n, h in hashes.items() if h != self.pager_hashes.get(n)]
            out += [f"pager {n} no longer registered" for n in self.pager_hashes if n not in known]
        except Exception as exc:  # registry unavailable: say so rather than hide it
            out.append(f"could not check pager code ({exc})")
        return out


# ---------------------------------------------------------------------------------------------- cost models
def _note(notes: list[str] | None, text: str) -> None:
    if notes is not None and text not in notes:
        notes.append(text)


@dataclass(frozen=True)
class MeasuredCosts:
    """Stage costs answered from a `CalibrationProfile` (the measured machine runs everything on its CPU).

    Predictor names used: ``decode_step`` (context), ``attention`` (kv_tokens), ``lm_head`` (constant),
    ``prefill`` (tokens), ``select/<pager>`` (n, budget, page_size), ``build/<pager>`` (n, page_size),
    ``insert/<pager>`` (n), when measured ``select_decode/<pager>`` and ``insert_decode/<pager>`` (n: the pager
    timed inside the runtime's decode, see `select_job_s`), ``gather`` (bytes, rows per call), ``copy`` (bytes), ``scatter`` (bytes, rows per
    call), and when measured ``loader_other`` (heads, tokens: the bulk loader's bookkeeping per layer) and
    ``append`` and ``overhead`` (heads: the window ring write and the untimed runtime work per layer);
    ``meta["background_share"]`` is the measured fraction of background pool work that slows the caller's
    thread down (see `background_share`).

    The decode step of the measured model is split into its parts without new assumptions: per-layer
    attention intercept from ``attention``, LM head from ``lm_head``, the remainder of the step intercept as
    per-layer compute; the in-model per-token attention cost is the step's slope over layers (it includes the
    cache update the model performs). A model of another shape is scaled by weight and KV-byte ratios and
    every answer is then noted as a shape extrapolation.

    Parameters
    ----------
    profile : CalibrationProfile
        Measurements.
    extrapolation : {"refuse", "warn", "allow"}
        Policy for points outside the measured ranges.
    """

    profile: CalibrationProfile
    extrapolation: str = "warn"

    def __post_init__(self) -> None:
        check_policy(self.extrapolation)

    # -- helpers
    def _p(self, name: str, x: Sequence[float], notes: list[str] | None) -> float:
        return self.profile.predictor(name).predict(x, self.extrapolation, notes)  # type: ignore[arg-type]

    @property
    def measured_shape(self) -> Any:
        """Shape of the model the profile timed (stored in its meta; a registered name otherwise)."""
        from icecache.sim.shapes import get_shape, shape_from_dict

        if "shape" in self.profile.meta:
            return shape_from_dict(self.profile.meta["shape"])
        return get_shape(self.profile.meta.get("model", "smollm2-135m-instruct"))

    def _shape_ratio(self, shape: Any, what: str, notes: list[str] | None) -> float:
        ref = self.measured_shape
        if shape.name == ref.name:
            return 1.0
        _note(notes, f"shape: {shape.name} {what} scaled from the measured {ref.name}")
        if what == "weights":
            return shape.layer_params() / ref.layer_params()
        if what == "head":
            return shape.head_params() / ref.head_params()
        if what == "kv":
            return shape.kv_bytes_per_token_layer(1) / ref.kv_bytes_per_token_layer(1)
        if what == "query":  # index query/insert work: queries per select times head width
            return (shape.group_size * shape.head_dim) / (ref.group_size * ref.head_dim)
        if what == "build":
            return shape.head_dim / ref.head_dim
        raise ValueError(what)

    @property
    def host_threads(self) -> int:
        return int(self.profile.machine.get("cpu_count", 1))

    @property
    def device_memory_bytes(self) -> float | None:
        return None

    # -- device side (here: the CPU)
    def layer_compute_s(self, shape: Any, notes: list[str] | None = None) -> float:
        """Non-attention work of one decode layer (norms, projections, MLP, framework overhead)."""
        ref = self.measured_shape
        step0 = self.profile.predictor("decode_step").params[0]
        per_layer = (step0 - self.profile.predictor("lm_head").params[0]) / ref.layers - self.profile.predictor(
            "attention"
        ).params[0]
        return max(per_layer, 0.0) * self._shape_ratio(shape, "weights", notes)

    def attend_s(self, shape: Any, tokens: int, *, in_model: bool, notes: list[str] | None = None) -> float:
        """Attention of one layer over ``tokens`` keys: through the model's own cache (``in_model``, full and
        dense layers) or as a standalone kernel over gathered pages (sparse layers)."""
        ref = self.measured_shape
        att = self.profile.predictor("attention")
        kv = self._shape_ratio(shape, "kv", notes)
        if in_model:
            step = self.profile.predictor("decode_step")
            step.predict([tokens], self.extrapolation, notes)  # type: ignore[arg-type]  # range check only
            return att.params[0] + step.params[1] / ref.layers * tokens * kv
        if "sparse_attention" in self.profile.predictors:  # the runtime's CPU kernel, measured as it runs
            sp = self.profile.predictor("sparse_attention")
            ratio = 1.0 if shape.name == ref.name else (shape.q_heads * shape.head_dim) / (ref.q_heads * ref.head_dim)
            return sp.params[0] + (self._p("sparse_attention", [tokens], notes) - sp.params[0]) * ratio
        _note(notes, "sparse attention: profile has no 'sparse_attention' kernel timing; the model's attention used")
        return att.params[0] + (self._p("attention", [tokens], notes) - att.params[0]) * kv

    def head_s(self, shape: Any, notes: list[str] | None = None) -> float:
        """Final norm and LM head, once per step."""
        return self.profile.predictor("lm_head").params[0] * self._shape_ratio(shape, "head", notes)

    def step_other_s(self, shape: Any, notes: list[str] | None = None) -> float:
        """Per-step host work of `transformers`' ``generate`` loop beyond the model's forward (logits processing,
        stopping criteria, input bookkeeping): the ``step_other`` predictor; 0 (noted) when not measured."""
        if "step_other" not in self.profile.predictors:
            _note(notes, "generate's per-step overhead not measured; counted as 0")
            return 0.0
        return self._p("step_other", [], notes)

    def prefill_layer_s(self, shape: Any, tokens: int, notes: list[str] | None = None, window: int | None = None) -> float:
        """Prefill of one layer over ``tokens`` prompt tokens. ``window`` (a sliding layer) does not change the
        time here: transformers' SDPA path applies the window as a mask over the causal attention, so the CPU
        computes every score anyway."""
        ref = self.measured_shape
        # time to first token through ``generate`` when the profile measured real prefills, else model forwards
        name = "prefill_generate" if "prefill_generate" in self.profile.predictors else "prefill"
        total = self._p(name, [tokens], notes) - self.profile.predictor("lm_head").params[0]
        return max(total, 0.0) / ref.layers * self._shape_ratio(shape, "weights", notes)

    # -- host side
    def _pager_name(self, pager: str, kind: str, notes: list[str] | None) -> str:
        name = f"{kind}/{pager}"
        if name in self.profile.predictors:
            return name
        raise ConfigError(
            f"the calibration profile has no {kind} cost for pager {pager!r} (measured: {', '.join(self.profile.pagers)});"
            " calibrate with that pager present or choose another with --pager"
        )

    def select_job_s(self, shape: Any, pager: str, n: int, budget: int, page_size: int, notes: list[str] | None = None) -> float:
        """One KV head's index query (its GQA group's queries) over ``n`` indexed tokens.

        When the profile timed the pager inside the runtime's decode (calibration component ``decode_index``:
        real generations over prompts of n indexed tokens per head), the round-robin select cost is scaled by
        ``select_decode(n) / select(n)`` at the budget and page size of that timing: a select between the
        model's work and the other heads' selects runs slower than one index timed alone."""
        name = self._pager_name(pager, "select", notes)
        t = self._p(name, [max(n, 1), max(budget, 1), page_size], notes)
        dec = f"select_decode/{pager}"
        if dec in self.profile.predictors:
            ref = self.profile.samples["decode_index"][pager][0]
            t *= self._p(dec, [max(n, 1)], notes) / self._p(name, [max(n, 1), ref["budget"], ref["page_size"]], notes)
        return t * self._shape_ratio(shape, "query", notes)

    def decode_step_in_runtime_s(self, pager: str, n: int, notes: list[str] | None = None) -> float:
        """One whole decode step (seconds) of the calibration's own model under the runtime, every layer sparse,
        at ``n`` indexed tokens per KV head (``step_decode/<pager>``, fitted from the ``decode_index`` timing's
        steps): what a fresh generation of that size costs, the index's effect on the rest of the step included.
        Only for runs of that model with that timing's budget and page size (no shape scaling)."""
        name = f"step_decode/{pager}"
        if name not in self.profile.predictors:
            raise ConfigError(f"the calibration profile has no {name} (measured with component 'decode_index' since "
                              f"2026-11; has: {', '.join(sorted(k for k in self.profile.predictors if '_decode/' in k)) or 'none'})")
        return self._p(name, [max(n, 1)], notes)

    def build_job_s(self, shape: Any, pager: str, n: int, page_size: int, notes: list[str] | None = None) -> float:
        """One KV head's prefill job over ``n`` tokens: the index build, plus writing the K/V into the host store's
        pages when the profile measured that (``store_sync``; older profiles: the build only, noted)."""
        name = self._pager_name(pager, "build", notes)
        build = self._p(name, [max(n, 1), page_size], notes) * self._shape_ratio(shape, "build", notes)
        if "store_sync" not in self.profile.predictors:
            _note(notes, "host-store writes of prefill jobs not measured; counted as 0")
            return build
        return build + self._p("store_sync", [max(n, 1)], notes) * self._shape_ratio(shape, "build", notes)

    def prefill_inline_job_s(self, shape: Any, pager: str, n: int, notes: list[str] | None = None) -> float | None:
        """What one prefill job (one sparse layer's KV head, ``n`` tokens) adds to a real prefill on this machine,
        where compute and the jobs share the cores (``prefill_inline/<pager>``, measured by the calibration's
        "pipeline" component); None when the profile did not measure it (the simulator then composes the
        prefill from isolated job times, `build_job_s`)."""
        name = f"prefill_inline/{pager}"
        if name not in self.profile.predictors:
            return None
        return self._p(name, [max(n, 1)], notes) * self._shape_ratio(shape, "build", notes)

    def insert_job_s(self, shape: Any, pager: str, n: int, notes: list[str] | None = None) -> float:
        """Insertion of one token (leaving the window) into one KV head's index of ``n`` tokens (timed inside
        the runtime's decode when the profile has ``insert_decode/<pager>``, see `select_job_s`)."""
        name = f"insert_decode/{pager}" if f"insert_decode/{pager}" in self.profile.predictors else f"insert/{pager}"
        if name not in self.profile.predictors:
            _note(notes, f"no insert cost measured for {pager}; counted as 0")
            return 0.0
        return self._p(name, [max(n, 1)], notes) * self._shape_ratio(shape, "build", notes)

    def _per_layer(self, name: str, what: str, shape: Any, notes: list[str] | None) -> float:
        if name not in self.profile.predictors:
            _note(notes, f"no {what} cost measured; counted as 0")
            return 0.0
        pred = self.profile.predictor(name)
        return self._p(name, [float(shape.kv_heads)] if pred.features else [], notes)

    def append_s(self, shape: Any, notes: list[str] | None = None) -> float:
        """The synchronous part of the runtime's window insert per sparse layer and step (ring write of K, V and
        mask, sink bookkeeping): the ``append`` predictor at the shape's KV heads, 0 (noted) when not measured."""
        return self._per_layer("append", "window-append", shape, notes)

    def insert_store_s(self, shape: Any, notes: list[str] | None = None) -> float:
        """The runtime's insert job per sparse layer beyond the pager inserts (page-table moves, host-store sync
        of every (row, KV head)): the ``insert_store`` predictor at the shape's KV heads, 0 (noted) when not
        measured."""
        return self._per_layer("insert_store", "host-store insert", shape, notes)

    def overhead_s(self, shape: Any, notes: list[str] | None = None, traced: bool = False) -> float:
        """The runtime's untimed work per sparse layer and step (cache and attention entry points, accounting,
        the prefetch job's submission): the ``overhead`` predictor at the shape's KV heads (``overhead_traced``
        when the run records a selection trace), 0 (noted) when not measured."""
        if traced and "overhead_traced" in self.profile.predictors:
            return self._per_layer("overhead_traced", "per-layer runtime overhead with a trace", shape, notes)
        if traced:
            _note(notes, "per-layer overhead of a traced run not measured; the untraced one is used")
        return self._per_layer("overhead", "per-layer runtime overhead", shape, notes)

    def loader_other_s(self, heads: int, tokens: float, notes: list[str] | None = None) -> float:
        """The bulk loader's bookkeeping for one layer (residency per (row, KV head) over ``tokens`` selected
        tokens in all): the ``loader_other`` predictor, 0 (noted) when the profile has none."""
        if "loader_other" not in self.profile.predictors:
            _note(notes, "no loader bookkeeping cost measured; counted as 0")
            return 0.0
        return self._p("loader_other", [heads, tokens], notes)

    def background_share(self, notes: list[str] | None = None, phase: str = "decode") -> float:
        """Fraction of background pool work by which it delays the caller's thread on this machine, as measured
        by the calibration: ``meta["background_share"]`` for decode (prefetched inserts beside decode steps),
        ``meta["background_share_prefill"]`` for prefill (index builds beside the prefill); 1 (the work shares
        the one CPU resource with everything else, serially) when it was not measured."""
        key = "background_share" if phase == "decode" else "background_share_prefill"
        v = self.profile.meta.get(key)
        if v is None:
            _note(notes, f"{key} not measured: background pool work counted as serial (1)")
            return 1.0
        return min(max(float(v), 0.0), 1.0)

    def pool_efficiency(self, threads: int, notes: list[str] | None = None) -> float:
        """Parallel efficiency of ``threads`` pool threads (job time is divided by it), as measured."""
        eff = {int(k): float(v) for k, v in self.profile.meta.get("pool_efficiency", {"1": 1.0}).items()}
        t = min(threads, max(eff))
        if threads > max(eff):
            _note(notes, f"pool efficiency measured up to {max(eff)} threads; {threads} uses that value")
        return eff.get(t, eff[max(k for k in eff if k <= t)])

    def gather_s(self, nbytes: float, rows: float, calls: int, notes: list[str] | None = None) -> float:
        """Gather of ``rows`` index rows (``nbytes``) from the host store into staging, in ``calls``
        index_select calls (the runtime: one per (row, KV head), a row being one token's K and V)."""
        if calls == 0 or nbytes == 0:
            return 0.0
        return calls * self._p("gather", [nbytes / calls, rows / calls], notes)

    def copy_h2d_s(self, nbytes: float, calls: int, notes: list[str] | None = None) -> float:
        """Host-to-device copy (here a host tensor copy)."""
        if calls == 0 or nbytes == 0:
            return 0.0
        return calls * self._p("copy", [nbytes / calls], notes)

    def copy_d2h_s(self, nbytes: float, calls: int, notes: list[str] | None = None) -> float:
        """Device-to-host copy (offload; here the same host tensor copy)."""
        return self.copy_h2d_s(nbytes, calls, notes)

    def scatter_s(self, nbytes: float, rows: float, calls: int, notes: list[str] | None = None) -> float:
        """Scatter of staged rows into their device slots in ``calls`` operations (``index_copy_`` of K and V,
        validity mask); with ``nbytes == 0`` only the mask write is left, which the runtime still does."""
        if calls == 0:
            return 0.0
        return calls * self._p("scatter", [nbytes / calls, rows / calls], notes)


@dataclass(frozen=True)
class GpuCosts:
    """Stage costs of a GPU server: device and link from hardware constants, host work from measurements.

    Device (per decode layer): ``layer_overhead + layer weight bytes / achieved HBM bandwidth`` for the
    non-attention work and ``tokens * KV bytes / (peak HBM bandwidth * attention efficiency)`` for attention
    (SIM_ANCHORS.md section 5: decode is dispatch- and implementation-bound, so both constants are fitted to
    measured full-KV runs, not taken from the roofline). Prefill: FLOPs / (peak * MFU). Link: ``alpha + bytes /
    bandwidth`` per call. Host: the measured profile's index and gather costs times the host's time scale.

    Parameters
    ----------
    hardware : HardwareProfile
        Constants (see `icecache.sim.hardware`).
    host : MeasuredCosts
        Host-side measurements (this machine) to scale.
    host_time_scale : float
        Host index-work time relative to ``host`` (resolved by `icecache.sim.hardware.resolve_host_scale`).
    """

    hardware: Any
    host: MeasuredCosts
    host_time_scale: float = 1.0

    @property
    def extrapolation(self) -> str:
        return self.host.extrapolation

    @property
    def host_threads(self) -> int:
        return int(self.hardware.host.threads.value)

    @property
    def device_memory_bytes(self) -> float | None:
        return float(self.hardware.device.memory_bytes.value)

    def _dtype(self) -> int:
        return int(self.hardware.kv_dtype_bytes)

    def layer_compute_s(self, shape: Any, notes: list[str] | None = None) -> float:
        dev = self.hardware.device
        return dev.layer_overhead_s.value + shape.layer_params() * self._dtype() / dev.hbm_achieved_Bps.value

    def attend_s(self, shape: Any, tokens: int, *, in_model: bool, notes: list[str] | None = None) -> float:
        dev = self.hardware.device
        bw = dev.hbm_peak_Bps.value * dev.attn_bw_efficiency.value
        return tokens * shape.kv_bytes_per_token_layer(self._dtype()) / bw

    def head_s(self, shape: Any, notes: list[str] | None = None) -> float:
        return shape.head_params() * self._dtype() / self.hardware.device.hbm_achieved_Bps.value

    def step_other_s(self, shape: Any, notes: list[str] | None = None) -> float:
        return self.hardware.device.step_overhead_s.value

    def prefill_layer_s(self, shape: Any, tokens: int, notes: list[str] | None = None, window: int | None = None) -> float:
        """Prefill FLOPs of one layer over the device; a sliding layer (``window``) computes only the scores
        inside its window (flash attention skips the masked blocks)."""
        dev = self.hardware.device
        att = shape.prefill_attention_flops(tokens, window) if window else shape.attention_flops(tokens, tokens, causal=True)
        flops = shape.layer_flops_per_token() * tokens + att
        return dev.layer_overhead_s.value + flops / (dev.peak_flops.value * dev.prefill_mfu.value)

    def select_job_s(self, shape: Any, pager: str, n: int, budget: int, page_size: int, notes: list[str] | None = None) -> float:
        return self.host_time_scale * self.host.select_job_s(shape, pager, n, budget, page_size, notes)

    def build_job_s(self, shape: Any, pager: str, n: int, page_size: int, notes: list[str] | None = None) -> float:
        return self.host_time_scale * self.host.build_job_s(shape, pager, n, page_size, notes)

    def insert_job_s(self, shape: Any, pager: str, n: int, notes: list[str] | None = None) -> float:
        return self.host_time_scale * self.host.insert_job_s(shape, pager, n, notes)

    def append_s(self, shape: Any, notes: list[str] | None = None) -> float:
        """Window ring write: `RING_WRITES` small device writes per sparse layer."""
        return RING_WRITES * self.hardware.device.kernel_launch_s.value

    def loader_other_s(self, heads: int, tokens: float, notes: list[str] | None = None) -> float:
        """The bulk loader's host bookkeeping, as measured here times the host's gather scale."""
        return self.hardware.host.gather_scale.value * self.host.loader_other_s(heads, tokens, notes)

    def insert_store_s(self, shape: Any, notes: list[str] | None = None) -> float:
        """The host-store part of the insert job, as measured here times the host's gather scale."""
        return self.hardware.host.gather_scale.value * self.host.insert_store_s(shape, notes)

    def overhead_s(self, shape: Any, notes: list[str] | None = None, traced: bool = False) -> float:
        """The runtime's untimed host work per sparse layer, as measured here times the host's gather scale."""
        return self.hardware.host.gather_scale.value * self.host.overhead_s(shape, notes, traced)

    def background_share(self, notes: list[str] | None = None, phase: str = "decode") -> float:
        """Unused off a shared machine (the pool, the caller's thread and the device are separate resources)."""
        return 1.0

    def pool_efficiency(self, threads: int, notes: list[str] | None = None) -> float:
        return float(self.hardware.host.pool_efficiency.value)

    def gather_s(self, nbytes: float, pages: float, calls: int, notes: list[str] | None = None) -> float:
        return self.hardware.host.gather_scale.value * self.host.gather_s(nbytes, pages, calls, notes)

    def copy_h2d_s(self, nbytes: float, calls: int, notes: list[str] | None = None) -> float:
        link = self.hardware.link
        return transfer_time_s(nbytes, calls if nbytes else 0, link.h2d_alpha_s.value, link.h2d_Bps.value)

    def copy_d2h_s(self, nbytes: float, calls: int, notes: list[str] | None = None) -> float:
        link = self.hardware.link
        return transfer_time_s(nbytes, calls if nbytes else 0, link.d2h_alpha_s.value, link.d2h_Bps.value)

    def scatter_s(self, nbytes: float, pages: float, calls: int, notes: list[str] | None = None) -> float:
        dev = self.hardware.device
        return transfer_time_s(nbytes, calls, dev.kernel_launch_s.value, dev.hbm_achieved_Bps.value / 2)
