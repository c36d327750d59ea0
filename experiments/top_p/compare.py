"""Compare a top-p RULER run with the fixed-budget rows of the main run on the same samples.

    python experiments/top_p/compare.py RUN_DIR [RUN_DIR ...] [--base experiments/ruler/smollm2_4k] [--row icecache@256]

Each RUN_DIR is an `icecache eval ruler ... --top-p P --out RUN_DIR` run. Prints one markdown table: per task,
the base run's score of the row (fixed budget) and full attention on the samples the top-p run has, each top-p
run's score, mean middle tokens attended per (layer, KV head) selection, and samples whose score differs.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from icecache.eval.ruler.runner import read_jsonl


def _records(path: Path) -> list[dict]:
    return read_jsonl(path / "predictions.jsonl")  # skips a line cut by a crash, as the run does


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--base", type=Path, default=Path("experiments/ruler/smollm2_4k"))
    ap.add_argument("--row", default="icecache@256")
    ap.add_argument("--json", type=Path, help="also write the totals here (experiments/results.py reads them)")
    args = ap.parse_args()
    method, budget = args.row.split("@")
    base = {(r["task"], r["index"], r["method"], str(r["budget"])): r for r in _records(args.base)}
    runs = []
    for run in args.runs:
        p = json.loads((run / "run.json").read_text())["config"].get("top_p")
        runs.append((p, {(r["task"], r["index"]): r for r in _records(run) if r["method"] == method}))
    tasks = sorted({t for _, recs in runs for t, _ in recs})
    head = ["task", "n", "full", f"{args.row}"] + [f"top-p {p}: score, tokens, differ" for p, _ in runs]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    totals: dict[str, list[float]] = {}
    for task in tasks:
        keys = sorted(set.intersection(*({i for t, i in recs if t == task} for _, recs in runs)))
        keys = [i for i in keys if (task, i, method, budget) in base and (task, i, "full", "-") in base]
        if not keys:
            continue
        full = sum(base[(task, i, "full", "-")]["score"] for i in keys) / len(keys)
        fixed = [base[(task, i, method, budget)]["score"] for i in keys]
        cells = [task, str(len(keys)), f"{full:.2f}", f"{sum(fixed) / len(keys):.2f}"]
        totals.setdefault("n", []).append(len(keys))
        totals.setdefault("full", []).append(full * len(keys))
        totals.setdefault("fixed", []).append(sum(fixed))
        for p, recs in runs:
            scores = [recs[(task, i)]["score"] for i in keys]
            tokens = [recs[(task, i)]["tokens_per_selection"] for i in keys]
            differ = sum(a != b for a, b in zip(scores, fixed))
            cells.append(f"{sum(scores) / len(keys):.2f}, {sum(tokens) / len(keys):.0f}, {differ}")
            totals.setdefault(f"s{p}", []).append(sum(scores))
            totals.setdefault(f"t{p}", []).append(sum(tokens))
            totals.setdefault(f"d{p}", []).append(differ)
        print("| " + " | ".join(cells) + " |")
    n = sum(totals.get("n", [0]))
    if n:
        cells = ["**all**", str(n), f"{sum(totals['full']) / n:.3f}", f"{sum(totals['fixed']) / n:.3f}"]
        for p, _ in runs:
            cells.append(f"{sum(totals[f's{p}']) / n:.3f}, {sum(totals[f't{p}']) / n:.0f}, {sum(totals[f'd{p}'])}")
        print("| " + " | ".join(cells) + " |")
        if args.json:
            args.json.write_text(json.dumps({
                "row": args.row, "samples": n, "full": sum(totals["full"]) / n, "fixed": sum(totals["fixed"]) / n,
                "top_p": [{"p": p, "score": sum(totals[f"s{p}"]) / n, "tokens_per_selection": sum(totals[f"t{p}"]) / n,
                           "differ": sum(totals[f"d{p}"])} for p, _ in runs],
            }, indent=1) + "\n")


if __name__ == "__main__":
    main()
