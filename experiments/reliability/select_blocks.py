"""Per-block select and step times of one long tiny-model generation (issue 8: is a select late in a long run
slower than in a fresh run over as many keys?).

Prefills ``prompt`` random tokens into `IceCache` (every layer sparse, inserts on the decode thread, the
soak's budget 64 / page 8 / sink 4 / window 32), decodes ``steps`` tokens and prints the median select-stage
and step time (ms) of each block of 250 steps. No invariant checks (see `experiments/soak.py` for those).

    python experiments/reliability/select_blocks.py exact 1024 20000    # a long run: n grows 1k -> 21k
    python experiments/reliability/select_blocks.py exact 20000 2500    # a fresh run at ~20k
"""

from __future__ import annotations

import argparse
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

BLOCK = 250


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("pager")
    ap.add_argument("prompt", type=int)
    ap.add_argument("steps", type=int)
    args = ap.parse_args()
    from conftest import make_tiny_llama

    model = make_tiny_llama(seed=0, max_position_embeddings=1 << 16)
    cfg = IceCacheConfig(index=args.pager, budget=64, page_size=8, sink=4, window=32, dense_layers=())
    ids = torch.randint(3, 128, (1, args.prompt), generator=torch.Generator().manual_seed(0))
    sel, step = [], []
    with torch.inference_mode(), use_attention(model), IceCache(model.config, cfg) as cache:
        cache.prefetch_inserts = False
        tok = model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[0, -1].argmax().view(1, 1)
        for _ in range(args.steps):
            s0, t0 = cache.timer.seconds.get("select", 0.0), time.perf_counter()
            tok = model(tok, past_key_values=cache, use_cache=True).logits[0, -1].argmax().view(1, 1)
            step.append(time.perf_counter() - t0)
            sel.append(cache.timer.seconds["select"] - s0)
    for name, xs in (("select", np.array(sel) * 1e3), ("step", np.array(step) * 1e3)):
        blocks = " ".join(f"{np.median(xs[i : i + BLOCK]):.2f}" for i in range(0, len(xs), BLOCK))
        print(f"{args.pager} prompt {args.prompt}: {name} ms per block of {BLOCK} steps: {blocks}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
