"""A hand-made calibration profile with round, known costs (tests, examples, docs; never for projections)."""

from __future__ import annotations

from icecache.sim.predictors import Predictor
from icecache.sim.profile import CalibrationProfile
from icecache.sim.shapes import get_shape, shape_to_dict


def _p(name: str, form: str, features: tuple[str, ...], params: tuple[float, ...], lo: tuple[float, ...], hi: tuple[float, ...]) -> Predictor:
    return Predictor(name=name, form=form, features=features, params=params, lo=lo, hi=hi, fit_mape=0.0, n_points=0)


def synthetic_profile(pagers: tuple[str, ...] = ("mdci", "sequential", "exact"), pool_efficiency: dict[str, float] | None = None,
                      cpu_count: int = 2, background_share: float | None = None) -> CalibrationProfile:
    """A `CalibrationProfile` of the embedded model with simple, fixed costs (seconds).

    Decode step 30 ms + 2 us/token, attention 10 us + 50 ns/token, LM head 2 ms, prefill 10 ms + 0.1 ms/token +
    1 ns/token^2; select ``0.1 ms + 1 us * n^0.8 * B^0.1``, build ``1 ms + 1 us * n^1.1``, insert
    ``50 us + 0.1 us * n^0.5``; gather 2 us + bytes / 3 GB/s + 10 ns/row, copy 1 us + bytes / 10 GB/s,
    scatter 2 us + bytes / 5 GB/s + 10 ns/row; loader bookkeeping 5 us + 20 us/head + 10 ns/token; window append
    10 us + 2 us/head; untimed runtime overhead 40 us + 5 us/head per sparse layer; host-store part of the insert
    job 30 us + 10 us/head. Ranges: context <= 8192, index n 1024..49152, budget 64..256, page size 8..32. The background share is
    left unmeasured (pass ``background_share`` to set it).
    """
    preds = {
        "decode_step": _p("decode_step", "affine", ("context",), (0.030, 2e-6), (128.0,), (8192.0,)),
        "attention": _p("attention", "affine", ("kv_tokens",), (1e-5, 5e-8), (64.0,), (8192.0,)),
        "lm_head": _p("lm_head", "constant", (), (0.002,), (), ()),
        "prefill": _p("prefill", "quadratic", ("tokens",), (0.01, 1e-4, 1e-9), (128.0,), (2048.0,)),
        "gather": _p("gather", "affine", ("bytes", "rows"), (2e-6, 1 / 3e9, 1e-8), (1e3, 1.0), (1e8, 1e5)),
        "copy": _p("copy", "affine", ("bytes",), (1e-6, 1 / 10e9), (1e3,), (1e8,)),
        "scatter": _p("scatter", "affine", ("bytes", "rows"), (2e-6, 1 / 5e9, 1e-8), (0.0, 0.0), (1e8, 1e5)),
        "loader_other": _p("loader_other", "affine", ("heads", "tokens"), (5e-6, 2e-5, 1e-8), (1.0, 0.0), (64.0, 1e5)),
        "append": _p("append", "affine", ("heads",), (1e-5, 2e-6), (1.0,), (8.0,)),
        "overhead": _p("overhead", "affine", ("heads",), (4e-5, 5e-6), (1.0,), (8.0,)),
        "insert_store": _p("insert_store", "affine", ("heads",), (3e-5, 1e-5), (1.0,), (8.0,)),
    }
    for name in pagers:
        preds[f"select/{name}"] = _p(f"select/{name}", "power", ("n", "budget", "page_size"), (1e-4, 1e-6, 0.8, 0.1, 0.0),
                                     (1024.0, 64.0, 8.0), (49152.0, 256.0, 32.0))
        preds[f"build/{name}"] = _p(f"build/{name}", "power", ("n", "page_size"), (1e-3, 1e-6, 1.1, 0.0), (1024.0, 8.0), (49152.0, 32.0))
        preds[f"insert/{name}"] = _p(f"insert/{name}", "power", ("n",), (5e-5, 1e-7, 0.5), (1024.0,), (49152.0,))
    shape = get_shape("smollm2-135m-instruct")
    return CalibrationProfile(
        machine={"cpu_model": "synthetic", "cpu_count": cpu_count, "host": "synthetic"},
        versions={"python": "synthetic"},
        pager_hashes={},
        created="synthetic",
        predictors=preds,
        meta={"model": shape.name, "shape": shape_to_dict(shape), "dtype_bytes": 4, "queries_per_select": 3, "head_dim": 64,
              "pool_efficiency": pool_efficiency or {"1": 1.0, "2": 1.0}, "pagers": list(pagers),
              **({} if background_share is None else {"background_share": background_share})},
    )
