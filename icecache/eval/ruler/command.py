"""``icecache eval ruler``: build the spec from the command line, run it (in this process, on ``--workers`` local
processes or on Ray), write the outputs.

Outputs under ``--out``: ``predictions.jsonl`` (one line per finished unit, appended as it finishes),
``run.json`` (the settings), ``results.csv``, ``results.md`` (RULER-shaped tables, one per length) and
``results.png``. Interrupting (Ctrl-C) keeps every finished unit; running the same command again resumes.
"""

from __future__ import annotations

import argparse
import csv
import os
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from icecache.core.errors import ConfigError


def parse_ruler_length(text: str) -> int:
    """``--lengths`` item: ``"4k"`` -> 4096 (RULER's binary k, `icecache.core.spec.parse_ruler_length`); one-line
    `ConfigError` otherwise."""
    from icecache.core.spec import parse_ruler_length as parse

    try:
        value = parse(text)
    except ConfigError:
        raise ConfigError(f"--lengths: expected a token count like 4k or 8192, got {text!r}") from None
    if value < 1:
        raise ConfigError(f"--lengths: expected a positive token count, got {text!r}")
    return value


def _split(text: str) -> list[str]:
    from icecache.core.spec import split_items

    return split_items(text)


def spec_from_args(args: argparse.Namespace, config: Any) -> Any:
    from icecache.eval.methods import get_method
    from icecache.eval.ruler import TASKS
    from icecache.eval.ruler.peers import check_press
    from icecache.eval.ruler.runner import RulerSpec

    tasks = list(TASKS) if (args.tasks or "all").strip() == "all" else _split(args.tasks)
    unknown = [t for t in tasks if t not in TASKS]
    if unknown or not tasks:
        raise ConfigError(f"--tasks: unknown {unknown or tasks}; known: all or {', '.join(TASKS)}")
    methods = _split(args.methods)
    for m in methods:
        get_method(m).check(config)
    presses = _split(args.kvpress or "")
    for press in presses:
        check_press(press)
    methods += [f"kvpress:{p}" for p in presses]
    try:
        budgets = [int(b) for b in _split(args.budgets)]
    except ValueError:
        raise ConfigError(f"--budgets: expected comma-separated integers, got {args.budgets!r}") from None
    if not methods or not budgets or any(b < 0 for b in budgets):
        raise ConfigError("--methods and --budgets must be non-empty, budgets >= 0")
    from icecache.runtime.models import model_key

    model = model_key(args.model)
    return RulerSpec(
        model=model, tasks=tasks, lengths=[parse_ruler_length(x) for x in _split(args.lengths or "4k")], samples=args.samples,
        methods=methods, budgets=budgets, seed=42 if args.data_seed is None else args.data_seed, config=config,
        chat_template=False if args.no_chat_template else None,
    )


def write_outputs(records: Sequence[dict[str, Any]], out_dir: str | Path, task_order: Sequence[str], header: str = "") -> str:
    """``results.csv``, ``results.md``, ``results.png``; returns the markdown tables."""
    from icecache.eval.ruler.report import markdown, plot, results_rows, summarize

    out = Path(out_dir)
    summary = summarize(records)
    rows = results_rows(summary)
    cols = ["length", "method", "budget", "task", "score", "ci_low", "ci_high", "samples"]
    tmp = out / "results.csv.tmp"
    with open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=cols)
        writer.writeheader()
        writer.writerows(rows)
    os.replace(tmp, out / "results.csv")
    tables = markdown(summary, task_order) if summary else "\n(no finished cells yet)\n"
    (out / "results.md").write_text(header + tables + ("\n![RULER](results.png)\n" if summary else ""))
    if summary:
        plot(summary, out / "results.png")
    return tables


def _run_local(spec: Any, out: Path, progress: bool) -> list[dict[str, Any]]:
    from icecache.eval.ruler.runner import run_ruler
    from icecache.runtime.models import load_model

    model, tokenizer = load_model(spec.model)
    return run_ruler(model, tokenizer, spec, out, progress=progress)


def run_command(args: argparse.Namespace, config: Any) -> int:
    """Entry point of ``icecache eval ruler`` (see the module docstring), with the command line's
    `IceCacheConfig`."""
    from icecache.eval.ruler import TASKS
    from icecache.eval.ruler.runner import PredictionLog

    if getattr(args, "references", None) and not args.diagnose:
        raise ConfigError("--references supplies the reference rows of --diagnose; it does nothing without it")
    if args.diagnose:
        from icecache.eval.ruler.diagnosis_command import run_diagnose

        return run_diagnose(args)
    if not args.out:
        raise ConfigError("eval ruler needs --out DIR (predictions are appended there, and a re-run resumes)")
    spec = spec_from_args(args, config)
    out = Path(args.out)
    from icecache.runtime.models import resolve_model_source

    resolve_model_source(spec.model)  # an unknown or missing model is refused before run.json is written
    PredictionLog(out, spec.signature())  # refuses a directory that holds another run, before any model loads (writes nothing)
    t0 = time.perf_counter()
    use_ray = args.ray or bool(os.environ.get("RAY_ADDRESS"))
    interrupted = False
    try:
        if use_ray:
            from icecache.eval.ruler.distributed import run_on_ray

            records = run_on_ray(spec, out, progress=not args.json, workers=args.workers)
        elif args.workers is not None and args.workers > 1:
            from icecache.eval.ruler.distributed import run_on_processes

            records = run_on_processes(spec, out, args.workers, progress=not args.json)
        else:
            records = _run_local(spec, out, progress=not args.json)
    except KeyboardInterrupt:
        interrupted = True
        records = PredictionLog(out, spec.signature()).records
    wall = time.perf_counter() - t0
    header = (f"Command: `icecache {' '.join(shlex.quote(a) for a in sys.argv[1:])}`\n\n"
              f"Predictions: {len(records)} units in `predictions.jsonl`; this invocation {wall:.0f} s"
              f"{' (interrupted)' if interrupted else ''}.\n")
    if records:
        print(write_outputs(records, out, TASKS, header))
    if interrupted:
        kept = f"{len(records)} finished units kept in {out / 'predictions.jsonl'}" if records else "no unit had finished"
        print(f"interrupted: {kept}; run the same command again to resume", file=sys.stderr)
        return 130
    print(f"wall time {wall:.0f} s", file=sys.stderr)
    return 0
