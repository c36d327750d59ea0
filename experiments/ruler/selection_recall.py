"""How much of a sample's answer each selection holds: exact@B, quest@B and icecache@B on RULER samples of a run.

For each sample: prefill, decode full attention's answer (greedy, stopping once it scores 1), then teacher-force
that answer through each method's cache and record, at every step, sparse layer and KV head, the share of the
answer's prompt tokens (`answer_positions`) held by (a) the method's own selection, (b) the method's own pages
ranked by their best exact q.k, whole pages within the budget, (c) the exact top-B tokens: the recalls of
`icecache.eval.ruler.diagnose.replay`, averaged, and per layer. For Quest, (b) is an exact ranking of
token-order pages of ``page_size`` consecutive tokens.

    python experiments/ruler/selection_recall.py --run experiments/ruler/gemma_16k --length 16384 --budget 256 \
        niah_multikey_1#6 niah_multikey_1#9 > OUT.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

METHODS = ("exact", "quest", "icecache")


def parse_args(doc: str) -> argparse.Namespace:
    """``--run DIR --length N --budget B TASK#INDEX...``, the arguments of the scripts that re-answer a run's samples."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--run", type=Path, required=True, help="a RULER run's directory (its run.json)")
    parser.add_argument("--length", type=int, required=True)
    parser.add_argument("--budget", type=int, required=True)
    parser.add_argument("samples", nargs="+", help="TASK#INDEX")
    return parser.parse_args()


def load_run(run_dir: Path, budget: int) -> tuple[Any, Any, dict, Any]:
    """The model and tokenizer of a RULER run's ``run.json``, the run itself, and its `IceCacheConfig` at ``budget``."""
    from icecache.core.config import IceCacheConfig
    from icecache.runtime.models import load_model

    run = json.loads((run_dir / "run.json").read_text())
    model, tok = load_model(run["model"])
    if run["chat_template"] is None:
        run = {**run, "chat_template": bool(getattr(tok, "chat_template", None))}
    return model, tok, run, IceCacheConfig(**run["config"]).replace(budget=budget)


def prefill_sample(model: Any, tok: Any, run: dict, config: Any, item: str, length: int) -> tuple[Any, Any]:
    """``TASK#INDEX`` of the run at ``length`` tokens: the sample and its dense prefill."""
    from icecache.eval.harness import run_prefill
    from icecache.eval.ruler import make_sample

    task, _, index = item.partition("#")
    sample = make_sample(task, tok, length, seed=run["seed"], index=int(index), chat_template=run["chat_template"])
    return sample, run_prefill(model, tok(sample.prompt, return_tensors="pt")["input_ids"], obs_window=config.window)


def main() -> int:
    args = parse_args(__doc__)

    from icecache.eval.harness import clone_kv, decode_greedy
    from icecache.eval.methods import get_method
    from icecache.eval.ruler import score_sample
    from icecache.eval.ruler.diagnose import answer_positions, replay

    model, tok, run, config = load_run(args.run, args.budget)
    for item in args.samples:
        start = time.time()
        sample, prefill = prefill_sample(model, tok, run, config, item, args.length)
        answer = decode_greedy(model, clone_kv(prefill.kv), prefill.last_logits, sample.tokens_to_generate,
                               {tok.eos_token_id},
                               stop_when=lambda t, s=sample: score_sample(s, tok.decode(t, skip_special_tokens=True)) >= 1.0)
        positions = answer_positions(tok, sample)
        row = {"sample": item, "answer_tokens": len(positions), "full_answer": tok.decode(answer, skip_special_tokens=True)}
        for method in METHODS:
            cache = get_method(method).cache(model, prefill, config)
            try:
                cache.workers.wait_all()
                rec = replay(model, prefill, cache, answer, positions)
            finally:
                cache.close()
            row[method] = [round(x, 3) for x in (rec.search_recall, rec.pages_recall, rec.oracle_recall)]
            row[f"{method}_per_layer"] = {layer: [round(x, 3) for x in v] for layer, v in rec.per_layer.items()}
        row["seconds"] = round(time.time() - start, 1)
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
