"""TPOT drift of a soak run apart from the index growth the simulator predicts (issue 8, item 1).

Reads a ``soak.json`` written by ``experiments/soak.py`` (tiny random Llama runs) and the simulator's
calibration profile, and for each run compares:

- the measured step time after warm-up and at the end (``tpot_warm_ms`` / ``tpot_end_ms``),
- the measured index work per step (select + insert + waits for background inserts: ``index_*_ms``),
- the simulator's index work per step at the same index sizes: sparse layers x KV heads x (one select of the
  GQA group over n tokens + one insert into an index of n tokens), from `icecache.sim.costs.MeasuredCosts`
  with the tiny model's shape,

and reports the drift that remains once the predicted (and, for reference, the measured) index growth is
taken out: ``(tpot_end - growth) / tpot_warm - 1``. The soak's windows: warm = the tenth of the steps after
the first ``min(50, n/10)``, end = the last tenth; n at a window = prompt + its middle step - sink - window.

    python experiments/reliability/drift_vs_sim.py experiments/reliability/soak_tiny_nodense/soak.json

Given several soak files (repeats of the same soak), it also reports, per model / pager / insert mode, the median
and the range of the drifts over the repeats: on a shared 2-core machine identical runs differ by more than the
10% being measured, and the median of repeats is the figure that does not hinge on one run's luck.

    python experiments/reliability/drift_vs_sim.py experiments/reliability/soak_tiny_bg_rep{1,2,3}/soak.json \
        --tiny-profile experiments/reliability/profile_tiny_heap.json --out experiments/reliability/drift_bg_repeats.md
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

from icecache.sim.cost_models import MeasuredCosts
from icecache.sim.profile import CalibrationProfile
from icecache.sim.shapes import shape_from_config

# The tiny soak's cache configuration (experiments/soak.py), for soak files written before runs recorded theirs.
BUDGET, PAGE, SINK, WINDOW = 64, 8, 4, 32


def window_n(prompt: int, steps: int, which: str, sink: int = SINK, window: int = WINDOW) -> int:
    """Indexed tokens per head in the middle of the soak's ``which`` window."""
    w0 = min(50, steps // 10)
    tenth = max(steps // 10, 1)
    mid = w0 + tenth // 2 if which == "warm" else steps - tenth // 2
    return prompt + mid - sink - window


def summarise_repeats(rows: list[dict], target: float = 0.10) -> list[str]:
    """Markdown lines: per model / pager / insert mode, the median and range of the drifts over repeated runs."""
    groups: dict[tuple, list[dict]] = {}
    for x in rows:
        groups.setdefault((x["model"], x["pager"], x["background_inserts"]), []).append(x)
    lines = ["", f"Over repeats (target: drift apart from the simulator's index growth at most +{100 * target:.0f}%):", "",
             "| model | pager | inserts | runs | TPOT drift, median | apart from the simulator's index growth: median | range | apart from the measured index growth: median | range | apart from the simulator's whole-step growth: median | range | median within target |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for (model, pager, bg), xs in groups.items():
        sim = [x["drift_apart_from_sim_growth"] for x in xs]
        meas = [x["drift_apart_from_measured_growth"] for x in xs]
        raw = [x["tpot_drift"] for x in xs]
        med = statistics.median(sim)
        step = [x["drift_apart_from_sim_step_growth"] for x in xs if "drift_apart_from_sim_step_growth" in x]
        lines.append(f"| {model} | {pager} | {'background' if bg else 'synchronous'} | {len(xs)} | {100 * statistics.median(raw):+.0f}% | "
                     f"**{100 * med:+.1f}%** | {100 * min(sim):+.1f}% .. {100 * max(sim):+.1f}% | "
                     f"{100 * statistics.median(meas):+.1f}% | {100 * min(meas):+.1f}% .. {100 * max(meas):+.1f}% | "
                     + (f"{100 * statistics.median(step):+.1f}% | {100 * min(step):+.1f}% .. {100 * max(step):+.1f}% | " if step else "- | - | ")
                     + f"{'yes' if med <= target else 'no'} |")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("soak_json", nargs="+", help="one or more soak.json files (several: repeats, summarised by median)")
    ap.add_argument("--profile", default="experiments/sim/profile_this_machine.json")
    ap.add_argument("--out", default=None, help="Markdown file (default: drift_vs_sim.md beside the soak file; "
                                                "required with several soak files)")
    ap.add_argument("--tiny-profile", default=None,
                    help="a profile whose pagers were timed on the tiny model's own keys (made here with --calibrate-tiny); "
                         "used instead of --profile, no shape scaling")
    ap.add_argument("--calibrate-tiny", action="store_true",
                    help="time --tiny-pagers' select and insert on the tiny random model's keys (1k..24k per head), alone "
                         "and inside the runtime's decode (every layer sparse), and write --tiny-profile (a few minutes)")
    ap.add_argument("--tiny-pagers", default="mdci,sequential", help="pagers --calibrate-tiny times")
    ap.add_argument("--corrections", default=None,
                    help="validation.json of `python -m icecache.sim validate`: its select-stage factor (runtime / "
                         "microbenchmark, fitted on held-in runs) scales the simulator's select time of SmolLM2 runs")
    ap.add_argument("--dense-layers", default=None,
                    help="the soak's dense layers, for reports written before soak runs recorded them (e.g. '' or '0')")
    args = ap.parse_args()
    if len(args.soak_json) > 1 and not args.out:
        ap.error("several soak files: pass --out for the combined report")
    from conftest import make_tiny_llama

    runs = []
    for path in args.soak_json:
        data = json.loads(Path(path).read_text())
        runs += [dict(r, soak_file=path) for r in (data["runs"] if isinstance(data, dict) else data)]
    tiny = make_tiny_llama(seed=0, max_position_embeddings=1 << 16)
    shape = shape_from_config(tiny.config, "tiny-random-llama")
    if args.calibrate_tiny:
        if not args.tiny_profile:
            raise SystemExit("--calibrate-tiny needs --tiny-profile PATH to write")
        from icecache.measure.calibrate import CalibrationSettings, run_calibration

        sizes = (1024, 2048, 4096, 8192, 16384, 24000)
        settings = CalibrationSettings(qk_tokens=24600, pager_sizes=sizes, page_sizes=(PAGE,), budgets=(BUDGET,),
                                       pagers=tuple(args.tiny_pagers.split(",")), pager_time_limit_s=120.0, decode_sizes=sizes, decode_steps=60, decode_rounds=3,
                                       decode_dense_layers=())  # as the drift soaks: every layer sparse
        run_calibration(settings, model=tiny, model_name="tiny-random-llama", components=("pagers", "decode_index"),
                        out=args.tiny_profile)
    profile_path = args.tiny_profile or args.profile
    from icecache.sim.shapes import get_shape

    tiny_profile = CalibrationProfile.load(profile_path)
    if args.tiny_profile and not any(k.startswith("step_decode/") for k in tiny_profile.predictors):
        # profiles written before the whole decode step had its predictor: fit it from the stored samples
        from icecache.measure.fitting import fit_profile_predictors

        fitted = fit_profile_predictors(tiny_profile.samples, tiny_profile.meta.get("statistic", "p25"))
        tiny_profile.predictors.update({k: v for k, v in fitted.items() if k.startswith("step_decode/")})
    step_timed = {p: (rows[0]["budget"], rows[0]["page_size"]) for p, rows in tiny_profile.samples.get("decode_index", {}).items() if rows}
    shapes = {  # model -> (shape, costs): the tiny model with its own profile when given; SmolLM2 with the main one
        "tiny-random-llama": (shape, MeasuredCosts(tiny_profile, extrapolation="warn")),
        "smollm2-135m-instruct": (get_shape("smollm2-135m-instruct"), MeasuredCosts(CalibrationProfile.load(args.profile), extrapolation="warn")),
    }
    select_factor = 1.0
    if args.corrections:
        select_factor = float(json.loads(Path(args.corrections).read_text())["corrections"]["stage_factors"]["select"])
    rows = []
    for r in runs:
        if "index_warm_ms" not in r or r.get("model") not in shapes:
            continue
        shape, costs = shapes[r["model"]]
        budget, page, sink, window = (r.get(k, d) for k, d in (("budget", BUDGET), ("page_size", PAGE), ("sink", SINK), ("window", WINDOW)))
        steps, prompt = r["new_tokens"], r["prompt_tokens"]
        if "dense_layers" in r:
            dense = r["dense_layers"]
        elif args.dense_layers is not None:
            dense = [int(x) for x in args.dense_layers.split(",") if x.strip()]
        else:
            raise SystemExit(f"{r['soak_file']}: run {r['index']} does not record its dense layers; pass --dense-layers")
        sparse_heads = (shape.layers - len(dense)) * shape.kv_heads
        notes: list[str] = []
        pred = {}
        for w in ("warm", "end"):
            n = window_n(prompt, steps, w, sink, window)
            factor = select_factor if r["model"] == "smollm2-135m-instruct" else 1.0
            per_head = factor * costs.select_job_s(shape, r["index"], n, budget, page, notes) + costs.insert_job_s(shape, r["index"], n, notes)
            pred[w] = 1e3 * sparse_heads * per_head
        grow_pred = pred["end"] - pred["warm"]
        # dense layers keep full KV by design: their attention grows with the context (simulator's in-model attention)
        ctx = {w: prompt + window_n(prompt, steps, w, 0, 0) for w in ("warm", "end")}
        dense_pred = 1e3 * len(dense) * (costs.attend_s(shape, ctx["end"], in_model=True, notes=notes)
                                         - costs.attend_s(shape, ctx["warm"], in_model=True, notes=notes)) if dense else 0.0
        grow_meas = r["index_end_ms"] - r["index_warm_ms"]
        interleaved = {}
        if "ref_end_ms" in r:  # a reference cache at warm-up size decoded in lockstep (soak(reference_every=...))
            factor = select_factor if r["model"] == "smollm2-135m-instruct" else 1.0
            n_ref = int(round(r["ref_end_n"]))
            ref_pred = 1e3 * sparse_heads * (factor * costs.select_job_s(shape, r["index"], n_ref, budget, page, notes)
                                             + costs.insert_job_s(shape, r["index"], n_ref, notes))
            interleaved = {
                "ref_end_ms": r["ref_end_ms"], "ref_end_n": r["ref_end_n"], "sim_index_ref_ms": ref_pred,
                "drift_vs_reference": r["tpot_drift_vs_reference"],
                "drift_vs_reference_apart_from_sim_growth": (r["tpot_end_ms"] - (pred["end"] - ref_pred)) / r["ref_end_ms"] - 1.0,
                "drift_vs_reference_apart_from_measured_growth": r["tpot_drift_vs_reference_without_index"],
            }
        # the whole step's growth as the simulator calibrated inside the runtime has it (fresh generations of the
        # tiny model at each size, every layer sparse, the same budget / page): TPOT ratios, so a machine that is
        # uniformly slower or faster at the end does not count
        if (r["model"] == "tiny-random-llama" and args.tiny_profile and step_timed.get(r["index"]) == (budget, page)
                and not dense and f"step_decode/{r['index']}" in costs.profile.predictors):
            S = {w: costs.decode_step_in_runtime_s(r["index"], window_n(prompt, steps, w, sink, window), notes) for w in ("warm", "end")}
            interleaved["sim_step_ratio"] = S["end"] / S["warm"]
            interleaved["drift_apart_from_sim_step_growth"] = r["tpot_end_ms"] / r["tpot_warm_ms"] / interleaved["sim_step_ratio"] - 1.0
            if "ref_end_ms" in r:
                S_ref = costs.decode_step_in_runtime_s(r["index"], int(round(r["ref_end_n"])), notes)
                interleaved["sim_step_ratio_vs_reference"] = S["end"] / S_ref
                interleaved["drift_vs_reference_apart_from_sim_step_growth"] = (
                    r["tpot_end_ms"] / r["ref_end_ms"] / interleaved["sim_step_ratio_vs_reference"] - 1.0)
        rows.append({
            "soak_file": r["soak_file"], "model": r["model"], "background_inserts": r.get("background_inserts", True), "pager": r["index"], "dense_layers": dense, "tpot_warm_ms": r["tpot_warm_ms"], "tpot_end_ms": r["tpot_end_ms"],
            "tpot_drift": r["tpot_drift"], "index_warm_ms": r["index_warm_ms"], "index_end_ms": r["index_end_ms"],
            "sim_index_warm_ms": pred["warm"], "sim_index_end_ms": pred["end"],
            "drift_apart_from_sim_growth": (r["tpot_end_ms"] - grow_pred) / r["tpot_warm_ms"] - 1.0,
            "drift_apart_from_measured_growth": (r["tpot_end_ms"] - grow_meas) / r["tpot_warm_ms"] - 1.0,
            "sim_dense_growth_ms": dense_pred,
            "drift_apart_from_sim_growth_and_dense": (r["tpot_end_ms"] - grow_pred - dense_pred) / r["tpot_warm_ms"] - 1.0,
            "notes": sorted(set(notes)),
            **interleaved,
        })
    lines = [
        (f"Simulator select time of SmolLM2 runs x{select_factor:.2f} (select-stage correction of `{args.corrections}`).\n\n"
         if args.corrections else "") +
        f"Soak: {', '.join(f'`{p}`' for p in args.soak_json)}; simulator profile: `{profile_path}`. Index work = select + insert + waits for "
        f"background inserts, per decode step (ms).",
        "",
        "| model | pager | inserts | dense layers | TPOT warm -> end ms | drift | index warm -> end, measured | simulator | drift apart from the simulator's index growth | ... and the dense layers' growth (simulator) | apart from the measured index growth | TPOT ratio end / warm vs the simulator's whole-step ratio (calibrated inside the runtime) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for x in rows:
        lines.append(
            f"| {x['model']} | {x['pager']} | {'background' if x['background_inserts'] else 'synchronous'} | {','.join(map(str, x['dense_layers'])) or 'none'} | {x['tpot_warm_ms']:.2f} -> {x['tpot_end_ms']:.2f} | "
            f"{100 * x['tpot_drift']:+.0f}% | {x['index_warm_ms']:.2f} -> {x['index_end_ms']:.2f} | "
            f"{x['sim_index_warm_ms']:.2f} -> {x['sim_index_end_ms']:.2f} | {100 * x['drift_apart_from_sim_growth']:+.1f}% | "
            f"{100 * x['drift_apart_from_sim_growth_and_dense']:+.1f}% ({x['sim_dense_growth_ms']:.2f} ms) | "
            f"{100 * x['drift_apart_from_measured_growth']:+.1f}% | "
            + (f"{x['tpot_end_ms'] / x['tpot_warm_ms']:.2f} vs {x['sim_step_ratio']:.2f}: {100 * x['drift_apart_from_sim_step_growth']:+.1f}% |"
               if "sim_step_ratio" in x else "- |")
        )
    if any("ref_end_ms" in x for x in rows):
        lines += ["", "Against a reference cache at warm-up size decoded in lockstep (same moments, same machine state):", "",
                  "| model | pager | inserts | TPOT end ms | reference (warm-size) TPOT ms, same moments | drift vs reference | "
                  "index work simulated: end vs reference size | drift vs reference apart from the simulator's index growth | "
                  "apart from the measured index growth | TPOT ratio end / reference vs the simulator's whole-step ratio "
                  "(calibrated inside the runtime) |", "|---|---|---|---|---|---|---|---|---|---|"]
        for x in rows:
            if "ref_end_ms" in x:
                lines.append(f"| {x['model']} | {x['pager']} | {'background' if x['background_inserts'] else 'synchronous'} | "
                             f"{x['tpot_end_ms']:.2f} | {x['ref_end_ms']:.2f} (n {x['ref_end_n']:.0f}) | {100 * x['drift_vs_reference']:+.0f}% | "
                             f"{x['sim_index_end_ms']:.2f} vs {x['sim_index_ref_ms']:.2f} | "
                             f"**{100 * x['drift_vs_reference_apart_from_sim_growth']:+.1f}%** | "
                             f"{100 * x['drift_vs_reference_apart_from_measured_growth']:+.1f}% | "
                             + (f"{x['tpot_end_ms'] / x['ref_end_ms']:.2f} vs {x['sim_step_ratio_vs_reference']:.2f}: "
                                f"**{100 * x['drift_vs_reference_apart_from_sim_step_growth']:+.1f}%** |"
                                if "sim_step_ratio_vs_reference" in x else "- |"))
    if len(args.soak_json) > 1:
        lines += summarise_repeats(rows)
    for x in rows:
        if x["notes"]:
            lines.append(f"\n{x['pager']}: simulator notes: " + "; ".join(x["notes"]))
    text = "\n".join(lines)
    print(text)
    out = Path(args.out) if args.out else Path(args.soak_json[0]).with_name("drift_vs_sim.md")
    out.write_text("# TPOT drift apart from index growth\n\nCommand: `python experiments/reliability/drift_vs_sim.py "
                   + " ".join(sys.argv[1:]) + "`\n\n" + text + "\n")
    out.with_suffix(".json").write_text(json.dumps(rows, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
