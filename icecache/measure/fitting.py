"""Raw calibration samples -> the simulator's predictors (`fit_profile_predictors`), and the profile's derived
meta values (pool efficiency, background share)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from icecache.core.errors import ConfigError
from icecache.measure.timing import STATISTICS
from icecache.sim.costs import SCATTER_OPS
from icecache.sim.predictors import Predictor, fit_predictor

__all__ = ["fit_profile_predictors", "background_meta", "pool_efficiency"]


def _points(rows: list[dict[str, Any]], features: Sequence[str], statistic: str = "p25") -> tuple[np.ndarray, np.ndarray]:
    X = np.array([[float(r[f]) for f in features] for r in rows], dtype=float).reshape(len(rows), len(features))
    y = np.array([STATISTICS[statistic](r["seconds"]) for r in rows])
    return X, y


def fit_profile_predictors(samples: dict[str, Any], statistic: str = "p25") -> dict[str, Predictor]:
    """Fit every predictor the simulator uses from raw samples (see `icecache.sim.costs.MeasuredCosts`),
    each point summarised by ``statistic`` (`STATISTICS`)."""
    preds: dict[str, Predictor] = {}
    if statistic not in STATISTICS:
        raise ConfigError(f"statistic must be one of {sorted(STATISTICS)}, got {statistic!r}")

    def fit(name: str, form: str, rows: list[dict[str, Any]], features: Sequence[str]) -> None:
        if rows:
            X, y = _points(rows, features, statistic)
            preds[name] = fit_predictor(name, form, features, X, y)

    fit("decode_step", "affine", samples.get("decode_step", []), ["context"])
    fit("attention", "affine", samples.get("attention", []), ["kv_tokens"])
    fit("sparse_attention", "affine", samples.get("sparse_attention", []), ["slots"])
    fit("store_sync", "affine", samples.get("store_sync", []), ["tokens"])
    fit("lm_head", "constant", samples.get("lm_head", []), [])
    fit("prefill", "quadratic", samples.get("prefill", []), ["tokens"])
    for r in samples.get("generate_step", [])[:1]:
        extra = STATISTICS[statistic](r["generate_s"]) - STATISTICS[statistic](r["forward_s"])
        preds["step_other"] = Predictor(name="step_other", form="constant", features=(), params=(max(extra, 0.0),), lo=(), hi=(),
                                        fit_mape=0.0, n_points=len(r["generate_s"]))
    _fit_prefill_pipeline(samples.get("prefill_pipeline", []), preds, statistic)
    if samples.get("runtime_layer"):
        _fit_runtime_layer(samples["runtime_layer"], preds, statistic)
    else:  # profiles measured before the runtime existed: page gathers of a synthetic store
        for comp in ("gather", "scatter"):
            fit(comp, "affine", samples.get(comp, []), ["bytes", "pages"])
        fit("copy", "affine", samples.get("copy", []), ["bytes"])
    for name, rows in samples.get("pagers", {}).items():
        fit(f"select/{name}", "pwpower", rows["select"], ["n", "budget", "page_size"])
        fit(f"build/{name}", "pwpower", rows["build"], ["n", "page_size"])
        fit(f"insert/{name}", "pwpower", rows["insert"], ["n"])
    for name, rows in samples.get("decode_index", {}).items():  # see `MeasuredCosts.select_job_s`
        fit(f"select_decode/{name}", "pwpower", rows, ["n"])
        fit(f"insert_decode/{name}", "pwpower", [dict(r, seconds=r["insert_seconds"]) for r in rows], ["n"])
        if rows and all(r.get("step_seconds") for r in rows):  # the whole decode step (profiles since 2026-11)
            fit(f"step_decode/{name}", "pwpower", [dict(r, seconds=r["step_seconds"]) for r in rows], ["n"])
    return preds


def _fit_prefill_pipeline(rows: list[dict[str, Any]], preds: dict[str, Predictor], statistic: str) -> None:
    """``prefill_generate`` (full attention's time to first token through ``generate`` vs prompt tokens) and
    ``prefill_inline/<pager>`` (the runtime's prefill minus full attention's at the same length, per prefill
    job: per sparse layer and KV head, vs the job's tokens ``n = tokens - sink - window``) from
    `measure_prefill_pipeline` rows. A point whose difference is not positive (noise) is left out."""
    stat = STATISTICS[statistic]
    full = {r["tokens"]: stat(r["ttft_s"]) for r in rows if r["method"] == "full" and r["ttft_s"]}
    if full:
        X = np.array([[float(n)] for n in sorted(full)])
        preds["prefill_generate"] = fit_predictor("prefill_generate", "quadratic", ["tokens"], X, np.array([full[n] for n in sorted(full)]))
    by_pager: dict[str, list[tuple[float, float]]] = {}
    for r in rows:
        n = r["tokens"]
        if r["method"] == "full" or n not in full or not r["ttft_s"]:
            continue
        extra = (stat(r["ttft_s"]) - full[n]) / (r["sparse_layers"] * r["kv_heads"])
        if extra > 0:
            by_pager.setdefault(r["method"], []).append((float(n - r["sink"] - r["window"]), extra))
    for pager, pts in by_pager.items():
        pts.sort()
        preds[f"prefill_inline/{pager}"] = fit_predictor(f"prefill_inline/{pager}", "pwpower", ["n"], np.array([[x] for x, _ in pts]),
                                                         np.array([y for _, y in pts]))


def _fit_runtime_layer(data: dict[str, Any], preds: dict[str, Predictor], statistic: str) -> None:
    """Loader, append and per-layer overhead predictors from `measure_runtime_layer` samples.

    Per call as the simulator asks (`icecache.sim.costs.MeasuredCosts`): gather per ``index_select`` (one per
    head with new tokens; features bytes and rows per call), copy (one per layer), scatter per operation
    (`SCATTER_OPS` per layer, features per operation), bookkeeping per layer (heads, selected tokens); append
    and overhead per layer (heads).
    """
    stat = STATISTICS[statistic]
    rows: dict[str, list[tuple[list[float], float]]] = {
        k: [] for k in ("gather", "copy", "scatter", "loader_other", "append", "overhead", "overhead_traced", "insert_store")}
    for r in data.get("loader", []):
        H, k, nbytes, sec = r["heads"], r["new_tokens"], float(r["bytes"]), r["seconds_by_stage"]
        if k > 0:
            rows["gather"].append(([nbytes / H, float(k)], stat(sec["gather"]) / H))
            rows["copy"].append(([nbytes], stat(sec["copy"])))
        rows["scatter"].append(([nbytes / SCATTER_OPS, H * k / SCATTER_OPS], stat(sec["scatter"]) / SCATTER_OPS))
        rows["loader_other"].append(([float(H), float(H * r["selected"])], stat(sec["other"])))
    for r in data.get("layer", []):
        steps = r["steps"]
        timed = [sum(v for k_, v in st.items() if k_ != "wall") for st in steps]
        untimed = ([float(r["heads"])], stat([st["wall"] - t for st, t in zip(steps, timed)]))
        if r.get("trace"):
            rows["overhead_traced"].append(untimed)
        else:
            append = stat([st["insert"] for st in steps])
            rows["append"].append(([float(r["heads"])], append))
            rows["overhead"].append(untimed)
            if r.get("sync_inserts"):  # the worker job beyond the pager inserts: host-store sync, moves
                rows["insert_store"].append(([float(r["heads"])], stat([x["insert"] - x["pager_insert"] for x in r["sync_inserts"]]) - append))
    feats = {"gather": ["bytes", "rows"], "copy": ["bytes"], "scatter": ["bytes", "rows"], "loader_other": ["heads", "tokens"],
             "append": ["heads"], "overhead": ["heads"], "overhead_traced": ["heads"], "insert_store": ["heads"]}
    for name, pts in rows.items():
        pts = [(x, y) for x, y in pts if y > 0]
        if pts:
            preds[name] = fit_predictor(name, "affine", feats[name], np.array([x for x, _ in pts]), np.array([y for _, y in pts]))


def background_meta(bg: dict[str, Any] | None) -> dict[str, float]:
    """``background_share`` (decode: prefetched inserts) and ``background_share_prefill`` (index builds) from
    `measure_background_share`, each clamped to [0, 1] (the raw values stay in the samples)."""
    out: dict[str, float] = {}
    for key, name in (("background_share", "decode"), ("background_share_prefill", "prefill")):
        v = (bg or {}).get(name, {}).get("share")
        if v is not None:
            out[key] = min(max(float(v), 0.0), 1.0)
    return out


def pool_efficiency(rows: list[dict[str, Any]], statistic: str = "p25") -> dict[str, float]:
    """``{threads: ceil(J/T) * t_single / makespan_T}`` from `measure_pool` rows (1.0 means ideal)."""
    stat = STATISTICS[statistic]
    single = next(stat(r["seconds"]) for r in rows if r["threads"] == 0)
    return {
        str(r["threads"]): min(1.0, math.ceil(r["jobs"] / r["threads"]) * single / stat(r["seconds"]))
        for r in rows
        if r["threads"] > 0
    }
