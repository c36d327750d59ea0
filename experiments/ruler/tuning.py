"""Equal tuning of every method on a dev seed, then frozen settings for the held-out test seed (issue 58).

    python experiments/ruler/tuning.py commands    # the dev runs to start (resumable), one per cell
    python experiments/ruler/tuning.py report      # dev averages so far -> tuning/dev.md (printed)
    python experiments/ruler/tuning.py freeze      # once every dev run has finished: writes tuning.json
    python experiments/ruler/tuning.py --check     # exit 1 when tuning/dev.md or tuning.json differ from the runs

Protocol (the order is in git's history: this grid was committed before the first dev record, and
``tuning.json`` is committed before the first test-seed record):

* **Dev seed** `DEV_SEED` only; it was never used before (every earlier run used 42). The test seed
  (`TEST_SEED`) is used by no run until ``tuning.json`` exists.
* **The same budget of configurations for each method**: three settings each (`GRID`), listed with the
  published default first. IceCache: page size and M-DCI's query field of view; Quest: page size; PQCache:
  sub-spaces and bits; SnapKV: observation window (kvpress's ``window_size``).
* **Dev cells** (`DEV_CELLS`): SmolLM2 at 4k, Gemma-3-270M at 4k and 8k, every RULER task, `DEV_SAMPLES`
  samples per task, budgets 64 and 256, full attention and the exact oracle alongside, all rows from one
  prefill per sample.
* **Choice**: per model and method, the setting with the best dev average, where the dev average is the mean,
  over that model's dev cells and both budgets, of RULER's average (the mean over tasks of each task's mean
  score). Ties go to the earlier setting in the grid. One setting per model serves every length.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
DEV_DIR = HERE / "tuning"
FROZEN = HERE / "tuning.json"
REPORT = DEV_DIR / "dev.md"

DEV_SEED = 1001
TEST_SEED = 2027
DEV_SAMPLES = 2
BUDGETS = (64, 256)

#: method -> its settings, the published default first (variant names of `icecache eval ruler --methods`)
GRID: dict[str, tuple[str, ...]] = {
    "icecache": ("icecache[page_size=16;field_of_view=30]", "icecache[page_size=8;field_of_view=100]",
                 "icecache[page_size=4;field_of_view=200]"),
    "quest": ("quest[page_size=16]", "quest[page_size=8]", "quest[page_size=4]"),
    "pqcache": ("pqcache[num_subspaces=2;bits=6]", "pqcache[num_subspaces=4;bits=8]", "pqcache[num_subspaces=8;bits=8]"),
    "snapkv": ("snapkv[window_size=64]", "snapkv[window_size=32]", "snapkv[window_size=16]"),
}
#: rows run beside the grid for reference; not tuned
REFERENCE_METHODS = ("full", "exact")


@dataclass(frozen=True)
class DevCell:
    """One model at one length, tuned on the dev seed; ``folder`` under ``tuning/``."""

    model: str
    length: str
    folder: str


DEV_CELLS = (
    DevCell("smollm2-135m-instruct", "4k", "dev_smollm2_4k"),
    DevCell("gemma-3-270m", "4k", "dev_gemma_4k"),
    DevCell("gemma-3-270m", "8k", "dev_gemma_8k"),
)


def command(cell: DevCell) -> str:
    """The `icecache eval ruler` command of one dev cell (run from the repository root)."""
    methods = ",".join(REFERENCE_METHODS + tuple(v for settings in GRID.values() for v in settings))
    out = (DEV_DIR / cell.folder).relative_to(ROOT)
    return (f"icecache eval ruler --model {cell.model} --tasks all --lengths {cell.length} --samples {DEV_SAMPLES} "
            f"--data-seed {DEV_SEED} --methods {shlex.quote(methods)} --budgets {','.join(map(str, BUDGETS))} "
            f"--threads 1 --out {out}")


def load_records(cell: DevCell) -> list[dict]:
    path = DEV_DIR / cell.folder / "predictions.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def ruler_average(records: list[dict], method: str, budget: str, samples: set[tuple[str, int]]) -> float:
    """RULER's average x100 of one row over ``samples`` ((task, index) pairs): the mean over tasks of each
    task's mean score."""
    per_task: dict[str, list[float]] = {}
    for r in records:
        if r["method"] == method and str(r["budget"]) == budget and (r["task"], int(r["index"])) in samples:
            per_task.setdefault(r["task"], []).append(float(r["score"]))
    if not per_task:
        return float("nan")
    return 100 * sum(sum(v) / len(v) for v in per_task.values()) / len(per_task)


def finished_samples(records: list[dict]) -> set[tuple[str, int]]:
    """The (task, index) pairs every row of the cell has finished (full, exact and every grid setting at both
    budgets)."""
    rows = {("full", "-")} | {(m, str(b)) for m in ("exact", *(v for s in GRID.values() for v in s)) for b in BUDGETS}
    done: dict[tuple[str, int], set[tuple[str, str]]] = {}
    for r in records:
        done.setdefault((r["task"], int(r["index"])), set()).add((r["method"], str(r["budget"])))
    return {sample for sample, have in done.items() if rows <= have}


def dev_table() -> tuple[str, dict[str, dict[str, float]], bool]:
    """Markdown of the dev averages, ``{model: {setting: dev average}}`` and whether every cell has finished."""
    from icecache.eval.ruler import TASKS

    wanted = len(TASKS) * DEV_SAMPLES
    lines = [f"# Dev-seed tuning (seed {DEV_SEED}; generated by `python experiments/ruler/tuning.py report`)", "",
             "RULER average x100 on the samples every row of the cell has finished; the dev average is the mean of a "
             "model's cells at both budgets.", ""]
    averages: dict[str, dict[str, list[float]]] = {}
    complete = True
    for cell in DEV_CELLS:
        records = load_records(cell)
        samples = finished_samples(records)
        complete &= len(samples) >= wanted
        lines += [f"## {cell.model} at {cell.length} (`tuning/{cell.folder}/`: {len(samples)} of {wanted} samples)", "",
                  "| setting | @64 | @256 |", "|---|---|---|"]
        full = ruler_average(records, "full", "-", samples)
        lines.append(f"| full | {full:.1f} | {full:.1f} |")
        for setting in ("exact", *(v for s in GRID.values() for v in s)):
            cells = [ruler_average(records, setting, str(b), samples) for b in BUDGETS]
            lines.append(f"| {setting} | " + " | ".join(f"{c:.1f}" for c in cells) + " |")
            if setting != "exact" and samples:
                averages.setdefault(cell.model, {}).setdefault(setting, []).extend(cells)
        lines.append("")
    means = {model: {s: sum(v) / len(v) for s, v in settings.items()} for model, settings in averages.items()}
    lines += ["## Dev average and choice per model", "", "| model | method | setting | dev average | chosen |", "|---|---|---|---|---|"]
    for model, settings in means.items():
        chosen = choose(settings)
        for method, options in GRID.items():
            for setting in options:
                mark = "yes" if chosen.get(method) == setting else ""
                lines.append(f"| {model} | {method} | `{setting}` | {settings.get(setting, float('nan')):.2f} | {mark} |")
    status = "every dev cell has finished" if complete else "running: the choice is provisional until every dev cell finishes"
    lines += ["", f"Status: {status}.", ""]
    return "\n".join(lines), means, complete


def choose(settings: dict[str, float]) -> dict[str, str]:
    """Per method, the setting with the best dev average (ties: the earlier setting in `GRID`)."""
    out = {}
    for method, options in GRID.items():
        scored = [(settings[s], -i, s) for i, s in enumerate(options) if s in settings]
        if scored:
            out[method] = max(scored)[2]
    return out


def frozen_settings(means: dict[str, dict[str, float]]) -> dict:
    return {"dev_seed": DEV_SEED, "test_seed": TEST_SEED, "dev_samples_per_task": DEV_SAMPLES,
            "dev_cells": [f"{c.model}@{c.length}" for c in DEV_CELLS], "budgets": list(BUDGETS),
            "settings": {model: choose(settings) for model, settings in sorted(means.items())},
            "dev_average": {model: {s: round(v, 3) for s, v in settings.items()} for model, settings in sorted(means.items())}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", nargs="?", choices=("commands", "report", "freeze"), default="report")
    parser.add_argument("--check", action="store_true", help="exit 1 when dev.md or tuning.json differ from the runs")
    args = parser.parse_args()
    if args.action == "commands":
        for cell in DEV_CELLS:
            print(command(cell))
        return 0
    text, means, complete = dev_table()
    if args.check:
        stale = REPORT.exists() and REPORT.read_text() != text
        if FROZEN.exists() and json.loads(FROZEN.read_text()) != frozen_settings(means):
            stale = True
        if stale:
            print("tuning: dev.md or tuning.json differ from the dev runs; run `python experiments/ruler/tuning.py report`",
                  file=sys.stderr)
        return 1 if stale else 0
    DEV_DIR.mkdir(exist_ok=True)
    REPORT.write_text(text)
    print(text)
    if args.action == "freeze":
        if not complete:
            print("tuning: not every dev cell has finished; nothing frozen", file=sys.stderr)
            return 2
        if FROZEN.exists():
            print(f"tuning: {FROZEN.name} exists already (frozen settings are not re-chosen)", file=sys.stderr)
            return 2
        FROZEN.write_text(json.dumps(frozen_settings(means), indent=1) + "\n")
        print(f"froze {FROZEN.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
