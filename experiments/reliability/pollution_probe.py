"""Does streaming a large index through the CPU caches slow the *rest* of a decode step? (issue 8, TPOT drift)

A warm-size cache (tiny random Llama, every layer sparse, the soak's budget 64 / page 8 / sink 4 / window 32,
``--prompt`` tokens, re-prefilled every ``--steps`` steps so it never grows) decodes in three phases of
``--steps`` steps: alone; with ``--stream-mb`` MiB of memory read between its steps (what ``exact``'s select
scans per step at 20k keys: 4 layers x 3 KV heads x 20k x 64 x 4 B = 61 MiB); alone again. Printed per phase:
median step, index work (select + insert + waits) and the rest (ms). Nothing in the cache grows, so a slower
second phase is the streamed memory's doing, not a decay.

    python experiments/reliability/pollution_probe.py --pager exact --stream-mb 61
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

from icecache import IceCacheConfig
from icecache.runtime.attention import use_attention
from icecache.runtime.cache import IceCache


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pager", default="exact")
    ap.add_argument("--prompt", type=int, default=2000)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--stream-mb", type=float, default=61.0)
    ap.add_argument("--rounds", type=int, default=2, help="alone / streaming cycles (then alone once more)")
    ap.add_argument("--out", default=None, help="JSON file for the per-phase figures")
    args = ap.parse_args()
    from conftest import make_tiny_llama

    model = make_tiny_llama(seed=0, max_position_embeddings=1 << 16)
    cfg = IceCacheConfig(index=args.pager, budget=64, page_size=8, sink=4, window=32, dense_layers=())
    ids = torch.randint(3, 128, (1, args.prompt), generator=torch.Generator().manual_seed(0))
    blob = torch.ones(int(args.stream_mb * 2**20) // 4)  # float32
    phases = ["alone", "streaming"] * args.rounds + ["alone"]
    rows = []
    with torch.inference_mode(), use_attention(model):
        for phase in phases:
            with IceCache(model.config, cfg) as cache:
                tok = model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[0, -1].argmax().view(1, 1)
                cache.workers.wait_all()
                step, index = [], []
                for _ in range(args.steps):
                    if phase == "streaming":
                        blob.sum()  # reads every byte once, as a select over that many keys does
                    t = cache.timer.seconds
                    i0 = t.get("select", 0.0) + t.get("insert", 0.0) + cache.workers.wait_seconds
                    t0 = time.perf_counter()
                    tok = model(tok, past_key_values=cache, use_cache=True).logits[0, -1].argmax().view(1, 1)
                    step.append(time.perf_counter() - t0)
                    index.append(t.get("select", 0.0) + t.get("insert", 0.0) + cache.workers.wait_seconds - i0)
            s, ix = np.array(step[50:]) * 1e3, np.array(index[50:]) * 1e3
            row = {"phase": phase, "step_ms": float(np.median(s)), "index_ms": float(np.median(ix)), "rest_ms": float(np.median(s - ix))}
            rows.append(row)
            print(f"{phase:>9}: step {row['step_ms']:.2f} ms, index work {row['index_ms']:.2f} ms, rest {row['rest_ms']:.2f} ms", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"command": "python experiments/reliability/pollution_probe.py " + " ".join(sys.argv[1:]),
                                              "phases": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
