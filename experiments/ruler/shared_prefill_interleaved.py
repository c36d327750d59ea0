"""Wall time per RULER sample: every method from one shared prefill vs one method alone, interleaved sample by
sample in one process (issue 23 target: <= 1.6x at 8k).

`shared_prefill.py` compares two runs made minutes apart, and this 2-core machine's speed drifts by +-10% over
minutes (two runs of the same method alone differed by 5-9% in median ratio). Here each sample is answered twice
in a row by the runner itself (`run_sample`: the sample's generation, one dense prefill, then each method's cache
build and decode): once by ``--one`` alone and once by every method of ``--methods``, in alternating order, so
both see the same machine state. Per sample: ratio = all methods' wall / one method's wall. Both answers'
records go to ``one.jsonl`` and ``all.jsonl`` (the predictions must agree with a plain run's), the walls to
``walls.jsonl`` and the table to ``shared_prefill.md``.

    python experiments/ruler/shared_prefill_interleaved.py --tasks niah_single_1,niah_multikey_2,vt,fwe --samples 2 \
        --out experiments/ruler/shared_prefill_8k_interleaved
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

METHODS = "full,exact,icecache,quest,pqcache,streaming,snapkv"


def main() -> int:
    from shared_prefill import write_summary  # this script's folder
    from tqdm.auto import tqdm

    from icecache.core.config import IceCacheConfig
    from icecache.eval.ruler.command import MODEL_ALIASES, parse_ruler_length
    from icecache.eval.ruler.runner import RulerSpec, method_budgets, run_sample
    from icecache.runtime.models import load_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--tasks", default="niah_single_1,niah_multikey_2,vt,fwe")
    ap.add_argument("--length", default="8k")
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--methods", default=METHODS)
    ap.add_argument("--one", default="icecache", help="the method answered alone")
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    out = Path(args.out)
    if (out / "walls.jsonl").exists():
        print(f"error: {out} holds a measurement already; use another --out", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    model_name = MODEL_ALIASES.get(args.model, args.model)
    length = parse_ruler_length(args.length)
    tasks = [t for t in args.tasks.split(",") if t]
    spec = RulerSpec(model=model_name, tasks=tasks, lengths=[length], samples=args.samples,
                     methods=[m for m in args.methods.split(",") if m], budgets=[args.budget], config=IceCacheConfig())
    one_spec = RulerSpec(**{**spec.__dict__, "methods": [args.one]})
    model, tokenizer = load_model(model_name)
    walls = []
    units = [(index, task) for index in range(args.samples) for task in tasks]
    for k, (index, task) in enumerate(tqdm(units, desc="shared prefill, interleaved", unit="sample")):
        order = ("one", "all") if k % 2 == 0 else ("all", "one")
        wall = {}
        for which in order:
            s = one_spec if which == "one" else spec
            t0 = time.perf_counter()
            records = run_sample(model, tokenizer, s, index, length, task, method_budgets(s))
            wall[which] = time.perf_counter() - t0
            with open(out / f"{which}.jsonl", "a") as f:
                f.writelines(json.dumps(r) + "\n" for r in records)
        row = {"task": task, "index": index, "first": order[0], "one_seconds": wall["one"], "all_seconds": wall["all"],
               "ratio": wall["all"] / wall["one"]}
        walls.append(row)
        with open(out / "walls.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
    ratios = [w["ratio"] for w in walls]
    lines = [f"Command: `python {' '.join(shlex.quote(a) for a in sys.argv)}`", "",
             f"Shared prefill, interleaved: {len(spec.methods)} methods ({', '.join(spec.methods)}) at budget "
             f"{args.budget} vs `{args.one}` alone, {model_name}, {length} tokens", "",
             "| task | sample | first | one method (s) | all methods (s) | ratio |", "|---|---|---|---|---|---|"]
    lines += [f"| {w['task']} | {w['index']} | {w['first']} | {w['one_seconds']:.1f} | {w['all_seconds']:.1f} | "
              f"{w['ratio']:.2f}x |" for w in walls]
    write_summary(out, lines, ratios, sum(w["all_seconds"] for w in walls) / sum(w["one_seconds"] for w in walls))
    return 0


if __name__ == "__main__":
    sys.exit(main())
