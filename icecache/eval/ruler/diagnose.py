"""Why did a method lose a RULER sample? Classify each loss as model, budget, page miss or search miss.

For a sample a method scored below 1 (partial credit counts: RULER's multi-answer tasks score fractions):

* ``model``   full attention does no better on it (scores no higher than the method): the model cannot do it
  at this length;
* ``budget``  the exact top-B token oracle (``exact`` at the same budget) does no better: B tokens are not enough;
* ``search miss`` / ``page miss``: full attention and the oracle both score higher than the method. The sample is
  replayed: the method's cache decodes the full-attention answer (teacher forcing), and at every step, sparse
  layer and KV head we compare, over the prompt tokens that hold the answer (the needle values;
  `RulerSample.needle_spans`),
  - the *search*: the pages the method selected,
  - the *pages*: the same pager's own pages ranked exhaustively (every page scored by its best q.k over the
    GQA group, whole pages in rank order within the budget: what a perfect search over these pages returns),
  - the *oracle*: the exact top-B tokens.
  If the exhaustive ranking of the pager's pages covers the answer tokens clearly better than the search did
  (recall higher by more than ``margin``), the pages held the answer and the search did not reach them: a
  *search miss*. Otherwise the answer tokens sit in pages that even a perfect ranking drops (split across
  pages with irrelevant neighbours): a *page miss*.

  For M-DCI (``icecache`` with ``index="mdci"``) the recalls do not decide: the sample is answered again with the
  same pages ranked exhaustively (``mdci[search=exhaustive]``, no search). If that scores as high as full
  attention and the oracle both do, a perfect search would have: a *search miss*; if not, even the perfect
  ranking of these pages loses it: a *page miss*. The row's
  ``scan_score`` is that answer's score. Recall of the answer tokens was not a reliable proxy: on Gemma-3-270M at
  8k, two samples with recall 0.99 / 0.95 for the exhaustive ranking (0.82 / 0.60 for the search) were still lost
  by it, and one with no recall gap was answered by it.

An earlier rule read ``model`` / ``budget`` as "full attention / the oracle scores below 1 too", which put a
sample full attention answers in part and the method less (Gemma-3 at 16k, fwe: 0.67 vs 0.33) under ``model``.
`diagnose_losses` re-classifies stored rows from their scores and replays only those that now need it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

#: A search miss needs the exhaustive page ranking to beat the search's answer recall by more than this.
SEARCH_MARGIN = 0.1


@dataclass
class Replay:
    """Answer-token recall of one method's decode of one sample, averaged over steps, sparse layers and KV heads."""

    search_recall: float
    pages_recall: float
    oracle_recall: float
    steps: int
    per_layer: dict[int, tuple[float, float, float]] = field(default_factory=dict)


def answer_positions(tokenizer: Any, sample: Any) -> np.ndarray:
    """Prompt token positions that hold the answers: tokens overlapping an answer string inside a needle span."""
    enc = tokenizer(sample.prompt, return_offsets_mapping=True)
    offsets = enc["offset_mapping"]
    spans = []
    for start, end in sample.needle_spans:
        text = sample.prompt[start:end]
        for answer in sample.answers:
            at = text.find(answer)
            if at >= 0:
                spans.append((start + at, start + at + len(answer)))
    return np.array(sorted({i for i, (a, b) in enumerate(offsets) if b > a and any(a < e and b > s for s, e in spans)}),
                    dtype=np.int64)


def _exhaustive_pages(pager: Any, keys: torch.Tensor, queries: torch.Tensor, budget: int) -> np.ndarray:
    """Positions of the pager's own pages ranked by their best q.k over the group, whole pages within ``budget``."""
    pages = pager.table.as_dict()
    if not pages:
        return np.zeros(0, np.int64)
    best = (queries @ keys.T).max(0).values.numpy()  # [n]
    ids = list(pages)
    scores = np.array([best[pages[i]].max() for i in ids])
    out, used = [], 0
    for j in np.argsort(-scores, kind="stable"):
        size = len(pages[ids[j]])
        if used + size > budget:
            break
        out.append(pages[ids[j]])
        used += size
    return np.concatenate(out) if out else np.zeros(0, np.int64)


def replay(model: Any, prefill: Any, cache: Any, tokens: list[int], answer_pos: np.ndarray) -> Replay:
    """Teacher-force ``tokens`` through ``cache`` (an `IceCache` built from ``prefill``) and measure, at every
    step and sparse layer / KV head, how many ``answer_pos`` (absolute prompt positions) each of search,
    exhaustive pages and oracle would attend."""
    import icecache.runtime.layer as layer_module
    from icecache.runtime.attention import use_attention

    budget = cache.ice.budget
    sink = cache.ice.sink
    records: list[tuple[int, float, float, float]] = []
    real_select = layer_module.select_layer

    def spy(pagers, queries, budget_, gqa, *, layer_idx, **kw):
        sel = real_select(pagers, queries, budget_, gqa, layer_idx=layer_idx, **kw)
        q = queries.detach().float().cpu()
        for h, pager in enumerate(pagers[0]):
            local = answer_pos - sink  # pager-local positions of the answer tokens
            local = local[(local >= 0) & (local < len(pager))]
            if local.size == 0:
                continue
            _, keys, _ = cache.layers[layer_idx].host_kv(0, h)
            keys = keys.float()
            oracle = np.argsort(-(q[0, h] @ keys.T).max(0).values.numpy(), kind="stable")[:budget]
            exhaustive = _exhaustive_pages(pager, keys, q[0, h], budget)
            records.append((layer_idx, *(float(np.isin(local, chosen).mean()) for chosen in (sel.positions[0][h], exhaustive, oracle))))
        return sel

    layer_module.select_layer = spy
    try:
        with use_attention(model), torch.no_grad():
            for tok in tokens[:-1]:
                model(torch.tensor([[tok]]), past_key_values=cache, use_cache=True)
    finally:
        layer_module.select_layer = real_select
    if not records:
        return Replay(float("nan"), float("nan"), float("nan"), 0)
    arr = np.array([r[1:] for r in records])
    layers = sorted({r[0] for r in records})
    per_layer = {}
    for layer in layers:
        rows = np.array([r[1:] for r in records if r[0] == layer])
        per_layer[layer] = tuple(float(x) for x in rows.mean(0))
    return Replay(float(arr[:, 0].mean()), float(arr[:, 1].mean()), float(arr[:, 2].mean()), len(tokens) - 1, per_layer)


def classify(score: float, full_score: float, oracle_score: float, replayed: Replay | None,
             margin: float = SEARCH_MARGIN, scan_score: float | None = None) -> str:
    """``model``, ``budget``, ``search miss`` or ``page miss`` of a sample the method scored ``score`` (< 1) on
    (see the module docstring). ``scan_score``: the score of the sample answered with the pager's pages ranked
    exhaustively, when it was run: it decides between the two misses (as high as both references: search miss);
    without it the recalls of ``replayed`` do."""
    if full_score <= score:
        return "model"
    if oracle_score <= score:
        return "budget"
    if scan_score is not None:
        return "search miss" if scan_score >= min(full_score, oracle_score) else "page miss"
    if replayed is None or np.isnan(replayed.search_recall):
        return "page miss"
    return "search miss" if replayed.pages_recall > replayed.search_recall + margin else "page miss"


def needs_replay(score: float, full_score: float, oracle_score: float) -> bool:
    """Whether a loss is a search or page miss, decided by a replay: both references score above the method."""
    return full_score > score and oracle_score > score


def scan_config(method: str, config: Any) -> Any | None:
    """The config that answers ``method`` with its pages ranked exhaustively (M-DCI's ``search="exhaustive"``),
    or None where the method has no such ranking to try (other pagers)."""
    from icecache.eval.methods import get_method

    resolved = get_method(method)
    base = getattr(resolved, "base", None) or resolved  # a variant name[...] ranks with its base's pager
    if base.name in ("icecache", "icecache-r") and resolved.pager(config) == "mdci":
        return config.replace(index_params={**config.index_params, "search": "exhaustive"})
    return None


def _plan(records: list[dict[str, Any]], method: str, budget: str, scan: Any | None,
          previous: dict[tuple, dict[str, Any]] | None) -> tuple[list[dict[str, Any]], list[tuple[dict, dict, bool]]]:
    """Split ``method@budget``'s lost samples into rows classified from stored ones and (record, row, replay
    needed) still to compute."""
    index = {(r["task"], r["length"], r["index"], r["method"], str(r["budget"])): r for r in records}
    lost = [r for r in records if r["method"] == method and str(r["budget"]) == budget and r["score"] < 1.0]
    rows, todo = [], []
    for r in lost:
        key = (r["task"], r["length"], r["index"])
        full, oracle = index.get((*key, "full", "-")), index.get((*key, "exact", budget))
        if full is None or oracle is None:
            continue  # the run has not answered this sample with full and exact yet
        row = {"task": r["task"], "length": r["length"], "index": r["index"], "method": method, "budget": budget,
               "score": r["score"], "full": full["score"], "oracle": oracle["score"]}
        old = (previous or {}).get(row_key(r))
        replay_needed = needs_replay(r["score"], full["score"], oracle["score"])
        if old is not None and (not replay_needed or ("search_recall" in old and (scan is None or "scan_score" in old))):
            kept = {k: old[k] for k in ("search_recall", "pages_recall", "oracle_recall", "steps", "scan_score")
                    if replay_needed and k in old}
            rows.append({**row, **kept, "class": classify(r["score"], full["score"], oracle["score"], _stored_replay(old),
                                                          scan_score=kept.get("scan_score"))})
        else:
            todo.append((r, row, replay_needed))
    return rows, todo


class SampleReference:
    """The dense prefill of one RULER sample and full attention's answer to it, kept for the next replay of the
    same sample (the diagnosis replays a sample once per method@budget that lost it: one prefill serves all)."""

    def __init__(self, model: Any, tokenizer: Any, *, seed: int, chat_template: bool, obs_window: int) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.seed, self.chat_template, self.obs_window = seed, chat_template, obs_window
        self.key: tuple | None = None
        self.sample: Any = None
        self.prefill: Any = None
        self.answer: list[int] = []
        self.prefills = 0  #: prefills run so far (one per distinct sample when replays come grouped by sample)

    def get(self, task: str, length: int, index: int) -> tuple[Any, Any, list[int]]:
        """(sample, prefill, full attention's greedy answer, stopped once it scores 1) of one sample."""
        from icecache.eval.harness import clone_kv, decode_greedy, run_prefill
        from icecache.eval.ruler import make_sample, score_sample

        if self.key != (task, length, index):
            self.key, self.prefill = None, None  # free the previous sample's cache before the next prefill
            sample = make_sample(task, self.tokenizer, length, seed=self.seed, index=index, chat_template=self.chat_template)
            ids = self.tokenizer(sample.prompt, return_tensors="pt")["input_ids"]
            prefill = run_prefill(self.model, ids, obs_window=self.obs_window)
            self.answer = decode_greedy(
                self.model, clone_kv(prefill.kv), prefill.last_logits, sample.tokens_to_generate, {self.tokenizer.eos_token_id},
                stop_when=lambda t, s=sample: score_sample(s, self.tokenizer.decode(t, skip_special_tokens=True)) >= 1.0)
            self.key, self.sample, self.prefill = (task, length, index), sample, prefill
            self.prefills += 1
        return self.sample, self.prefill, self.answer


def diagnose_targets(model: Any, tokenizer: Any, records: list[dict[str, Any]], targets: list[tuple[str, str]], *,
                     seed: int, config: Any, chat_template: bool, progress: bool = True,
                     previous: dict[tuple, dict[str, Any]] | None = None,
                     on_row: Callable[[dict[str, Any]], None] | None = None) -> dict[tuple[str, str], list[dict[str, Any]]]:
    """Classify every sample each ``(method, budget)`` of ``targets`` lost in ``records`` (one run's predictions).
    Returns, per target, one row per lost sample: its key, the class and, for search/page misses, the replay's
    recalls. ``previous`` (rows of an earlier call, by `row_key`) are re-classified from their scores and kept,
    unless the sample now needs a replay the row lacks; ``on_row`` sees each row computed anew (to append it).
    Rows that need no replay come first; replays run grouped by sample, so a sample several targets lost is
    prefilled once."""
    from tqdm.auto import tqdm

    from icecache.eval.harness import decode_greedy
    from icecache.eval.methods import get_method
    from icecache.eval.ruler import score_sample

    out: dict[tuple[str, str], list[dict[str, Any]]] = {}
    todo = []
    for method, budget in targets:
        scan = scan_config(method, config)
        out[(method, budget)], pending = _plan(records, method, budget, scan, previous)
        todo += [(r, row, needed, scan) for r, row, needed in pending]
    todo.sort(key=lambda item: (item[2], item[0]["task"], item[0]["length"], item[0]["index"]))
    reference = SampleReference(model, tokenizer, seed=seed, chat_template=chat_template, obs_window=config.window)
    names = ",".join(f"{m}@{b}" for m, b in targets)
    for r, row, replay_needed, scan in tqdm(todo, desc=f"diagnose {names}", disable=not progress):
        method, budget = row["method"], row["budget"]
        replayed = None
        if replay_needed:
            sample, prefill, answer = reference.get(r["task"], r["length"], r["index"])
            cache = get_method(method).cache(model, prefill, config.replace(budget=int(budget)))
            try:
                cache.workers.wait_all()
                replayed = replay(model, prefill, cache, answer, answer_positions(tokenizer, sample))
            finally:
                cache.close()
            row.update(search_recall=replayed.search_recall, pages_recall=replayed.pages_recall,
                       oracle_recall=replayed.oracle_recall, steps=replayed.steps)
            if scan is not None:
                cache = get_method(method).cache(model, prefill, scan.replace(budget=int(budget)))
                try:
                    tokens = decode_greedy(model, cache, prefill.last_logits, sample.tokens_to_generate,
                                           {tokenizer.eos_token_id})
                finally:
                    cache.close()
                row["scan_score"] = score_sample(sample, tokenizer.decode(tokens, skip_special_tokens=True))
        row["class"] = classify(row["score"], row["full"], row["oracle"], replayed, scan_score=row.get("scan_score"))
        out[(method, budget)].append(row)
        if on_row is not None:
            on_row(row)
    return out


def diagnose_losses(model: Any, tokenizer: Any, records: list[dict[str, Any]], method: str, budget: str, *,
                    seed: int, config: Any, chat_template: bool, progress: bool = True,
                    previous: dict[tuple, dict[str, Any]] | None = None,
                    on_row: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
    """`diagnose_targets` for one ``method@budget``: its rows."""
    return diagnose_targets(model, tokenizer, records, [(method, budget)], seed=seed, config=config,
                            chat_template=chat_template, progress=progress, previous=previous,
                            on_row=on_row)[(method, budget)]


def _stored_replay(row: dict[str, Any]) -> Replay | None:
    """The recalls a stored diagnosis row holds, or None if it was not replayed."""
    if "search_recall" not in row:
        return None
    return Replay(row["search_recall"], row["pages_recall"], row["oracle_recall"], row.get("steps", 0))


def row_key(record: dict[str, Any]) -> tuple[str, ...]:
    """(task, length, index, method, budget) of a prediction or diagnosis row, as strings."""
    return tuple(str(record[k]) for k in ("task", "length", "index", "method", "budget"))

