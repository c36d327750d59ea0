"""Average RULER score (x100) of rows from several run folders, on the samples every one of those rows finished.

    python experiments/ruler/compare_rows.py experiments/ruler/gemma_8k experiments/ruler/gemma_8k_variants \\
        experiments/ruler/gemma_8k_page4=page4: --rows 'full@-,exact@256,icecache@256,quest@256,page4:icecache@256,...'

A folder written ``DIR=PREFIX`` gives its rows that prefix (two runs of the same method with different settings,
e.g. the pages-of-4 run's ``icecache``). A row is ``METHOD@BUDGET`` (``full@-``). Prints one line per row.
``--paired A,B`` (repeatable; both rows among ``--rows``) adds a paired bootstrap of A minus B on the same samples,
resampled within each task (``--draws``, seed 0; ``targets.paired_statistic``, the one `targets.md` reads): the
difference of RULER's averages (the mean over tasks of each task's mean) x100, its 95% interval and how many
samples each row wins.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from targets import DRAWS, paired_statistic  # this folder is on the path when the script runs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dirs", nargs="+")
    ap.add_argument("--rows", required=True)
    ap.add_argument("--paired", action="append", default=[], metavar="A,B")
    ap.add_argument("--draws", type=int, default=DRAWS)
    args = ap.parse_args()
    scores: dict[tuple[str, str], dict[tuple[str, int], float]] = {}
    for spec in args.dirs:
        path, _, prefix = spec.partition("=")
        for line in (Path(path) / "predictions.jsonl").read_text().splitlines():
            r = json.loads(line)
            row = (prefix + r["method"], str(r["budget"]))
            scores.setdefault(row, {})[(r["task"], int(r["index"]))] = float(r["score"])
    rows = [tuple(x.rsplit("@", 1)) for x in args.rows.split(",") if x]
    missing = [f"{m}@{b}" for m, b in rows if (m, b) not in scores]
    if missing:
        raise SystemExit(f"no records for {', '.join(missing)}")
    common = set.intersection(*(set(scores[row]) for row in rows))
    print(f"{len(common)} samples finished by all {len(rows)} rows")
    for m, b in rows:
        vals = [scores[(m, b)][s] for s in common]
        print(f"{m}@{b}: {100 * sum(vals) / max(len(vals), 1):.1f}")
    for pair in args.paired:
        a, b = (tuple(x.rsplit("@", 1)) for x in pair.split(","))
        if a not in rows or b not in rows:
            raise SystemExit(f"--paired {pair}: both rows must be among --rows")
        if not common:
            raise SystemExit("no sample finished by every row")
        mean, low, high = paired_statistic(scores[a], scores[b], common, ratio=False, draws=args.draws)
        wins = sum(scores[a][s] > scores[b][s] for s in common)
        losses = sum(scores[a][s] < scores[b][s] for s in common)
        print(f"{pair.replace(',', ' - ')}: {100 * mean:+.1f} [{100 * low:+.1f}, {100 * high:+.1f}] "
              f"({wins} samples higher, {losses} lower)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
