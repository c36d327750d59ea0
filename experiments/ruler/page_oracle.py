"""Answer RULER samples of a run with token-order pages ranked by their exact best score (a page oracle).

Quest ranks token-order pages of ``page_size`` tokens by a min/max bound; the exact oracle ranks single tokens by
q.k. ``token_pages_exact`` (registered here, for this experiment only) keeps Quest's pages and ranks each by the best
``max_g q.k`` of its keys, whole pages within the budget. Each sample is prefilled once and answered by
``quest`` and ``icecache:token_pages_exact`` at the run's settings; the scores print as JSON lines.

    python experiments/ruler/page_oracle.py --run experiments/ruler/gemma_16k --length 16384 --budget 256 \
        niah_multikey_1#6 > OUT.jsonl
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np
import torch


def register() -> None:
    """Register ``token_pages_exact``: `SequentialPager`'s pages, ranked by the exact best score of their keys."""
    from icecache.indexes.registry import available_pagers, register_pager
    from icecache.indexes.sequential import SequentialPager

    if "token_pages_exact" in available_pagers():
        return

    @register_pager("token_pages_exact")
    class TokenPagesExact(SequentialPager):
        def _build(self, keys: torch.Tensor) -> None:
            self._keys = keys.clone()
            super()._build(keys)

        def _insert(self, keys: torch.Tensor, start: int) -> None:
            self._keys = torch.cat([self._keys[:start], keys])
            super()._insert(keys, start)

        def _rank_pages(self, queries: torch.Tensor, budget: int) -> tuple[np.ndarray, np.ndarray]:
            best = (queries.float() @ self._keys.T).max(0).values.numpy()  # [n]
            size = self.page_size
            padded = np.full(self._pages * size, -np.inf, np.float32)
            padded[: best.shape[0]] = best
            score = padded.reshape(self._pages, size).max(1)  # page i = positions [i P, (i + 1) P)
            order = np.argsort(-score, kind="stable")[: min(budget, self._pages)]
            return order.astype(np.int64), score[order]


def main() -> int:
    from selection_recall import load_run, parse_args, prefill_sample

    args = parse_args(__doc__)

    from icecache.eval.harness import decode_greedy
    from icecache.eval.methods import get_method
    from icecache.eval.ruler import score_sample

    register()
    model, tok, run, config = load_run(args.run, args.budget)
    for item in args.samples:
        start = time.time()
        sample, prefill = prefill_sample(model, tok, run, config, item, args.length)
        row: dict = {"sample": item}
        for method in ("quest", "icecache:token_pages_exact"):
            cache = get_method(method).cache(model, prefill, config)
            try:
                tokens = decode_greedy(model, cache, prefill.last_logits, sample.tokens_to_generate, {tok.eos_token_id})
            finally:
                cache.close()
            text = tok.decode(tokens, skip_special_tokens=True)
            row[method] = {"score": score_sample(sample, text), "prediction": text[:80]}
        row["seconds"] = round(time.time() - start, 1)
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
