"""``icecache calibrate``: time the real components on this machine and write a calibration profile.

What is timed (median of ``reps`` runs after one warm-up; every raw sample is kept in the profile):

- **decode step** of the embedded model vs context: a one-token forward with a `transformers.DynamicCache`
  prefilled (random K/V, the values do not change the time) to n tokens, cropped back after each run;
- **attention** alone of one layer vs KV tokens (transformers' SDPA path with the model's GQA layout);
- **LM head** (final norm + LM head + argmax) and **prefill** of n prompt tokens;
- **pagers** (every registered one; ``mdci`` when present): build, select (the GQA group's queries) and
  one-token insert per KV head, at several sizes, page sizes and budgets, on real keys and queries of the
  model (post-RoPE, captured from a prefill of library text; sizes beyond the captured length join the keys
  of further layers);
- **thread pool**: the KV heads' selects on 1..T threads, giving the pool's parallel efficiency; and the
  *background share*: how much a background thread doing index work (mdci inserts during decode steps, index
  builds during a prefill) slows the caller's thread down per second of that work (2 cores, the GIL);
- **pagers inside the runtime's decode** (component ``decode_index``): every pager's select and insert timed
  in real decode steps of the runtime over prompts of n indexed tokens per head (the model's work and the
  other heads' indexes run between two selects of one index: colder caches than the round-robin
  `measure_pager` timings); `icecache.sim.costs.MeasuredCosts` scales its select and insert costs by it;
- **runtime layer** (component ``loader``): the runtime's own sparse-layer code (`icecache.runtime`:
  `IceCache` layer, `BulkLoader`, `HeadStore`, `StageTimer`) on random K/V without a model, for 1 and the
  model's number of KV heads: the bulk loader at controlled numbers of new tokens per head (its gather,
  copy, scatter and bookkeeping timers), and whole decode-layer steps (update + attend) whose "insert" timer
  gives the window append and whose untimed remainder (wrappers, accounting, prefetch submission) gives the
  per-layer overhead.

The machine is shared and the numbers are noisy; the load average before and after is recorded.

Where: the timings are in `icecache.measure.components` and `icecache.measure.pagers`, the fits in
`icecache.measure.fitting`; this module has the settings, the run, the merge of a re-measured component into a
profile, and the command (`main`): ``icecache calibrate --out PROFILE.json [--components ...] [--update]`` and
``icecache calibrate --check [PROFILE.json]`` (is a profile still the running stack's? library versions and
pager code, recorded when measuring).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from icecache.core.errors import ConfigError, run_reporting_errors
from icecache.measure.capture import capture_qk, prompt_ids
from icecache.measure.components import (
    measure_attention,
    measure_decode_step,
    measure_generate_step,
    measure_lm_head,
    measure_prefill,
    measure_prefill_pipeline,
    measure_runtime_layer,
    measure_sparse_attention,
    measure_store_sync,
)
from icecache.measure.fitting import background_meta, fit_profile_predictors, pool_efficiency
from icecache.measure.pagers import KeyPool, measure_background_share, measure_decode_index, measure_pager, measure_pool
from icecache.measure.stack import pager_code_hashes, profile_mismatches, software_versions
from icecache.measure.timing import machine_info
from icecache.sim.profile import CalibrationProfile, default_profile_path
from icecache.sim.shapes import ModelShape, shape_from_config, shape_from_dict, shape_to_dict

__all__ = ["CalibrationSettings", "COMPONENTS", "merge_profiles", "run_calibration", "summarize_profile", "check_profile",
           "build_parser", "main"]


@dataclass(frozen=True)
class CalibrationSettings:
    """What `run_calibration` measures (token counts, repetitions, time limits in seconds)."""

    contexts: tuple[int, ...] = (128, 512, 1024, 2048, 4096, 8192)
    attention_tokens: tuple[int, ...] = (64, 256, 1024, 4096, 8192)
    prefill_tokens: tuple[int, ...] = (256, 512, 1024, 2048)
    qk_tokens: int = 8192
    pager_sizes: tuple[int, ...] = (1024, 4096, 16384, 65536, 131072, 240000)
    page_sizes: tuple[int, ...] = (8, 16, 32)
    budgets: tuple[int, ...] = (64, 256)
    insert_reps: int = 20
    pool_threads: tuple[int, ...] = (1, 2, 3)
    pool_size: int = 4096
    #: generate's per-step overhead (component "model"): prompt tokens and new tokens per generate call
    generate_prompt_tokens: int = 256
    generate_new_tokens: int = 24
    #: runtime layer (component "loader"): indexed tokens, new tokens per head per load (budget: max(budgets))
    runtime_layer_n: int = 4096
    runtime_new_tokens: tuple[int, ...] = (0, 4, 16, 64, 256)
    #: the runtime's CPU sparse-attention kernel (component "loader"): device slots (sink + window + budget)
    sparse_slots: tuple[int, ...] = (96, 192, 384, 768, 1536)
    #: host-store writes of one prefill job (component "loader"): tokens per KV head
    store_sync_tokens: tuple[int, ...] = (1024, 4096, 16384)
    #: real prefills, full vs the runtime's pipeline with each pager (component "pipeline"): prompt tokens, rounds
    pipeline_tokens: tuple[int, ...] = (1024, 2048, 4096, 8192)
    pipeline_rounds: int = 3
    #: pagers inside the runtime's decode (component "decode_index"): indexed tokens per head, timed steps, and
    #: the dense layers (None: `IceCacheConfig`'s default)
    decode_sizes: tuple[int, ...] = (1024, 4096, 8192, 16384, 24000)
    decode_steps: int = 24
    decode_rounds: int = 2
    decode_dense_layers: tuple[int, ...] | None = None
    #: background share (component "pool"): decode context and prefill length of the foreground
    background_context: int = 1024
    background_prefill_tokens: int = 256
    reps: int = 9
    statistic: str = "p25"
    pager_time_limit_s: float = 90.0
    #: pagers to time: those the simulated variants use (icecache: mdci, quest: sequential); None = all registered
    pagers: tuple[str, ...] | None = ("mdci", "sequential")
    seed: int = 0

    @classmethod
    def quick(cls) -> CalibrationSettings:
        """A few seconds' worth (tests and smoke runs; too small to fit reliable costs)."""
        return cls(
            contexts=(32, 64, 128), attention_tokens=(32, 128, 256), prefill_tokens=(16, 32, 64), qk_tokens=64,
            pager_sizes=(128, 256), page_sizes=(8, 16), budgets=(16, 32), insert_reps=3, pool_threads=(1, 2),
            pool_size=128, runtime_layer_n=256, runtime_new_tokens=(0, 4, 16), sparse_slots=(16, 64), store_sync_tokens=(64, 256), background_context=32, generate_prompt_tokens=16,
            pipeline_tokens=(96, 160), pipeline_rounds=1, decode_sizes=(64, 128), decode_steps=2, decode_rounds=1,
            generate_new_tokens=6,
            background_prefill_tokens=16, reps=2, pager_time_limit_s=10.0,
        )


def _default_sink_window() -> int:
    from icecache.core.config import IceCacheConfig

    d = IceCacheConfig()
    return d.sink + d.window


# ---------------------------------------------------------------------------------------------- driver
COMPONENTS: dict[str, tuple[str, ...]] = {
    # component: the sample keys it owns
    "model": ("decode_step", "attention", "lm_head", "prefill", "generate_step"),
    "pagers": ("pagers",),
    "pool": ("pool", "background"),
    "loader": ("gather", "copy", "scatter", "runtime_layer", "sparse_attention", "store_sync"),
    "pipeline": ("prefill_pipeline",),
    "decode_index": ("decode_index",),
}


def _runs_of(p: CalibrationProfile) -> list[dict[str, Any]]:
    """The measurement runs a profile was made from (one for a profile without a ``runs`` record)."""
    return [dict(r) for r in p.meta.get("runs", [{"created": p.created, "components": sorted(COMPONENTS),
                                                  "loadavg_start": p.machine.get("loadavg_start"),
                                                  "loadavg_end": p.machine.get("loadavg_end")}])]


def merge_profiles(base: CalibrationProfile, new: CalibrationProfile, components: Sequence[str]) -> CalibrationProfile:
    """``base`` with the samples of ``components`` taken from ``new``; predictors refitted from the merged samples.

    Both must come from the same machine, library versions and model; ``meta["runs"]`` lists which run measured
    which component (with its time and load averages), so a profile assembled from several runs says so.
    """
    unknown = set(components) - set(COMPONENTS)
    if unknown:
        raise ConfigError(f"unknown calibration components {sorted(unknown)}; known: {sorted(COMPONENTS)}")
    for key in ("cpu_model", "cpu_count"):
        if base.machine.get(key) != new.machine.get(key):
            raise ConfigError(f"cannot merge profiles of different machines ({key}: {base.machine.get(key)} vs {new.machine.get(key)})")
    if base.versions != new.versions:
        raise ConfigError(f"cannot merge profiles measured with different library versions: {base.versions} vs {new.versions}")
    shapes = [shape_from_dict(p.meta["shape"]) if "shape" in p.meta else None for p in (base, new)]
    if shapes[0] != shapes[1]:  # compared as shapes: a profile written before a field existed still merges
        raise ConfigError("cannot merge profiles of different models")
    samples = dict(base.samples)
    for c in components:
        for key in COMPONENTS[c]:  # a re-measured component replaces all of its old samples ...
            old = samples.pop(key, None)
            if key in new.samples:
                samples[key] = new.samples[key]
            if key in ("pagers", "decode_index") and old:  # ... except pagers not timed this time (the version check flags them)
                samples[key] = {**old, **new.samples.get(key, {})}
    stat = new.meta.get("statistic", "p25")
    meta = dict(base.meta)
    runs = [dict(r, components=[c for c in r["components"] if c not in components]) for r in _runs_of(base)]
    runs = [r for r in runs if r["components"]]
    runs += [dict(r, components=[c for c in r["components"] if c in components]) for r in _runs_of(new)]
    meta["runs"] = runs
    if "pool" in components:
        meta["pool_efficiency"] = new.meta.get("pool_efficiency", meta.get("pool_efficiency"))
        meta["pool_pager"] = new.meta.get("pool_pager")
        for key in ("background_share", "background_share_prefill"):
            meta.pop(key, None)
            if key in new.meta:
                meta[key] = new.meta[key]
    hashes = dict(base.pager_hashes)
    if "pagers" in components or "decode_index" in components:
        meta["pagers"] = sorted(set(base.meta.get("pagers", [])) | set(new.meta.get("pagers", [])))
        hashes.update(new.pager_hashes)
    return CalibrationProfile(
        machine=dict(base.machine), versions=dict(base.versions), pager_hashes=hashes, created=new.created,
        predictors=fit_profile_predictors(samples, stat), meta=meta, samples=samples,
    )


def run_calibration(
    settings: CalibrationSettings | None = None,
    *,
    model: Any = None,
    tokenizer: Any = None,
    model_name: str = "smollm2-135m-instruct",
    components: Sequence[str] = tuple(COMPONENTS),
    base: CalibrationProfile | None = None,
    out: str | Path | None = None,
    log: Callable[[str], None] = print,
) -> CalibrationProfile:
    """Measure ``components`` (model, pagers, pool, loader) as ``settings`` say and return a `CalibrationProfile`
    (written to ``out`` when given). With ``base``, only ``components`` are re-measured and the rest is kept
    (`merge_profiles`).

    ``model``/``tokenizer`` default to `icecache.load_model()`; tests pass a tiny model (and no tokenizer).
    """
    import torch

    from icecache.indexes import available_pagers

    unknown = set(components) - set(COMPONENTS)
    if unknown:
        raise ConfigError(f"unknown calibration components {sorted(unknown)}; known: {sorted(COMPONENTS)}")
    s = settings or CalibrationSettings()
    t0 = time.perf_counter()
    info = machine_info()
    if model is None:
        from icecache.runtime.models import load_model

        model, tokenizer = load_model()
    model.eval()
    shape: ModelShape = shape_from_config(model.config, model_name)
    log(f"calibrating {', '.join(components)} on {info['cpu_model']} ({info['cpu_count']} CPUs, torch threads "
        f"{info['torch_threads']}, load average {info['loadavg_start']})")
    samples: dict[str, Any] = {}
    n_ids = max(s.qk_tokens, max(s.prefill_tokens), max(s.pipeline_tokens) if "pipeline" in components else 0,
                max(s.decode_sizes) + _default_sink_window() if "decode_index" in components else 0)
    if tokenizer is not None:
        ids = prompt_ids(tokenizer, n_ids)
    else:
        ids = torch.randint(0, model.config.vocab_size, (1, n_ids), generator=torch.Generator().manual_seed(s.seed))
    if "model" in components:
        log("decode step vs context ...")
        samples["decode_step"] = measure_decode_step(model, s.contexts, s.reps, s.seed)
        log("attention vs KV tokens ...")
        samples["attention"] = measure_attention(model, s.attention_tokens, s.reps, s.seed)
        samples["lm_head"] = measure_lm_head(model, s.reps)
        log("prefill vs tokens ...")
        samples["prefill"] = measure_prefill(model, ids, s.prefill_tokens, s.reps)
        log("generate's per-step overhead ...")
        samples["generate_step"] = measure_generate_step(model, ids[:, : s.generate_prompt_tokens], s.generate_new_tokens, s.reps, s.seed)
    names: list[str] = []
    pool_name = None
    g, d = shape.group_size, shape.head_dim
    if "pagers" in components or "pool" in components or "decode_index" in components:
        if "pagers" in components or "pool" in components:  # decode_index runs the model itself
            log(f"capturing keys and queries ({s.qk_tokens} tokens) ...")
            cap: dict[str, float] = {}
            q, k = capture_qk(model, ids[:, : s.qk_tokens], cap)
            if "model" in components and s.qk_tokens > max(s.prefill_tokens):  # that capture is a prefill too
                samples["prefill"].append({"tokens": s.qk_tokens, "seconds": [cap["forward_s"]], "note": "the key/query capture run"})
            pool = KeyPool(q, k)
            g, d = pool.g, pool.d
        names = list(s.pagers) if s.pagers is not None else available_pagers()
        missing = [n for n in names if n not in available_pagers()]
        if missing:
            log(f"pagers not available, skipped: {missing}")
        names = [n for n in names if n in available_pagers()]
        if "mdci" not in available_pagers():
            log("note: pager 'mdci' is not registered yet; the icecache variants need --pager until it is calibrated")
        if "pagers" in components:
            samples["pagers"] = {}
            for name in names:
                log(f"pager {name} ...")
                samples["pagers"][name] = measure_pager(
                    name, pool, s.pager_sizes, s.page_sizes, s.budgets, s.reps, s.insert_reps, s.pager_time_limit_s, s.seed, log
                )
        if "decode_index" in components:
            page = 16 if 16 in s.page_sizes else s.page_sizes[0]
            samples["decode_index"] = {}
            for name in names:
                log(f"pager {name} inside the runtime's decode (budget {max(s.budgets)}, page {page}) ...")
                samples["decode_index"][name] = measure_decode_index(
                    model, ids, name, s.decode_sizes, s.decode_steps, max(s.budgets), page, s.decode_dense_layers, s.decode_rounds,
                    s.seed, log)
        pool_name = "mdci" if "mdci" in names else (names[0] if names else None)
        if "pool" in components and pool_name:
            log(f"thread pool ({pool_name}, {shape.kv_heads} heads) ...")
            samples["pool"] = measure_pool(pool_name, pool, shape.kv_heads, min(s.pool_size, pool.keys.shape[0] // 2),
                                           16 if 16 in s.page_sizes else s.page_sizes[0], max(s.budgets), s.pool_threads, s.reps, s.seed)
    if "pool" in components and pool_name:
        log("background share (foreground slowdown per second of background index work) ...")
        n_bg = min(s.pool_size, pool.keys.shape[0] // 2)
        samples["background"] = measure_background_share(
            model, pool, s.background_context, min(s.background_prefill_tokens, ids.shape[1]), ids, n_bg,
            16 if 16 in s.page_sizes else s.page_sizes[0], s.reps, pool_name, s.seed)
    if "loader" in components:
        log("runtime layer (bulk loader, window append, per-layer overhead) ...")
        samples["runtime_layer"] = measure_runtime_layer(
            sorted({1, shape.kv_heads}), shape.group_size, shape.head_dim, model.dtype, s.runtime_layer_n, max(s.budgets),
            16 if 16 in s.page_sizes else s.page_sizes[0], [k for k in s.runtime_new_tokens if k <= max(s.budgets)], s.reps * 2, s.seed)
        log("sparse attention kernel vs device slots ...")
        samples["sparse_attention"] = measure_sparse_attention(shape.q_heads, shape.kv_heads, shape.head_dim, s.sparse_slots, s.reps,
                                                               s.seed)
        log("host store writes of a prefill job vs tokens ...")
        samples["store_sync"] = measure_store_sync(shape.head_dim, model.dtype, s.store_sync_tokens,
                                                   16 if 16 in s.page_sizes else s.page_sizes[0], s.reps, s.seed)
    if "pipeline" in components:
        pipe_pagers = [p for p in (s.pagers if s.pagers is not None else ("mdci", "sequential")) if p in available_pagers()]
        log(f"real prefills: full vs the runtime's pipeline with {', '.join(pipe_pagers)} at {list(s.pipeline_tokens)} tokens ...")
        samples["prefill_pipeline"] = measure_prefill_pipeline(
            model, ids, s.pipeline_tokens, pipe_pagers, 16 if 16 in s.page_sizes else s.page_sizes[0], max(s.budgets), 1,
            s.pipeline_rounds, s.seed)
    info["loadavg_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    wall = time.perf_counter() - t0
    created = _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")
    profile = CalibrationProfile(
        machine=info,
        versions=software_versions(),
        pager_hashes=pager_code_hashes(names),
        created=created,
        predictors=fit_profile_predictors(samples, s.statistic),
        meta={
            "model": model_name,
            "shape": shape_to_dict(shape),
            "dtype_bytes": int(torch.tensor([], dtype=model.dtype).element_size()),
            "attn_implementation": model.config._attn_implementation,
            "queries_per_select": g,
            "head_dim": d,
            "pool_pager": pool_name,
            "pool_efficiency": pool_efficiency(samples["pool"], s.statistic) if "pool" in samples else {"1": 1.0},
            **background_meta(samples.get("background")),
            "pagers": names,
            "settings": asdict(s),
            "wall_s": wall,
            "statistic": s.statistic,
            "runs": [{"created": created, "components": list(components), "loadavg_start": info["loadavg_start"],
                      "loadavg_end": info["loadavg_end"], "wall_s": wall}],
            "notes": "shared 2-core machine: timings are noisy (see runs[].loadavg_*); points are interleaved "
                     "rounds after warm-up, each summarised by `statistic`; raw samples kept",
        },
        samples=samples,
    )
    if base is not None:
        profile = merge_profiles(base, profile, components)
    if out is not None:
        profile.save(out)
        log(f"wrote {out} ({wall:.0f} s)")
    return profile


def summarize_profile(profile: CalibrationProfile) -> str:
    """A short human-readable table of the fitted predictors."""
    lines = [f"profile {profile.created} on {profile.machine.get('cpu_model')} ({profile.machine.get('cpu_count')} CPUs)"]
    for name, p in sorted(profile.predictors.items()):
        rng = ", ".join(f"{f} {lo:g}..{hi:g}" for f, lo, hi in zip(p.features, p.lo, p.hi))
        if p.form == "pwpower":  # the curve at the knots, other features at their smallest measured value
            k = int(p.params[0])
            pts = ", ".join(f"{math.exp(a):.0f}:{p.formula([math.exp(a), *p.lo[1:]]) * 1e3:.3g}ms" for a in p.params[1 : 1 + k])
            exps = ", ".join(f"{f}^{e:.2f}" for f, e in zip(p.features[1:], p.params[1 + 2 * k :]))
            at = ", ".join(f"{f}={lo:g}" for f, lo in zip(p.features[1:], p.lo[1:]))
            params = f"n:t {pts}" + (f" at {at}; x {exps}" if exps else "")
        else:
            params = ", ".join(f"{v:.4g}" for v in p.params)
        lines.append(f"  {name:22s} {p.form:9s} [{params}]  fit MAPE {p.fit_mape * 100:5.1f}%  ({rng})")
    lines.append(f"  pool efficiency: {profile.meta.get('pool_efficiency')}")
    return "\n".join(lines)


def check_profile(path: str | Path) -> list[str]:
    """`icecache.measure.stack.profile_mismatches` of the profile at ``path`` (empty: measured with this stack)."""
    return profile_mismatches(CalibrationProfile.load(path))


def _csv(text: str) -> list[str]:
    return [t.strip() for t in str(text).split(",") if t.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="icecache calibrate", allow_abbrev=False,
                                description="time this machine's components and write a calibration profile for the simulator")
    p.add_argument("--out", help="the profile to write (with --update: to re-measure in place)")
    p.add_argument("--quick", action="store_true", help="a few seconds of tiny measurements (smoke test only)")
    p.add_argument("--pagers", help="comma list of pagers to time, or 'all' (default: mdci,sequential, the variants' pagers)")
    p.add_argument("--components", help=f"comma list of {','.join(COMPONENTS)} (default: all)")
    p.add_argument("--update", action="store_true", help="re-measure only --components and keep the rest of --out")
    p.add_argument("--check", nargs="?", const="", metavar="PROFILE",
                   help="compare a profile's library versions and pager code with this stack (default: the profile "
                        "shipped with icecache) and exit 1 when they differ; measures nothing")
    return p


def check_writable(path: str | os.PathLike) -> None:
    """Refuse (`ConfigError`) an output file that could not be written, before minutes of measuring: a directory,
    or a file whose nearest existing folder is not writable."""
    target = Path(path)
    if target.is_dir():
        raise ConfigError(f"--out {target} is a directory; name the profile file to write, e.g. {target / 'profile.json'}")
    folder = target.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        if target.exists():
            with open(target, "a"):  # opened for appending, nothing written: its contents and time stay
                pass
        else:
            with tempfile.TemporaryFile(dir=folder):
                pass
    except OSError as exc:
        raise ConfigError(f"--out {target} cannot be written: {exc.strerror or exc}") from None


def main(argv: Sequence[str] | None = None) -> int:
    """``icecache calibrate``: measure and write a profile, or ``--check`` one; a bad input prints ``error: ...``
    on one line and returns 2."""
    args = build_parser().parse_args(argv)

    def run() -> int:
        if args.check is not None:
            path = Path(args.check) if args.check else default_profile_path()
            problems = check_profile(path)
            if problems:
                print(f"{path} was measured on another stack: " + "; ".join(problems))
                return 1
            print(f"{path} was measured with this stack (library versions and pager code)")
            return 0
        if not args.out:
            raise ConfigError("calibrate needs --out PROFILE.json (the file to write), or --check")
        check_writable(args.out)
        s = CalibrationSettings.quick() if args.quick else CalibrationSettings()
        if args.pagers:
            s = replace(s, pagers=None if args.pagers == "all" else tuple(_csv(args.pagers)))
        comps = tuple(_csv(args.components)) if args.components else tuple(COMPONENTS)
        base = CalibrationProfile.load(args.out) if args.update else None
        prof = run_calibration(s, components=comps, base=base, out=args.out)
        print(summarize_profile(prof))
        return 0

    return run_reporting_errors(run, prog="icecache calibrate")


if __name__ == "__main__":
    sys.exit(main())
