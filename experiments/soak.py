"""Soak runs for experiments/reliability.md: long generations with invariant checks (see icecache.eval.soak).

    python experiments/soak.py --tiny-pagers all --tiny-tokens 20000 \
        --model-pagers mdci,sequential --model-tokens 20000 --out experiments/reliability

The tiny random Llama (4 layers) runs with every registered pager; the embedded SmolLM2 with the pagers
given (about 80 ms per token on our 2 cores, so 20k tokens take ~30 minutes per pager). Positions go past
SmolLM2's 8k training context: the text degrades, the invariants must not. For TPOT drift on a machine whose
speed drifts, add ``--reference-every 2000``: a warm-size reference cache decodes in lockstep (tiny runs), scored
by ``experiments/reliability/drift_vs_sim.py``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import icecache
from icecache import IceCacheConfig
from icecache.eval.soak import soak
from icecache.eval.tasks import text_window


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny-pagers", default="all")
    ap.add_argument("--tiny-tokens", type=int, default=20000)
    ap.add_argument("--model-pagers", default="mdci,sequential")
    ap.add_argument("--model-tokens", type=int, default=20000)
    ap.add_argument("--model-prompt", type=int, default=4000)
    ap.add_argument("--checkpoint-every", type=int, default=2000)
    ap.add_argument("--tiny-dense-layers", default="0",
                    help="comma list of the tiny model's layers that keep full KV ('' for none: every layer sparse)")
    ap.add_argument("--sync-inserts", action="store_true",
                    help="insert tokens leaving the window on the decode thread (no background worker during the step)")
    ap.add_argument("--reference-every", type=int, default=0,
                    help="tiny runs: decode a reference cache in lockstep, re-prefilled every this many steps (the warm-up "
                         "window: new tokens / 10), to compare the end-of-run TPOT with a warm one measured at the same moments")
    ap.add_argument("--out", default="experiments/reliability")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    t0 = time.perf_counter()
    from conftest import make_tiny_llama

    tiny = make_tiny_llama(seed=0, max_position_embeddings=1 << 16)
    pagers = icecache.available_pagers() if args.tiny_pagers == "all" else args.tiny_pagers.split(",")
    for name in pagers if args.tiny_tokens else []:
        dense = tuple(int(x) for x in args.tiny_dense_layers.split(",") if x.strip())
        cfg = IceCacheConfig(index=name, budget=64, page_size=8, sink=4, window=32, dense_layers=dense)
        r = soak(tiny, cfg, prompt_tokens=1024, new_tokens=args.tiny_tokens, checkpoint_every=args.checkpoint_every,
                 verify_host=True, progress=True, background_inserts=not args.sync_inserts,
                 reference_every=args.reference_every)
        r["model"] = "tiny-random-llama"
        results.append(r)
        print(json.dumps(r), flush=True)
        (out / "soak.json").write_text(json.dumps(results, indent=1))
    if args.model_tokens:
        model, tok = icecache.load_model()
        ids = torch.tensor([text_window(tok, args.model_prompt, seed=7)])
        for name in filter(None, args.model_pagers.split(",")):
            cfg = IceCacheConfig(index=name, budget=256)
            r = soak(model, cfg, prompt_tokens=args.model_prompt, new_tokens=args.model_tokens, input_ids=ids,
                     checkpoint_every=args.checkpoint_every, verify_host=False, progress=True,
                     background_inserts=not args.sync_inserts)
            r["model"] = "smollm2-135m-instruct"
            results.append(r)
            print(json.dumps(r), flush=True)
            (out / "soak.json").write_text(json.dumps(results, indent=1))
    (out / "soak.json").write_text(json.dumps({"command": "python experiments/soak.py " + " ".join(sys.argv[1:]),
                                               "wall_seconds": time.perf_counter() - t0, "runs": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
