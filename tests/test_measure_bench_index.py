"""The index benchmark's helpers: shared-softmax metrics equal `icecache.core.metrics`; the k-means reference
and oracle ranking keep the page rules; the command line parses."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from icecache.core.metrics import attention_recall, hit_rate, output_error
from icecache.core.spec import parse_params
from icecache.measure.bench_index import KMeansPages, StepMetrics, build_parser, kmeans_groups, oracle_rank, parse_variant


def test_step_metrics_match_core_metrics():
    g = torch.Generator().manual_seed(0)
    K, V = torch.randn(500, 16, generator=g), torch.randn(500, 16, generator=g)
    q = torch.randn(3, 16, generator=g) * 2
    sink, mid_end = 4, 430
    mid = K[sink:mid_end]
    m = StepMetrics(q, K, V, mid, [8, 64])
    for b in (8, 64):
        for sel in (torch.tensor([], dtype=torch.int64), torch.randperm(len(mid), generator=g)[:b], torch.arange(b)):
            kept = torch.cat([torch.arange(sink), torch.arange(mid_end, 500), sel + sink])
            assert m.hit_rate(sel, b) == pytest.approx(hit_rate(q, mid, sel, b), abs=1e-12)
            rec, err = m.recall_and_error(kept)
            assert rec == pytest.approx(attention_recall(q, K, kept), abs=1e-10)
            assert err == pytest.approx(output_error(q, K, V, kept), abs=1e-10)


def test_kmeans_reference_pages():
    x = torch.randn(3000, 8, generator=torch.Generator().manual_seed(1))
    groups = kmeans_groups(x, 200, 16, seed=0)
    flat = np.concatenate(groups)
    assert sorted(flat.tolist()) == list(range(3000))
    assert max(len(gr) for gr in groups) <= 16 and len(groups) <= 200
    with pytest.raises(ValueError):
        kmeans_groups(x, 100, 16, seed=0)  # 100 x 16 < 3000
    chunked = kmeans_groups(x, 200, 16, seed=0, chunk_rows=97)  # distances in 31 chunks: same clustering
    assert [g.tolist() for g in chunked] == [g.tolist() for g in groups]
    km = KMeansPages(16, seed=0)
    km.build(x, 250)
    assert 240 <= km.table.num_pages <= 250
    for _ in range(20):
        km.insert(torch.randn(8))
    km.table.check()
    sel = km.select(torch.randn(3, 8), 128)
    assert len(sel) <= 128 and len(set(sel.tolist())) == len(sel)


def test_oracle_rank_takes_best_pages_first():
    from icecache.core.pages import PageTable

    t = PageTable(4)
    t.new_pages([np.arange(i, i + 4) for i in range(0, 40, 4)] + [np.array([40, 41])])
    scores = torch.arange(42, dtype=torch.float32)
    scores[41] = 100.0  # the small last page holds the best token
    pos = oracle_rank(t, scores, 8)
    assert pos.tolist() == [40, 41, 36, 37, 38, 39]  # 2 + 4 tokens; the next page (4) would exceed 8


def test_cli_parser():
    args = build_parser().parse_args(["--quick", "--mdci", "field_of_view=60,p0=0.05,page_score=mass", "--variant",
                                      "a=mdci[p0=0.1]"])
    assert args.quick and args.mdci == {"field_of_view": 60, "p0": 0.05, "page_score": "mass"}
    assert parse_params("x=None") == {"x": None}
    assert parse_variant("F30=mdci[field_of_view=30]", {"p0": 0.1}) == ("F30", ("mdci", {"p0": 0.1, "field_of_view": 30}))
    assert parse_variant("mdci[field_of_view=30]", {"p0": 0.1}) == ("mdci[field_of_view=30]", ("mdci", {"p0": 0.1, "field_of_view": 30}))
    assert parse_variant("h=hnsw[ef=16]", {"p0": 0.1}) == ("h", ("hnsw", {"ef": 16}))
    assert parse_variant("hnsw[ef=16]", {}) == ("hnsw[ef=16]", ("hnsw", {"ef": 16}))
    with pytest.raises(SystemExit):  # a malformed --mdci is argparse's one-line error
        build_parser().parse_args(["--mdci", "field_of_view"])
