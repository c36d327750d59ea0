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
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

from icecache.sim.costs import CalibrationProfile, MeasuredCosts  # noqa: E402
from icecache.sim.shapes import shape_from_config  # noqa: E402

# The tiny soak's cache configuration (experiments/soak.py), for soak files written before runs recorded theirs.
BUDGET, PAGE, SINK, WINDOW = 64, 8, 4, 32


def window_n(prompt: int, steps: int, which: str, sink: int = SINK, window: int = WINDOW) -> int:
    """Indexed tokens per head in the middle of the soak's ``which`` window."""
    w0 = min(50, steps // 10)
    tenth = max(steps // 10, 1)
    mid = w0 + tenth // 2 if which == "warm" else steps - tenth // 2
    return prompt + mid - sink - window


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("soak_json")
    ap.add_argument("--profile", default="experiments/sim/profile_this_machine.json")
    ap.add_argument("--out", default=None, help="Markdown file (default: drift_vs_sim.md beside the soak file)")
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
    from conftest import make_tiny_llama

    data = json.loads(Path(args.soak_json).read_text())
    runs = data["runs"] if isinstance(data, dict) else data
    tiny = make_tiny_llama(seed=0, max_position_embeddings=1 << 16)
    shape = shape_from_config(tiny.config, "tiny-random-llama")
    if args.calibrate_tiny:
        if not args.tiny_profile:
            raise SystemExit("--calibrate-tiny needs --tiny-profile PATH to write")
        from icecache.sim.calibrate import CalibrationSettings, run_calibration

        sizes = (1024, 2048, 4096, 8192, 16384, 24000)
        settings = CalibrationSettings(qk_tokens=24600, pager_sizes=sizes, page_sizes=(PAGE,), budgets=(BUDGET,),
                                       pagers=tuple(args.tiny_pagers.split(",")), pager_time_limit_s=120.0, decode_sizes=sizes, decode_steps=60, decode_rounds=3,
                                       decode_dense_layers=())  # as the drift soaks: every layer sparse
        run_calibration(settings, model=tiny, model_name="tiny-random-llama", components=("pagers", "decode_index"),
                        out=args.tiny_profile)
    profile_path = args.tiny_profile or args.profile
    from icecache.sim.shapes import get_shape

    shapes = {  # model -> (shape, costs): the tiny model with its own profile when given; SmolLM2 with the main one
        "tiny-random-llama": (shape, MeasuredCosts(CalibrationProfile.load(profile_path), extrapolation="warn")),
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
            raise SystemExit(f"{args.soak_json}: run {r['index']} does not record its dense layers; pass --dense-layers")
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
        rows.append({
            "model": r["model"], "background_inserts": r.get("background_inserts", True), "pager": r["index"], "dense_layers": dense, "tpot_warm_ms": r["tpot_warm_ms"], "tpot_end_ms": r["tpot_end_ms"],
            "tpot_drift": r["tpot_drift"], "index_warm_ms": r["index_warm_ms"], "index_end_ms": r["index_end_ms"],
            "sim_index_warm_ms": pred["warm"], "sim_index_end_ms": pred["end"],
            "drift_apart_from_sim_growth": (r["tpot_end_ms"] - grow_pred) / r["tpot_warm_ms"] - 1.0,
            "drift_apart_from_measured_growth": (r["tpot_end_ms"] - grow_meas) / r["tpot_warm_ms"] - 1.0,
            "sim_dense_growth_ms": dense_pred,
            "drift_apart_from_sim_growth_and_dense": (r["tpot_end_ms"] - grow_pred - dense_pred) / r["tpot_warm_ms"] - 1.0,
            "notes": sorted(set(notes)),
        })
    lines = [
        (f"Simulator select time of SmolLM2 runs x{select_factor:.2f} (select-stage correction of `{args.corrections}`).\n\n"
         if args.corrections else "") +
        f"Soak: `{args.soak_json}`; simulator profile: `{profile_path}`. Index work = select + insert + waits for "
        f"background inserts, per decode step (ms).",
        "",
        "| model | pager | inserts | dense layers | TPOT warm -> end ms | drift | index warm -> end, measured | simulator | drift apart from the simulator's index growth | ... and the dense layers' growth (simulator) | apart from the measured index growth |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for x in rows:
        lines.append(
            f"| {x['model']} | {x['pager']} | {'background' if x['background_inserts'] else 'synchronous'} | {','.join(map(str, x['dense_layers'])) or 'none'} | {x['tpot_warm_ms']:.2f} -> {x['tpot_end_ms']:.2f} | "
            f"{100 * x['tpot_drift']:+.0f}% | {x['index_warm_ms']:.2f} -> {x['index_end_ms']:.2f} | "
            f"{x['sim_index_warm_ms']:.2f} -> {x['sim_index_end_ms']:.2f} | {100 * x['drift_apart_from_sim_growth']:+.1f}% | "
            f"{100 * x['drift_apart_from_sim_growth_and_dense']:+.1f}% ({x['sim_dense_growth_ms']:.2f} ms) | "
            f"{100 * x['drift_apart_from_measured_growth']:+.1f}% |"
        )
    for x in rows:
        if x["notes"]:
            lines.append(f"\n{x['pager']}: simulator notes: " + "; ".join(x["notes"]))
    text = "\n".join(lines)
    print(text)
    out = Path(args.out) if args.out else Path(args.soak_json).with_name("drift_vs_sim.md")
    out.write_text("# TPOT drift apart from index growth\n\nCommand: `python experiments/reliability/drift_vs_sim.py "
                   + " ".join(sys.argv[1:]) + "`\n\n" + text + "\n")
    out.with_suffix(".json").write_text(json.dumps(rows, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
