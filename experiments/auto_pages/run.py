"""Does ranking M-DCI's own pages exhaustively keep M-DCI's accuracy where the exact top-B oracle loses it?

Prototype pager `mdci_pages_exact` (experiment only, registered by this script): M-DCI's pages, each scored by
its best q.k over the GQA group, computed for every key (no search). Re-answers the SmolLM2 4k RULER NIAH samples
where exact and M-DCI disagree at one budget (from `../ruler/smollm2_4k/predictions.jsonl`), resumably:

    OMP_NUM_THREADS=1 NUMBA_NUM_THREADS=1 python experiments/auto_pages/run.py 256
    OMP_NUM_THREADS=1 NUMBA_NUM_THREADS=1 python experiments/auto_pages/run.py 256 mdci_pages_bound   # b256_bound.jsonl

Second prototype, `mdci_pages_bound`: the same pages ranked by Quest's bound (each page's channel-wise key minimum
and maximum, `sum_c max(q_c lo_c, q_c hi_c)`, max over the group), i.e. what a Quest-cost select over M-DCI's
semantic pages would rank. Bounds are recomputed from the keys at every select here (accuracy only, not speed).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from icecache.indexes.mdci import MDCIPager
from icecache.indexes.registry import register_pager


@register_pager("mdci_pages_exact")
class MDCIPagesExact(MDCIPager):
    """M-DCI's pages ranked by exhaustive scoring (one pager at a time: the layer-wide search path is off)."""

    def __init__(self, *args, **kw) -> None:
        kw["layer_select"] = False
        super().__init__(*args, **kw)

    def _rank_pages(self, queries: torch.Tensor, budget: int) -> tuple[np.ndarray, np.ndarray]:
        tree = self.index.tree
        n = tree.num_points
        keys = tree.vectors[:n]
        best = (queries.numpy().astype(np.float32) @ keys.T).max(0)  # [n]
        page_of = np.asarray(self.table.page_of(np.arange(n)), dtype=np.int64)
        scores = np.full(int(page_of.max()) + 1, -np.inf)
        np.maximum.at(scores, page_of, best.astype(np.float64))
        order = np.argsort(-scores, kind="stable")
        order = order[np.isfinite(scores[order])]
        return order, scores[order]


@register_pager("mdci_pages_bound")
class MDCIPagesBound(MDCIPagesExact):
    """M-DCI's pages ranked by Quest's min/max upper bound of q.k (recomputed per select: accuracy only)."""

    def _rank_pages(self, queries: torch.Tensor, budget: int) -> tuple[np.ndarray, np.ndarray]:
        from icecache.indexes.sequential import _page_bounds_score

        tree = self.index.tree
        n = tree.num_points
        keys = np.ascontiguousarray(tree.vectors[:n], dtype=np.float32)
        page_of = np.asarray(self.table.page_of(np.arange(n)), dtype=np.int64)
        pages = int(page_of.max()) + 1
        lo = np.full((pages, keys.shape[1]), np.inf, np.float32)
        hi = np.full((pages, keys.shape[1]), -np.inf, np.float32)
        np.minimum.at(lo, page_of, keys)
        np.maximum.at(hi, page_of, keys)
        live = np.isfinite(lo[:, 0])
        lo[~live], hi[~live] = 0.0, 0.0
        bound = np.empty(pages, np.float32)
        _page_bounds_score(np.ascontiguousarray(queries.numpy(), dtype=np.float32), lo, hi, bound)
        bound[~live] = -np.inf
        order = np.argsort(-bound, kind="stable")
        order = order[np.isfinite(bound[order])]
        return order, bound[order].astype(np.float64)


def main() -> None:
    from icecache.core.config import IceCacheConfig
    from icecache.eval.ruler.runner import RulerSpec, read_jsonl, run_sample
    from icecache.runtime.models import load_model

    budget = sys.argv[1]
    pager = sys.argv[2] if len(sys.argv) > 2 else "mdci_pages_exact"
    suffix = {"mdci_pages_exact": "", "mdci_pages_bound": "_bound"}[pager]
    out = Path(__file__).parent / f"b{budget}{suffix}.jsonl"
    done = {(r["task"], r["index"]) for r in read_jsonl(out)}
    recs = read_jsonl(Path(__file__).parent.parent / "ruler" / "smollm2_4k" / "predictions.jsonl")
    sc = {}
    for r in recs:
        if r["task"].startswith("niah") and r["method"] in ("exact", "icecache") and r["budget"] == budget:
            sc.setdefault((r["task"], r["index"]), {})[r["method"]] = r["score"]
    todo = sorted(k for k, v in sc.items() if v.get("exact") != v.get("icecache") and k not in done)
    print(len(todo), "samples", flush=True)
    model, tok = load_model("smollm2-135m-instruct")
    spec = RulerSpec(model="smollm2-135m-instruct", tasks=[], lengths=[4096], samples=25, methods=[], budgets=[int(budget)],
                     config=IceCacheConfig())
    for task, index in todo:
        t = time.time()
        [r] = run_sample(model, tok, spec, index, 4096, task, [(f"icecache:{pager}", int(budget))])
        r.update(exact=sc[(task, index)]["exact"], mdci=sc[(task, index)]["icecache"])
        with open(out, "a") as f:
            f.write(json.dumps(r) + "\n")
        print(task, index, "exact", r["exact"], "mdci", r["mdci"], pager, r["score"], f"{time.time()-t:.0f}s", flush=True)


if __name__ == "__main__":
    main()
