"""Fitted predictors: a small timing formula over named features, with the range it was measured over.

A `Predictor` (constant, affine, quadratic, power law, piecewise power law) has parameters fitted
(`fit_predictor`) to timings measured on one machine. Asked outside its measured range, it refuses, warns,
or stays silent, as the caller chooses (``extrapolation=``, `EXTRAPOLATION_POLICIES`).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from icecache.core.errors import ConfigError

__all__ = [
    "Extrapolation", "EXTRAPOLATION_POLICIES", "ExtrapolationError", "ExtrapolationWarning", "check_policy",
    "FORMS", "Predictor", "fit_predictor",
]

Extrapolation = Literal["refuse", "warn", "allow"]
EXTRAPOLATION_POLICIES: tuple[str, ...] = ("refuse", "warn", "allow")


class ExtrapolationError(ConfigError):
    """A predictor was asked about a point outside the range it was measured over (policy ``refuse``)."""


class ExtrapolationWarning(UserWarning):
    """A predictor was asked about a point outside the range it was measured over (policy ``warn``)."""


def check_policy(policy: str) -> str:
    """Validate an extrapolation policy name."""
    if policy not in EXTRAPOLATION_POLICIES:
        raise ConfigError(f"extrapolation must be one of {EXTRAPOLATION_POLICIES}, got {policy!r}")
    return policy


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
    def from_dict(cls, d: dict[str, Any]) -> Predictor:
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
