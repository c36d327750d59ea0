"""The simulator's commands: ``python -m icecache.sim {sweep,validate,crossover,paper,project,hardware,models}``
(`main`; ``icecache sim ...`` runs the same).

    python -m icecache.sim sweep --hardware a100,h100 --model llama-3.1-8b --context 8k..256k \\
        --budgets 64,128,256 --page-sizes 8,16,32 --threads 8,16,64 --variants full,icecache,icecache-r,quest \\
        --out results/sweep
    python -m icecache.sim validate --out /tmp/validation.md        # the shipped runs and profile
    python -m icecache.sim crossover --hardware h100 --model qwen3-4b
    python -m icecache.sim project --model gemma-3-270m --hardware this-machine --context 2048..32768
    python -m icecache.sim hardware            # every constant with its source

Every command reads a calibration profile (``--profile``, else ``$ICECACHE_SIM_PROFILE``, else the one shipped
with the package); ``icecache calibrate`` makes one. A bad input is a one-line ``error:`` and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from icecache.core.errors import run_reporting_errors

__all__ = ["build_parser", "main"]


def _csv(text: str) -> list[str]:
    return [t.strip() for t in str(text).split(",") if t.strip()]


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", help="calibration profile JSON (default: $ICECACHE_SIM_PROFILE or the profile shipped with icecache)")
    p.add_argument("--extrapolation", choices=("refuse", "warn", "allow"), default="allow",
                   help="outside the measured ranges: refuse, warn, or go on silently (always noted per row)")
    p.add_argument("--hit", nargs="+", action="extend", default=[],
                   help="hit-rate source: a fitted hit model (.json) or selection traces (.jsonl or .jsonl.gz, several); default: prior")


def _simulator(args: argparse.Namespace):
    from icecache.sim.inputs import load_hit, load_profile
    from icecache.sim.simulator import Simulator

    return Simulator(load_profile(args.profile), load_hit(args.hit, args.extrapolation), args.extrapolation)


def cmd_sweep(args: argparse.Namespace) -> int:
    from icecache.sim.inputs import command_line, load_hit, load_profile, parse_dense_layers
    from icecache.sim.sweep import SweepSpec, default_workers, reference_crossovers, run_configs, summary_markdown, write_results

    spec = SweepSpec.from_strings(
        hardware=args.hardware, models=args.model, contexts=args.context, budgets=args.budgets,
        page_sizes=args.page_sizes, threads=args.threads, variants=args.variants, reuse_every=args.reuse_every, impl=args.impl,
        dense_layers=parse_dense_layers(args.dense_layers),
    )
    profile = load_profile(args.profile)
    hit = load_hit(args.hit, args.extrapolation)
    configs = spec.configs()
    workers = args.workers or default_workers()
    print(f"simulating {len(configs)} configurations ({args.backend}, {workers} workers) ...")
    load = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    t0 = time.perf_counter()
    rows = run_configs(configs, profile, hit, extrapolation=args.extrapolation, workers=workers, backend=args.backend,
                       with_prefill=not args.no_prefill)
    wall = time.perf_counter() - t0
    print(f"done in {wall:.1f} s")
    summary = dict(command=command_line(args.argv), wall_s=wall, workers=workers, backend=args.backend, profile=profile, loadavg=load)
    if args.out:
        paths = write_results(rows, spec, args.out, plots=not args.no_plots, started=t0, **summary)
        figures = [p for p in paths if p.suffix == ".png"]
        print(f"wrote {paths[0]}, {paths[1]}" + (f", {len(figures)} plots" if figures else ""))
    else:
        print(summary_markdown(rows, spec, **summary))
        print("(nothing written: pass --out DIR for results.csv, summary.md and plots)")
    for x in reference_crossovers(rows, spec):
        print(f"  crossover {x['hardware']}/{x['model']}/{x['variant']}: {x['text']}")
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    from icecache.sim.inputs import check_writable, load_profile
    from icecache.sim.profile import default_runs_path
    from icecache.sim.simulator import Simulator
    from icecache.sim.validate import drift_note, read_runs, recorded_command, validate, validation_hit_model, write_report

    out = Path(args.out) if args.out else None
    if out is not None:
        check_writable([out, out.with_suffix(".json")], args.force)
    runs = read_runs(args.runs or default_runs_path())
    hit, hit_note, traced = validation_hit_model(runs, args.hit, args.holdout, args.extrapolation)
    sim = Simulator(load_profile(args.profile), hit, args.extrapolation)
    report = validate(runs, sim, args.holdout, traced=traced)
    report.notes = [n for n in (f"command: `{recorded_command(args.argv, args.runs)}`", hit_note, drift_note(runs)) if n]
    print(report.to_markdown())
    if out is not None:
        md, js = write_report(report, out)
        print(f"wrote {md} and {js}")
    return 0


def cmd_crossover(args: argparse.Namespace) -> int:
    from icecache.sim.config import SimConfig
    from icecache.sim.crossover import crossover_report

    cfg = SimConfig(args.model, args.hardware, args.variant, 100_000, budget=args.budget, page_size=args.page_size, threads=args.threads,
                    reuse_every=args.reuse_every, impl=args.impl)
    print(crossover_report(_simulator(args), cfg))
    return 0


def cmd_paper(args: argparse.Namespace) -> int:
    from icecache.sim.reports import paper_report

    text = paper_report(_simulator(args))
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


def cmd_project(args: argparse.Namespace) -> int:
    from icecache.sim.config import SimConfig
    from icecache.sim.inputs import command_line, parse_dense_layers
    from icecache.sim.reports import projection
    from icecache.sim.sweep import parse_contexts

    template = SimConfig(args.model, args.hardware, "full", max(args.budget, 1), budget=args.budget, page_size=args.page_size,
                         sink=args.sink, window=args.window, threads=args.threads, dense_layers=parse_dense_layers(args.dense_layers),
                         reuse_every=args.reuse_every, impl=args.impl, new_tokens=args.new_tokens, inserts=args.inserts)
    _, md, paths = projection(_simulator(args), template, parse_contexts(args.context), _csv(args.variants), out=args.out,
                              plots=not args.no_plots, command=command_line(args.argv))
    print(md)
    if paths:
        print("wrote " + ", ".join(str(p) for p in paths))
    return 0


def cmd_hardware(args: argparse.Namespace) -> int:
    from icecache.sim.hardware import HARDWARE

    rows = []
    for hw in HARDWARE.values():
        print(f"{hw.name}: {hw.description}")
        for path, q in hw.constants():
            flag = "calibrated" if q.calibrated else "prior"
            print(f"  {path:32s} {q.value:12.5g} {q.unit:28s} [{flag}] {q.source}")
            rows.append({"hardware": hw.name, "constant": path, **q.__dict__})
        print(f"  host.time_scale: fitted to {hw.host.time_scale_anchor} when a profile with mdci is given")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from icecache.sim.shapes import SHAPES

    for s in SHAPES.values():
        hybrid = f" sliding={s.num_sliding}x{s.sliding_window}" if s.num_sliding else ""
        print(f"{s.name:24s} L={s.layers:3d}{hybrid} q/kv={s.q_heads}/{s.kv_heads} d={s.head_dim} params={s.total_params() / 1e9:.3f}B "
              f"KV/token={s.kv_bytes_per_token(2) / 1024:.0f} KiB (bf16, all layers)  {s.source}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    import dataclasses

    from icecache.core.config import INSERT_MODES
    from icecache.sim.config import SimConfig

    sim_defaults = {f.name: f.default for f in dataclasses.fields(SimConfig)}  # one source of defaults
    ap = argparse.ArgumentParser(prog="python -m icecache.sim", description="IceCache timing simulator", allow_abbrev=False)
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("sweep", allow_abbrev=False, help="simulate a grid of configurations; CSV + Markdown + plots with --out")
    p.add_argument("--hardware", default="a100,h100")
    p.add_argument("--model", default="llama-3.1-8b", help="comma list of model shapes")
    p.add_argument("--context", default="8k..256k", help="'8k..256k' (doubling), '8k..256k:12' (12 log-spaced), or a list")
    p.add_argument("--budgets", default="64,128,256")
    p.add_argument("--page-sizes", default="8,16,32")
    p.add_argument("--threads", default="8,16,64")
    p.add_argument("--variants", default="full,icecache,icecache-r,quest")
    p.add_argument("--reuse-every", type=int, default=1,
                   help="icecache-r: sparse layers per selection, as IceCacheConfig.reuse_every (default 1)")
    p.add_argument("--impl", choices=("runtime", "paper"), default="runtime",
                   help="runtime: our runtime (selects on the caller's thread, prefetched inserts); paper: the paper's")
    p.add_argument("--dense-layers", default="0,1", help="layers kept dense (full KV), comma-separated, or 'none' (default 0,1)")
    p.add_argument("--out", "--out-dir", dest="out", default=None,
                   help="write results.csv, summary.md and the plots into this folder (default: print the summary only)")
    p.add_argument("--workers", type=int, default=0, help="processes (0: one per CPU)")
    p.add_argument("--backend", choices=("process", "serial", "ray"), default="process")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--no-prefill", action="store_true", help="skip TTFT/TT2T (faster)")
    _add_common(p)
    p.set_defaults(fn=cmd_sweep)

    p = sub.add_parser("validate", allow_abbrev=False, help="predict measured runs; MAPE, bias, Kendall tau")
    p.add_argument("--runs", default=None,
                   help="JSON lines of measured runs (experiments/sim/measure_runs.py; default: the runs shipped with icecache)")
    p.add_argument("--holdout", choices=("context", "threads", "random", "none"), default="context",
                   help="which runs fit the per-stage corrections (the rest are scored)")
    p.add_argument("--out", help="write the report (Markdown) here; JSON next to it")
    p.add_argument("--force", action="store_true", help="overwrite --out (and its JSON) when they exist")
    _add_common(p)
    p.set_defaults(fn=cmd_validate)

    p = sub.add_parser("crossover", allow_abbrev=False, help="context where IceCache gets faster than full KV, and what drives it")
    p.add_argument("--hardware", default="h100")
    p.add_argument("--model", default="qwen3-4b")
    p.add_argument("--budget", type=int, default=256)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--threads", type=int, default=64)
    p.add_argument("--variant", default="icecache")
    p.add_argument("--reuse-every", type=int, default=1, help="icecache-r: sparse layers per selection (default 1)")
    p.add_argument("--impl", choices=("runtime", "paper"), default="paper",
                   help="paper (default: the comparison is with the paper's crossover) or runtime")
    _add_common(p)
    p.set_defaults(fn=cmd_crossover)

    p = sub.add_parser("paper", allow_abbrev=False, help="the paper's A100 36k breakdown: fed to the engine, and predicted")
    p.add_argument("--out", help="also write the Markdown table here")
    _add_common(p)
    p.set_defaults(fn=cmd_paper)

    p = sub.add_parser("project", allow_abbrev=False, help="TPOT vs context of a few variants for one model and machine: .csv, .md, .png")
    p.add_argument("--model", default="gemma-3-270m")
    p.add_argument("--hardware", default="this-machine")
    p.add_argument("--context", default="2048..32768", help="as for sweep")
    p.add_argument("--variants", default="full,icecache")
    p.add_argument("--budget", type=int, default=256)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--sink", type=int, default=4)
    p.add_argument("--window", type=int, default=64)
    p.add_argument("--dense-layers", default="none", help="layers kept dense (full KV), comma-separated, or 'none' (default)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reuse-every", type=int, default=1, help="icecache-r: sparse layers per selection (default 1)")
    p.add_argument("--impl", choices=("runtime", "paper"), default="runtime")
    p.add_argument("--inserts", choices=INSERT_MODES, default=sim_defaults["inserts"],
                   help="where the runtime's decode inserts run, as IceCacheConfig.inserts (default: auto, as the runtime "
                        "decides on the profiled machine)")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--out", default=None, help="write <out>.csv/.md/.png (path without suffix); default: print only")
    p.add_argument("--no-plots", action="store_true")
    _add_common(p)
    p.set_defaults(fn=cmd_project)

    p = sub.add_parser("hardware", allow_abbrev=False, help="list hardware constants with sources")
    p.add_argument("--json", help="also write them as JSON")
    p.set_defaults(fn=cmd_hardware)

    p = sub.add_parser("models", allow_abbrev=False, help="list model shapes")
    p.set_defaults(fn=cmd_models)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    """Run one simulator command (``argv`` without the program name; None: ``sys.argv[1:]``). A bad input
    (`icecache.core.errors.IceCacheError`, or a file that cannot be read or written) prints ``error: ...`` on one
    line and returns 2."""
    args = build_parser().parse_args(argv)
    args.argv = list(argv) if argv is not None else sys.argv[1:]
    return run_reporting_errors(lambda: args.fn(args), prog="icecache sim")
