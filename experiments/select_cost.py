"""Why page selection dominates IceCache's decode step on our CPUs (issue 4): one run, three measurements.

1. Decode modes on the embedded model at ``--context`` tokens (one prefill per cache): full attention vs
   IceCache (``--index``, budget 256) with host inserts prefetched on a worker (the default) or done
   synchronously; ``--reps`` alternating blocks of ``--steps`` decode steps, median step time per block.
2. Select time of the same IceCache's own pagers (every sparse layer x KV head, 84 on SmolLM2) outside the
   model: the same pager queried 84 times (its index hot in the CPU caches) vs each pager once, round robin
   (the decode step's pattern: 84 indexes, ~2-3 MB each, do not fit the last-level cache).
3. Synthetic: 84 M-DCI pagers of 8k clustered keys at head widths 16/64/256 (and of 500 keys at 64), round
   robin vs two alternating vs hot: how the cold cost grows with the bytes each scored token brings in, and
   whether it is the last-level cache (round robin only) or already the L2 (two alternating too).

    python experiments/select_cost.py --out experiments/bench_runtime/select_cost
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tpot_interleaved import decode_block

from icecache import IceCache, IceCacheConfig
from icecache.eval.tasks import text_window
from icecache.indexes import make_pager
from icecache.runtime.attention import use_attention
from icecache.runtime.models import load_model


def decode(model, cache, tok: torch.Tensor, steps: int) -> tuple[torch.Tensor, float]:
    """``steps`` greedy decode steps; returns the last token and the median step time (ms)."""
    tok, ts = decode_block(model, cache, tok, steps)
    return tok, 1e3 * statistics.median(ts)


def hot_vs_round_robin(pagers: list, queries: list[torch.Tensor], budget: int, reps: int = 5) -> dict[str, float]:
    """ms for len(pagers) selects (best of ``reps``): each pager once (round robin), the first two in turn, and
    the first one only (hot in the CPU caches)."""
    for p, q in zip(pagers, queries):
        p.select(q, budget, check=False)
    rr = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for p, q in zip(pagers, queries):
            p.select(q, budget, check=False)
        rr.append(time.perf_counter() - t0)
    alt = []  # two indexes in turn: their data fits the L3 cache, not the L2
    for _ in range(reps):
        t0 = time.perf_counter()
        for i in range(len(pagers)):
            pagers[i % 2].select(queries[i % 2], budget, check=False)
        alt.append(time.perf_counter() - t0)
    hot = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in pagers:
            pagers[0].select(queries[0], budget, check=False)
        hot.append(time.perf_counter() - t0)
    return {"round_robin_ms": 1e3 * min(rr), "two_alternating_ms": 1e3 * min(alt), "hot_ms": 1e3 * min(hot),
            "selects": len(pagers)}


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=8000)
    ap.add_argument("--index", default="mdci", help="pager spec, e.g. mdci or 'mdci[preset=icecache]'")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from transformers import DynamicCache

    from icecache.core.spec import parse_spec

    t_start = time.perf_counter()
    model, tok = load_model(None)
    ids = torch.tensor([text_window(tok, args.context, seed=0)])
    res: dict = {"context": args.context, "index": args.index, "torch_threads": torch.get_num_threads()}

    dc = DynamicCache()
    out = model(ids, past_key_values=dc, use_cache=True, logits_to_keep=1)
    _, full_ms = decode(model, dc, out.logits[0, -1].argmax().view(1, 1), args.steps)
    del dc, out
    res["full_ms"] = full_ms
    print(f"full attention: {full_ms:.1f} ms per step", flush=True)

    name, params = parse_spec(args.index)
    cache = IceCache(model.config, IceCacheConfig(index=name, index_params=params, budget=256))
    try:
        with use_attention(model):
            out = model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
            t, _ = decode(model, cache, out.logits[0, -1].argmax().view(1, 1), 4)
            modes = {"prefetch": True, "sync": False}
            blocks: dict[str, list[float]] = {m: [] for m in modes}
            for _ in range(args.reps):
                for m, pre in modes.items():
                    cache.prefetch_inserts = pre
                    t, ms = decode(model, cache, t, args.steps)
                    blocks[m].append(ms)
            for m, v in blocks.items():
                res[f"icecache_{m}_ms"] = v
                print(f"IceCache ({m} inserts): {' '.join(f'{x:.1f}' for x in v)} ms; median "
                      f"{statistics.median(v):.1f} = {statistics.median(v) / full_ms:.2f}x full", flush=True)
        cache.check_conservation()  # also waits for the last background inserts
        sparse = [layer for layer, kind in zip(cache.layers, cache.kind) if kind == "sparse"]
        pagers = [p for layer in sparse for p in layer.pagers[0]]
        g = torch.Generator().manual_seed(0)
        n_rep = model.config.num_attention_heads // model.config.num_key_value_heads
        qs = []
        for p in pagers:  # a query group aimed at random middle keys of the pager's own head
            k = p.index.data()
            pick = torch.randint(0, len(p), (n_rep,), generator=g)
            qs.append(torch.from_numpy(k[pick.numpy()]).float() * 2.0)
        res["model_pagers"] = hot_vs_round_robin(pagers, qs, 256)
        r = res["model_pagers"]
        print(f"{len(pagers)} selects on the model's pagers: round robin {r['round_robin_ms']:.1f} ms, two alternating "
              f"{r['two_alternating_ms']:.1f} ms, hot {r['hot_ms']:.1f} ms", flush=True)
    finally:
        cache.close()

    res["synthetic"] = []
    for d, n in ((16, 8000), (64, 500), (64, 8000), (256, 8000)):
        g = torch.Generator().manual_seed(1)
        ps, qs = [], []
        for _ in range(84):
            c = torch.randn(64, d, generator=g)
            k = c[torch.randint(0, 64, (n,), generator=g)] + 0.5 * torch.randn(n, d, generator=g)
            p = make_pager(name, d, 16, 0, **params)
            p.build(k)
            ps.append(p)
            qs.append(k[torch.randint(0, n, (3,), generator=g)] + 0.1 * torch.randn(3, d, generator=g))
        r = {"head_dim": d, "keys": n, **hot_vs_round_robin(ps, qs, 256)}
        res["synthetic"].append(r)
        print(f"synthetic d={d}, n={n}: round robin {r['round_robin_ms']:.1f} ms, two alternating "
              f"{r['two_alternating_ms']:.1f} ms, hot {r['hot_ms']:.1f} ms", flush=True)
        del ps
    res["wall_s"] = time.perf_counter() - t_start
    if args.out:
        out_dir = Path(args.out)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "select_cost.json").write_text(json.dumps(res, indent=1))
        print(f"wrote {out_dir / 'select_cost.json'}")


if __name__ == "__main__":
    main()
