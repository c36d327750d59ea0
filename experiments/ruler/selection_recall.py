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

METHODS = ("exact", "quest", "icecache")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--run", type=Path, required=True, help="a RULER run's directory (its run.json)")
    parser.add_argument("--length", type=int, required=True)
    parser.add_argument("--budget", type=int, required=True)
    parser.add_argument("samples", nargs="+", help="TASK#INDEX")
    args = parser.parse_args()

    from icecache.core.config import IceCacheConfig
    from icecache.eval.harness import clone_kv, decode_greedy, run_prefill
    from icecache.eval.methods import get_method
    from icecache.eval.ruler import make_sample, score_sample
    from icecache.eval.ruler.diagnose import answer_positions, replay
    from icecache.runtime.models import load_model

    run = json.loads((args.run / "run.json").read_text())
    config = IceCacheConfig(**run["config"]).replace(budget=args.budget)
    model, tok = load_model(run["model"])
    chat = run["chat_template"] if run["chat_template"] is not None else bool(getattr(tok, "chat_template", None))
    for item in args.samples:
        task, _, index = item.partition("#")
        start = time.time()
        sample = make_sample(task, tok, args.length, seed=run["seed"], index=int(index), chat_template=chat)
        prefill = run_prefill(model, tok(sample.prompt, return_tensors="pt")["input_ids"], obs_window=config.window)
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
