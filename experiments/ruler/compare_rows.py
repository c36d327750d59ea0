"""Average RULER score (x100) of rows from several run folders, on the samples every one of those rows finished.

    python experiments/ruler/compare_rows.py experiments/ruler/gemma_8k experiments/ruler/gemma_8k_variants \\
        experiments/ruler/gemma_8k_page4=page4: --rows 'full@-,exact@256,icecache@256,quest@256,page4:icecache@256,...'

A folder written ``DIR=PREFIX`` gives its rows that prefix (two runs of the same method with different settings,
e.g. the pages-of-4 run's ``icecache``). A row is ``METHOD@BUDGET`` (``full@-``). Prints one line per row.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dirs", nargs="+")
    ap.add_argument("--rows", required=True)
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
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
