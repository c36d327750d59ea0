"""Probe of the hnsw pager's RSS growth in the tiny-model soak (issue 8; results in ../reliability.md).

Runs `icecache.eval.soak.soak` on the tiny random Llama with one pager, as experiments/soak.py does, and
prints the RSS slope and how many hnswlib graphs were built (a build, or a rebuild after norm drift).

    python experiments/reliability/hnsw_rss_probe.py --pager hnsw --tokens 5000 [--no-verify-host] [--tracemalloc] [--sync-inserts]

``--tracemalloc`` also reports the Python-visible heap (numpy arrays included; torch tensors and hnswlib's
C++ allocations are not traced) at each checkpoint, to tell a Python-level leak from native heap growth.
Environment knobs of glibc (``MALLOC_ARENA_MAX``, ``MALLOC_TRIM_THRESHOLD_``) apply as usual.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tracemalloc
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import icecache.eval.soak as soak_mod
from icecache import IceCacheConfig
from icecache.indexes.hnsw import HNSWPager


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pager", default="hnsw")
    ap.add_argument("--tokens", type=int, default=5000)
    ap.add_argument("--no-verify-host", action="store_true")
    ap.add_argument("--tracemalloc", action="store_true")
    ap.add_argument("--sync-inserts", action="store_true",
                    help="insert leaving tokens on the calling thread (no prefetch on the worker pool)")
    args = ap.parse_args()
    from conftest import make_tiny_llama

    graphs: list[int] = []
    new_graph = HNSWPager._new_graph

    def counted(self: HNSWPager, tx) -> None:
        graphs.append(int(tx.shape[0]))
        new_graph(self, tx)

    HNSWPager._new_graph = counted  # type: ignore[method-assign]
    traced: list[tuple[float, float]] = []
    rss_bytes = soak_mod._rss_bytes

    def rss_hook() -> int:
        r = rss_bytes()
        if args.tracemalloc:
            traced.append((r / 2**20, tracemalloc.get_traced_memory()[0] / 2**20))
        return r

    soak_mod._rss_bytes = rss_hook
    if args.sync_inserts:
        class SyncIceCache(soak_mod.IceCache):  # type: ignore[name-defined]
            def __init__(self, *a, **kw) -> None:
                super().__init__(*a, **kw)
                self.prefetch_inserts = False

        soak_mod.IceCache = SyncIceCache
    if args.tracemalloc:
        tracemalloc.start()
    tiny = make_tiny_llama(seed=0, max_position_embeddings=1 << 16)
    cfg = IceCacheConfig(index=args.pager, budget=64, page_size=8, sink=4, window=32, dense_layers=(0,))
    r = soak_mod.soak(tiny, cfg, prompt_tokens=1024, new_tokens=args.tokens, checkpoint_every=1000,
                      verify_host=not args.no_verify_host, progress=False)
    out = {k: v for k, v in r.items() if k.startswith("rss")}
    out.update(malloc_env={k: v for k, v in os.environ.items() if k.startswith("MALLOC_")})
    out.update(pager=args.pager, tokens=args.tokens, sync_inserts=args.sync_inserts, graphs_built=len(graphs), graph_sizes=graphs[-6:],
               rss_and_python_heap_mib=[(round(a), round(b, 1)) for a, b in traced])
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
