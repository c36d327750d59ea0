"""Page selection of one sparse layer's decode step, and the accounting of what every step selected and copied.

Per decode step and sparse layer::

    select_layer   the pagers of every (row, KV head) pick pages for the step's queries (<= budget tokens)
    BulkLoader     brings the selected positions not yet resident into the budget slots (`loader.py`)
    DecodeAccounting.record_load   counters (bytes, copies, pages reused) and, with ``trace``, one record per
                   (step, layer, row, KV head)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from icecache.core.errors import InputError
from icecache.core.top_p import pages_within_mass


@dataclass
class LayerSelection:
    """The positions every (row, KV head) of one layer attends besides sink and window, ``[row][kv head]``.

    ``positions`` are host (middle) positions, ``indptrs`` their CSR page offsets (None when reused from
    another layer) and ``pages`` the selected page ids (None unless traced or when reused).
    """

    positions: list[list[np.ndarray]]
    indptrs: list[list[np.ndarray | None]]
    pages: list[list[np.ndarray | None]]


def select_pages(pager: Any, queries: torch.Tensor, budget: int, gqa: str, top_p: float | None = None,
                 scale: float = 1.0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pages of one (row, KV head) for its query group ``queries`` ``[n_rep, D]`` (float32, host).

    ``gqa="union"``: the group selects ``budget`` tokens together; ``"per-head"``: every query head selects
    ``budget // n_rep`` tokens and the step attends the union. ``top_p`` (with the attention's softmax
    ``scale``) keeps the shortest ranked prefix of each selection whose estimated mass reaches it
    (`icecache.core.top_p`). Returns ``(pages, indptr, positions)``.
    """
    if gqa == "union":
        return _select_one(pager, queries, budget, top_p, scale)
    n_rep = queries.shape[0]
    per_head = [_select_one(pager, queries[g : g + 1], budget // n_rep, top_p, scale)[0] for g in range(n_rep)]
    flat = np.concatenate(per_head)
    _, first = np.unique(flat, return_index=True)
    pages = flat[np.sort(first)]  # the union, in first-selected order
    indptr, positions = pager.table.csr(pages)
    return pages, indptr, positions


def _select_one(pager: Any, queries: torch.Tensor, budget: int, top_p: float | None,
                scale: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One pager's ``(pages, indptr, positions)`` within ``budget``, cut to ``top_p`` of the mass when set."""
    pages, indptr, positions, scores = pager.select_arrays(queries, budget, check=False)
    if top_p is None:
        return pages, indptr, positions
    keep = pages_within_mass(indptr, scores, scale, top_p)
    return pages[:keep], indptr[: keep + 1], positions[: indptr[keep]]


def select_layer(pagers: list[list[Any]], queries: torch.Tensor, budget: int, gqa: str, *, layer_idx: int,
                 keep_pages: bool = False, top_p: float | None = None, scale: float = 1.0) -> LayerSelection:
    """Select for every (row, KV head) of a layer; ``queries`` ``[B, H, n_rep, D]`` (any device and dtype).
    ``top_p`` and ``scale``: see `select_pages` (a fused one-call selection has no page scores: not used then)."""
    q_host = queries.detach().to("cpu", torch.float32).contiguous()
    if not np.isfinite(q_host.numpy()).all():  # numpy: no torch op (and GIL round trip) per layer step
        raise InputError(f"layer {layer_idx}: the model produced NaN/inf queries")
    B, H = q_host.shape[:2]
    sel = LayerSelection([], [], [])
    for b in range(B):
        fused = None if top_p is not None else select_row_at_once(pagers[b], q_host[b], budget, gqa, keep_pages)
        if fused is not None:
            sel.positions.append(fused.positions[0])
            sel.indptrs.append(fused.indptrs[0])
            sel.pages.append(fused.pages[0])
            continue
        prow, irow, grow = [], [], []
        for h in range(H):
            pages, indptr, positions = select_pages(pagers[b][h], q_host[b, h], budget, gqa, top_p, scale)
            prow.append(positions)
            irow.append(indptr)
            grow.append(pages if keep_pages else None)
        sel.positions.append(prow)
        sel.indptrs.append(irow)
        sel.pages.append(grow)
    return sel


def select_row_at_once(pagers: list[Any], queries: torch.Tensor, budget: int, gqa: str,
                       keep_pages: bool) -> LayerSelection | None:
    """One row's selection for every KV head in one call, where the pagers' class offers it
    (`SemanticPager.select_layer_positions`: ``exact``, ``mdci``) and the GQA rule is ``"union"``; None otherwise
    (select head by head). ``queries`` ``[H, n_rep, D]`` float32, host."""
    if gqa != "union":
        return None
    heads = type(pagers[0]).select_layer_positions(pagers, queries, budget)
    if heads is None:
        return None
    return LayerSelection([[positions for _, _, positions in heads]], [[indptr for _, indptr, _ in heads]],
                          [[pages if keep_pages else None for pages, _, _ in heads]])


COUNTERS = ("steps", "bytes_copied", "copies", "layer_steps", "selections", "pages_copied", "pages_selected",
            "pages_reused", "tokens_selected", "tokens_copied")


class DecodeAccounting:
    """Cumulative counters of every sparse decode step (see `COUNTERS`) and, with ``trace``, one record per
    (decode step, layer, row, KV head): ``{step, layer, row, kv_head, pages, tokens, new_pages, new_tokens,
    bytes}``."""

    def __init__(self, trace: bool = False) -> None:
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.tracing = trace
        self.trace: list[dict[str, Any]] = []

    def start_step(self) -> int:
        """Count a new decode step; returns its number (1 = the first)."""
        self.counters["steps"] += 1
        return self.counters["steps"]

    def record_load(self, layer_idx: int, report: Any, selection: LayerSelection, bytes_per_token: int) -> None:
        """Add one layer step's `LoadReport` (and its trace records)."""
        c = self.counters
        c["layer_steps"] += 1
        c["selections"] += len(report.per_head)
        c["bytes_copied"] += report.bytes_copied
        c["copies"] += report.copies
        c["pages_selected"] += report.pages_selected
        c["pages_reused"] += report.pages_reused
        c["pages_copied"] += report.pages_selected - report.pages_reused
        c["tokens_selected"] += report.tokens_selected
        c["tokens_copied"] += report.tokens_copied
        if not self.tracing:
            return
        for b, h, n_sel, n_reused, n_copied in report.per_head:
            pages = selection.pages[b][h]
            self.trace.append({
                "step": c["steps"], "layer": layer_idx, "row": b, "kv_head": h,
                "pages": [] if pages is None else pages.tolist(),
                "tokens": len(selection.positions[b][h]),
                "new_pages": n_sel - n_reused,
                "new_tokens": n_copied,
                "bytes": n_copied * bytes_per_token,
            })
