"""``python -m icecache.sim {calibrate,sweep,validate,crossover,paper,project,hardware,models}``.

    python -m icecache.sim calibrate --out experiments/sim/profile_this_machine.json
    python -m icecache.sim sweep --hardware a100,h100 --model llama-3.1-8b --context 8k..256k \\
        --budgets 64,128,256 --page-sizes 8,16,32 --threads 8,16,64 --variants full,icecache,icecache-r,quest
    python -m icecache.sim validate --runs experiments/sim/measured_runs.jsonl
    python -m icecache.sim crossover --hardware h100 --model qwen3-4b
    python -m icecache.sim project --model gemma-3-270m --hardware this-machine --context 2048..32768
    python -m icecache.sim hardware            # every constant with its source
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Sequence

DEFAULT_PROFILE = Path("experiments/sim/profile_this_machine.json")


def _csv(text: str) -> list[str]:
    return [t.strip() for t in str(text).split(",") if t.strip()]


def _ints(text: str) -> list[int]:
    from icecache.sim.model import parse_tokens

    return [parse_tokens(t) for t in _csv(text)]


def _profile_path(arg: str | None) -> Path:
    import os

    if arg:
        return Path(arg)
    env = os.environ.get("ICECACHE_SIM_PROFILE")
    if env:
        return Path(env)
    here = Path(__file__).resolve().parents[2] / DEFAULT_PROFILE
    return here if here.is_file() else DEFAULT_PROFILE


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", help="calibration profile JSON (default: $ICECACHE_SIM_PROFILE or experiments/sim/profile_this_machine.json)")
    p.add_argument("--extrapolation", choices=("refuse", "warn", "allow"), default="allow",
                   help="outside the measured ranges: refuse, warn, or go on silently (always noted per row)")
    p.add_argument("--hit", nargs="+", action="extend", default=[],
                   help="hit-rate source: a fitted hit model (.json) or selection traces (.jsonl or .jsonl.gz, several); default: prior")
    p.add_argument("--strict-profile", action="store_true", help="fail when the profile was measured on another stack")


def cmd_calibrate(args: argparse.Namespace) -> int:
    from icecache.sim.calibrate import CalibrationSettings, run_calibration, summarize_profile

    s = CalibrationSettings.quick() if args.quick else CalibrationSettings()
    if args.pagers:
        from dataclasses import replace

        s = replace(s, pagers=None if args.pagers == "all" else tuple(_csv(args.pagers)))
    from icecache.sim.calibrate import COMPONENTS
    from icecache.sim.costs import CalibrationProfile

    comps = tuple(_csv(args.components)) if args.components else tuple(COMPONENTS)
    base = CalibrationProfile.load(args.out) if args.update else None
    prof = run_calibration(s, components=comps, base=base, out=args.out)
    print(summarize_profile(prof))
    return 0


def cmd_sweep(args: argparse.Namespace) -> int:
    from icecache.sim.sweep import SweepSpec, run_sweep_cli

    spec = SweepSpec.from_strings(
        hardware=args.hardware, models=args.model, contexts=args.context, budgets=args.budgets,
        page_sizes=args.page_sizes, threads=args.threads, variants=args.variants, reuse=args.reuse, impl=args.impl,
        dense_layers=_dense_layers(args.dense_layers),
    )
    return run_sweep_cli(spec, args, argv=args.argv)


def _dense_layers(text: str) -> int:
    """``--dense-layers``: a count of leading layers, or ``none`` (0)."""
    t = str(text).strip().lower()
    if t in ("none", ""):
        return 0
    from icecache.core.errors import ConfigError

    try:
        return int(t)
    except ValueError:
        raise ConfigError(f"--dense-layers takes a number of leading layers or 'none', got {text!r}") from None


def cmd_validate(args: argparse.Namespace) -> int:
    from icecache.sim.validate import run_validate_cli

    return run_validate_cli(args)


def cmd_crossover(args: argparse.Namespace) -> int:
    from icecache.sim.sweep import crossover_report

    print(crossover_report(args))
    return 0


def cmd_paper(args: argparse.Namespace) -> int:
    from icecache.sim.sweep import paper_report

    text = paper_report(args)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


def cmd_project(args: argparse.Namespace) -> int:
    from icecache.sim.sweep import projection

    _, md, paths = projection(args)
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
    ap = argparse.ArgumentParser(prog="python -m icecache.sim", description="IceCache timing simulator")
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("calibrate", help="time the real components here and write a profile")
    p.add_argument("--out", default=str(DEFAULT_PROFILE))
    p.add_argument("--quick", action="store_true", help="a few seconds of tiny measurements (smoke test only)")
    p.add_argument("--pagers", help="comma list of pagers to time, or 'all' (default: mdci,sequential, the variants' pagers)")
    p.add_argument("--components", help="comma list of model,pagers,pool,loader,pipeline,decode_index (default: all)")
    p.add_argument("--update", action="store_true", help="re-measure only --components and keep the rest of --out")
    p.set_defaults(fn=cmd_calibrate)

    p = sub.add_parser("sweep", help="simulate a grid of configurations; CSV + Markdown + plots")
    p.add_argument("--hardware", default="a100,h100")
    p.add_argument("--model", default="llama-3.1-8b", help="comma list of model shapes")
    p.add_argument("--context", default="8k..256k", help="'8k..256k' (doubling), '8k..256k:12' (12 log-spaced), or a list")
    p.add_argument("--budgets", default="64,128,256")
    p.add_argument("--page-sizes", default="8,16,32")
    p.add_argument("--threads", default="8,16,64")
    p.add_argument("--variants", default="full,icecache,icecache-r,quest")
    p.add_argument("--reuse", type=int, default=4, help="icecache-r: layers per selection")
    p.add_argument("--impl", choices=("runtime", "paper"), default="runtime",
                   help="runtime: our runtime (selects on the caller's thread, prefetched inserts); paper: the paper's")
    p.add_argument("--dense-layers", default="2", help="leading layers kept dense (full KV), or 'none'")
    p.add_argument("--out-dir", default="experiments/sim/sweep")
    p.add_argument("--workers", type=int, default=0, help="processes (0: one per CPU)")
    p.add_argument("--backend", choices=("process", "serial", "ray"), default="process")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--no-prefill", action="store_true", help="skip TTFT/TT2T (faster)")
    _add_common(p)
    p.set_defaults(fn=cmd_sweep)

    p = sub.add_parser("validate", help="predict measured runs; MAPE, bias, Kendall tau")
    p.add_argument("--runs", required=True, help="JSON lines of measured runs (experiments/sim/measure_runs.py)")
    p.add_argument("--holdout", choices=("context", "threads", "random", "none"), default="context",
                   help="which runs fit the per-stage corrections (the rest are scored)")
    p.add_argument("--out", help="write the report (Markdown) here; JSON next to it")
    _add_common(p)
    p.set_defaults(fn=cmd_validate)

    p = sub.add_parser("crossover", help="context where IceCache gets faster than full KV, and what drives it")
    p.add_argument("--hardware", default="h100")
    p.add_argument("--model", default="qwen3-4b")
    p.add_argument("--budget", type=int, default=256)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--threads", type=int, default=64)
    p.add_argument("--variant", default="icecache")
    p.add_argument("--reuse", type=int, default=4)
    p.add_argument("--impl", choices=("runtime", "paper"), default="paper",
                   help="paper (default: the comparison is with the paper's crossover) or runtime")
    _add_common(p)
    p.set_defaults(fn=cmd_crossover)

    p = sub.add_parser("paper", help="the paper's A100 36k breakdown: fed to the engine, and predicted")
    p.add_argument("--out", help="also write the Markdown table here")
    _add_common(p)
    p.set_defaults(fn=cmd_paper)

    p = sub.add_parser("project", help="TPOT vs context of a few variants for one model and machine: .csv, .md, .png")
    p.add_argument("--model", default="gemma-3-270m")
    p.add_argument("--hardware", default="this-machine")
    p.add_argument("--context", default="2048..32768", help="as for sweep")
    p.add_argument("--variants", default="full,icecache")
    p.add_argument("--budget", type=int, default=256)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--sink", type=int, default=4)
    p.add_argument("--window", type=int, default=64)
    p.add_argument("--dense-layers", default="none", help="leading layers kept dense (full KV), or 'none'")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reuse", type=int, default=4)
    p.add_argument("--impl", choices=("runtime", "paper"), default="runtime")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--out", default=None, help="write <out>.csv/.md/.png (path without suffix); default: print only")
    p.add_argument("--no-plots", action="store_true")
    _add_common(p)
    p.set_defaults(fn=cmd_project)

    p = sub.add_parser("hardware", help="list hardware constants with sources")
    p.add_argument("--json", help="also write them as JSON")
    p.set_defaults(fn=cmd_hardware)

    p = sub.add_parser("models", help="list model shapes")
    p.set_defaults(fn=cmd_models)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(argv) if argv is not None else sys.argv[1:]
    from icecache.core.errors import IceCacheError

    try:
        return int(args.fn(args) or 0)
    except IceCacheError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
