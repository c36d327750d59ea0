"""Answer RULER samples of a run with M-DCI's query beam (field of view) at several widths, one prefill per sample.

A search miss (`icecache/eval/ruler/diagnose.py`) is a sample M-DCI's own pages answer when ranked
exhaustively and its tree search does not. This re-answers such samples with ``icecache[field_of_view=F]`` for
each ``F`` of ``--fovs`` and with ``icecache[search=exhaustive]`` (no search: the pages' perfect ranking), at
each budget of ``--budgets``, on the run's settings otherwise. One JSON line per sample: score, the answer's
start and the decode's seconds (a rough cost: it includes the model's own layers) per method@budget.

    python experiments/ruler/fov_sweep.py --run experiments/ruler/gemma_32k --length 32768 --budgets 64,256 \
        --fovs 200,400,800 niah_multikey_1#3 > OUT.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--run", type=Path, required=True, help="a RULER run's directory (its run.json)")
    parser.add_argument("--length", type=int, required=True)
    parser.add_argument("--budgets", default="64,256", help="comma-separated token budgets")
    parser.add_argument("--fovs", default="200,400,800", help="comma-separated fields of view")
    parser.add_argument("samples", nargs="+", help="TASK#INDEX")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    from selection_recall import load_run, prefill_sample

    from icecache.eval.harness import decode_greedy
    from icecache.eval.methods import get_method
    from icecache.eval.ruler import score_sample

    budgets = [int(b) for b in args.budgets.split(",")]
    fovs = [int(f) for f in args.fovs.split(",")]
    model, tok, run, config = load_run(args.run, budgets[0])
    params = dict(config.index_params)
    variants = {f"fov{fov}": {**params, "field_of_view": fov} for fov in fovs}
    variants["exhaustive"] = {**params, "search": "exhaustive"}
    for item in args.samples:
        start = time.time()
        sample, prefill = prefill_sample(model, tok, run, config, item, args.length)
        row: dict = {"sample": item, "prefill_s": round(time.time() - start, 1)}
        for budget in budgets:
            for name, index_params in variants.items():
                cfg = config.replace(budget=budget, index_params=index_params)
                began = time.time()
                cache = get_method("icecache").cache(model, prefill, cfg)
                try:
                    tokens = decode_greedy(model, cache, prefill.last_logits, sample.tokens_to_generate, {tok.eos_token_id})
                finally:
                    cache.close()
                text = tok.decode(tokens, skip_special_tokens=True)
                row[f"{name}@{budget}"] = {"score": score_sample(sample, text), "prediction": text[:40],
                                           "seconds": round(time.time() - began, 1)}
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
